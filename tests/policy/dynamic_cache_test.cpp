// SPDX-License-Identifier: Apache-2.0
// DynamicCache: grows chunk by chunk without moving cached tokens; crop and reset free chunks;
// an optional max_seq_len bounds it.
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/throws.hpp"

using namespace kvcache;

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
  std::vector<float> k, v;
  std::vector<position_t> pos;
  reference::gather_view(view, k, v, pos);
  REQUIRE(k == kvcache::test::rounded<half>(kv.k));
  REQUIRE(v == kvcache::test::rounded<half>(kv.v));
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
