// SPDX-License-Identifier: Apache-2.0
// DynamicCache: grows chunk by chunk without moving cached tokens; crop and reset keep the
// chunks they empty as spares for later appends (bounded by max_spare_chunks); an optional
// max_seq_len bounds it.
#include <algorithm>
#include <set>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/counting_new.hpp"
#include "support/throws.hpp"

using namespace kvcache;

namespace {

/// What a view exposes: its K and V rows as floats and its positions.
struct Gathered {
  std::vector<float> k, v;
  std::vector<position_t> pos;
};
template <KVView V>
Gathered gathered(const V& view) {
  Gathered g;
  reference::gather_view(view, g.k, g.v, g.pos);
  return g;
}

/// The K pointer of every chunk of (layer, seq).
template <class Cache>
std::set<const void*> chunk_pointers(const Cache& cache, std::size_t layer, std::size_t seq) {
  std::set<const void*> out;
  const auto view = cache.view(layer, seq);
  for (std::size_t i = 0; i < view.num_segments(); ++i) out.insert(view.segment(i).k);
  return out;
}

}  // namespace

TEST_CASE("DynamicCache grows one chunk at a time and never moves cached tokens") {
  auto rng = kvcache::test::make_rng("dynamic-growth");
  DynamicCache<half> cache({.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .chunk_len = 4});
  const auto kv = kvcache::test::random_kv(rng, 40, 2, 8);
  cache.append(0, 0, kv.k_block(0, 3), kv.v_block(0, 3));
  const half* first_chunk = cache.view(0, 0).segment(0).k;
  std::size_t expected_chunks = 1;
  for (std::size_t t = 3; t < 40; ++t) {
    cache.append(0, 0, kv.k_block(t, 1), kv.v_block(t, 1));
    expected_chunks = (t + 1 + 3) / 4;
    REQUIRE(cache.memory_bytes() == expected_chunks * kv_cache_bytes(1, 2, 8, 4, 2));
    REQUIRE(cache.view(0, 0).segment(0).k == first_chunk);
  }
  const auto view = cache.view(0, 0);
  REQUIRE(view.num_segments() == 10);
  kvcache::test::check_view_invariants(view);
  // stored rows equal the (rounded) input, chunk boundaries included
  const Gathered g = gathered(view);
  REQUIRE(g.k == kvcache::test::rounded<half>(kv.k));
  REQUIRE(g.v == kvcache::test::rounded<half>(kv.v));
}

TEST_CASE("DynamicCache with max_seq_len throws capacity_error and changes nothing") {
  DynamicCache<float> cache({.num_layers = 1,
                             .num_kv_heads = 1,
                             .head_dim = 2,
                             .max_batch = 2,
                             .max_seq_len = 5,
                             .chunk_len = 2});
  std::vector<float> kv(12, 1.0f);
  cache.append(0, 1, TokenBlock<const float>{std::span<const float>(kv).first(8), 4, 1, 2},
               TokenBlock<const float>{std::span<const float>(kv).first(8), 4, 1, 2});
  const auto bytes = cache.memory_bytes();
  const auto before = kvcache::test::cache_contents(cache);
  kvcache::test::require_throws<capacity_error>(
      [&] {
        cache.append(0, 1, TokenBlock<const float>{std::span<const float>(kv).first(4), 2, 1, 2},
                     TokenBlock<const float>{std::span<const float>(kv).first(4), 2, 1, 2});
      },
      "append of 2 tokens", "max_seq_len 5", "holds 4");
  REQUIRE(cache.memory_bytes() == bytes);
  REQUIRE(kvcache::test::cache_contents(cache) == before);
  REQUIRE(cache.capacity() == 5);
  REQUIRE(DynamicCache<float>({.num_layers = 1, .num_kv_heads = 1, .head_dim = 1}).capacity() ==
          std::numeric_limits<std::size_t>::max());
}

TEST_CASE("DynamicCache refills a reset sequence from its spares without allocating") {
  auto rng = kvcache::test::make_rng("dynamic-spares");
  DynamicCache<half> cache(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .chunk_len = 4});
  const auto first = kvcache::test::random_kv(rng, 10, 2, 8);
  const auto second = kvcache::test::random_kv(rng, 10, 2, 8);
  for (std::size_t l = 0; l < 2; ++l)
    cache.append(l, 0, first.k_block(0, 10), first.v_block(0, 10));
  const std::size_t bytes = cache.memory_bytes();
  REQUIRE(bytes == 2 * 3 * kv_cache_bytes(1, 2, 8, 4, 2));  // 3 chunks of 4 per layer
  auto old_chunks = chunk_pointers(cache, 0, 0);
  old_chunks.merge(chunk_pointers(cache, 1, 0));

  cache.reset(0);
  REQUIRE(cache.seq_length(0) == 0);
  REQUIRE(cache.memory_bytes() == bytes);
  REQUIRE(cache.spare_bytes() == bytes);

  const std::size_t allocations = kvcache::test::g_allocations.load();
  for (std::size_t l = 0; l < 2; ++l) {
    cache.append(l, 0, second.k_block(0, 10), second.v_block(0, 10));
  }
  REQUIRE(kvcache::test::g_allocations.load() == allocations);
  REQUIRE(cache.memory_bytes() == bytes);
  REQUIRE(cache.spare_bytes() == 0);
  // the reused chunks hold the new tokens only
  for (std::size_t l = 0; l < 2; ++l) {
    const Gathered g = gathered(cache.view(l, 0));
    REQUIRE(g.k == kvcache::test::rounded<half>(second.k));
    REQUIRE(g.v == kvcache::test::rounded<half>(second.v));
  }
  auto new_chunks = chunk_pointers(cache, 0, 0);
  new_chunks.merge(chunk_pointers(cache, 1, 0));
  REQUIRE(new_chunks == old_chunks);  // the same six chunks, whichever layer each went to
}

TEST_CASE("DynamicCache spares pass from one sequence to another and never leak its tokens") {
  auto rng = kvcache::test::make_rng("dynamic-spares-across");
  DynamicCache<float> cache(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .max_batch = 2, .chunk_len = 4});
  const auto a = kvcache::test::random_kv(rng, 12, 1, 4);
  const auto b = kvcache::test::random_kv(rng, 3, 1, 4);
  cache.append(0, 0, a.k_block(0, 12), a.v_block(0, 12));
  const auto a_chunks = chunk_pointers(cache, 0, 0);
  cache.reset(0);
  cache.append(0, 1, b.k_block(0, 3), b.v_block(0, 3));
  const auto b_chunks = chunk_pointers(cache, 0, 1);
  REQUIRE(b_chunks.size() == 1);
  REQUIRE(a_chunks.contains(*b_chunks.begin()));  // a spare of sequence 0
  REQUIRE(cache.memory_bytes() == kv_cache_bytes(1, 1, 4, 12, 4));
  const Gathered g = gathered(cache.view(0, 1));
  REQUIRE(g.k == b.k);  // 3 tokens of b, none of a's left-overs
  REQUIRE(g.v == b.v);
  REQUIRE(g.pos == std::vector<position_t>{0, 1, 2});
}

TEST_CASE("DynamicCache crop of rejected draft tokens and the next append allocate nothing") {
  auto rng = kvcache::test::make_rng("dynamic-spares-crop");
  DynamicCache<half> cache({.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .chunk_len = 4});
  const auto kv = kvcache::test::random_kv(rng, 9, 2, 8);
  cache.append(0, 0, kv.k_block(0, 9), kv.v_block(0, 9));  // 3 chunks
  const std::size_t bytes = cache.memory_bytes();
  std::size_t allocations = 0;
  for (int round = 0; round < 100; ++round) {
    if (round == 1) allocations = kvcache::test::g_allocations.load();  // round 0 sized spares
    cache.crop(0, 3);  // drop 6 draft tokens: 2 chunks become spares
    REQUIRE(cache.spare_bytes() == 2 * kv_cache_bytes(1, 2, 8, 4, 2));
    cache.append(0, 0, kv.k_block(3, 6), kv.v_block(3, 6));
  }
  REQUIRE(kvcache::test::g_allocations.load() == allocations);
  REQUIRE(cache.memory_bytes() == bytes);
  REQUIRE(gathered(cache.view(0, 0)).k == kvcache::test::rounded<half>(kv.k));
}

TEST_CASE("DynamicCache keeps at most max_spare_chunks spares; shrink_to_fit frees them") {
  std::vector<float> kv(12 * 2, 1.0f);
  const TokenBlock<const float> block{kv, 12, 1, 2};
  for (const std::size_t limit : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
    DynamicCache<float> cache({.num_layers = 1,
                               .num_kv_heads = 1,
                               .head_dim = 2,
                               .max_batch = 2,
                               .chunk_len = 4,
                               .max_spare_chunks = limit});
    cache.append(0, 0, block, block);
    cache.append(0, 1, block, block);
    const std::size_t chunk = kv_cache_bytes(1, 1, 2, 4, 4);
    REQUIRE(cache.memory_bytes() == 6 * chunk);
    cache.reset(0);
    cache.reset(1);
    const std::size_t kept = std::min<std::size_t>(limit, 6);
    REQUIRE(cache.spare_bytes() == kept * chunk);
    REQUIRE(cache.memory_bytes() == kept * chunk);
    cache.shrink_to_fit();
    REQUIRE(cache.spare_bytes() == 0);
    REQUIRE(cache.memory_bytes() == 0);
  }
}
