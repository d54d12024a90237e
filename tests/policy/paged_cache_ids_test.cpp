// SPDX-License-Identifier: Apache-2.0
// PagedCache keeps token ids and K/V from disagreeing: a tracked sequence's K/V never runs past
// its ids, append() with ids checks them layer by layer, and restore() never shares a block that
// a later write would copy away from under its indexed child (the SEGV on eviction it caused).
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::iota_ids;
using kvcache::test::paged_state;
using kvcache::test::require_throws;
using kvcache::test::SyntheticModel;
using kvcache::test::TokenKV;

namespace {

constexpr std::size_t kLayers = 2, kHeads = 1, kDim = 4;
const SyntheticModel kModel{kLayers, kHeads, kDim};

PagedCache<float> make_cache(std::size_t num_blocks, std::size_t block_size, std::size_t max_batch,
                             bool evict) {
  return PagedCache<float>({.num_layers = kLayers,
                            .num_kv_heads = kHeads,
                            .head_dim = kDim,
                            .num_blocks = num_blocks,
                            .block_size = block_size,
                            .max_batch = max_batch,
                            .evict_when_full = evict});
}

void require_consistent(const PagedCache<float>& cache) {
  const std::string problem = cache.check_consistency();
  INFO(problem);
  REQUIRE(problem.empty());
}

}  // namespace

TEST_CASE(
    "a restored sequence whose layers differ shares no block a write would copy from "
    "under its child; eviction afterwards finds its leaves") {
  // The reproduction of issue 21: before the fix the restore shared blocks A and B with slot 1
  // although its layer 0 filled neither; the append to layer 0 then copied A and released it
  // while slot 1 kept A's indexed child B, and the eviction below walked off the LRU list.
  auto cache = make_cache(4, 2, 3, true);
  const std::vector<token_id> ids{1, 2, 3, 4, 5};
  REQUIRE(cache.admit(0, std::span<const token_id>(ids).first(4)) == 0);
  kModel.prefill(cache, 0, ids, 0, 4);  // blocks A and B, both indexed
  cache.release(0);                     // ... and cached
  REQUIRE(cache.stats().blocks_cached == 2);

  // Slot 1 of another cache: ids [1..5], layer 0 empty, layer 1 three positions.
  const auto kv1 = kModel.kv(1, ids, 0, 3);
  const std::vector<LayerRestore<float>> entries{
      {.layer = 1, .seq = 1, .length = 3, .k = kv1.k, .v = kv1.v}};
  const std::vector<SequenceTokens> tokens{{.seq = 1, .ids = ids}};
  cache.restore(entries, tokens);
  require_consistent(cache);
  // Only A: layer 0 holds none of B's positions, so B's copy in slot 1 is its own.
  REQUIRE(cache.block_table(1).size() == 2);
  REQUIRE(cache.ref_count(cache.block_table(1)[0]) == 1);
  REQUIRE(cache.stats().blocks_cached == 1);

  const auto kv0 = kModel.kv(0, ids, 0, 1);
  cache.append(0, 1, kv0.k_block(0, 1), kv0.v_block(0, 1));  // copies A on write
  require_consistent(cache);

  const std::vector<token_id> other{9, 9, 9, 9, 9};
  REQUIRE(cache.admit(2, other) == 0);
  kModel.prefill(cache, 2, other, 0, 4);  // needs the evictions that used to crash
  require_consistent(cache);
  REQUIRE(cache.stats().evictions == 2);
  for (std::size_t l = 0; l < kLayers; ++l) {
    std::vector<float> k, v;
    std::vector<position_t> pos;
    reference::gather_view(cache.view(l, 1), k, v, pos);
    const auto expect = kModel.kv(l, ids, 0, l == 0 ? 1 : 3);
    REQUIRE(k == expect.k);
    REQUIRE(v == expect.v);
  }
}

TEST_CASE("restore shares a partly filled block only as admit() does: the last, every layer in") {
  auto cache = make_cache(8, 2, 2, false);
  const auto ids = iota_ids(6, 1);
  REQUIRE(cache.admit(0, ids) == 0);
  kModel.prefill(cache, 0, ids, 0, 6);
  cache.release(0);  // three cached blocks
  // Every layer holds 5 of the 6 positions (admit() of the whole prompt leaves 5): all three
  // blocks are shared, the last one filled in part.
  std::vector<TokenKV> kv;
  for (std::size_t l = 0; l < kLayers; ++l) kv.push_back(kModel.kv(l, ids, 0, 5));
  std::vector<LayerRestore<float>> entries;
  for (std::size_t l = 0; l < kLayers; ++l) {
    entries.push_back({.layer = l, .seq = 1, .length = 5, .k = kv[l].k, .v = kv[l].v});
  }
  const std::vector<SequenceTokens> tokens{{.seq = 1, .ids = ids}};
  cache.restore(entries, tokens);
  require_consistent(cache);
  REQUIRE(cache.stats().blocks_used == 3);
  REQUIRE(cache.stats().blocks_cached == 0);
  // With layer 0 at 3 positions, the block after the one it ends in is filled fresh.
  entries[0].length = 3;
  const auto kv0 = kModel.kv(0, ids, 0, 3);
  entries[0].k = kv0.k;
  entries[0].v = kv0.v;
  cache.restore(entries, tokens);
  require_consistent(cache);
  const auto table = cache.block_table(1);
  REQUIRE(table.size() == 3);
  REQUIRE(cache.ref_count(table[2]) == 1);
  REQUIRE(cache.stats().blocks_cached == 1);  // the old last block, no longer shared
  cache.append(0, 1, kModel.kv(0, ids, 3, 2).k_block(0, 2), kModel.kv(0, ids, 3, 2).v_block(0, 2));
  require_consistent(cache);
}

TEST_CASE("restore refuses K/V running past the ids it is given, before changing anything") {
  auto cache = make_cache(8, 2, 2, false);
  const auto ids = iota_ids(3, 1);
  const auto kv = kModel.kv(1, iota_ids(4, 1), 0, 4);
  const std::vector<LayerRestore<float>> entries{
      {.layer = 1, .seq = 0, .length = 4, .k = kv.k, .v = kv.v}};
  const std::vector<SequenceTokens> tokens{{.seq = 0, .ids = ids}};
  const auto before = paged_state(cache);
  require_throws<position_error>([&] { cache.restore(entries, tokens); }, "sequence 0", "layer 1",
                                 "4 positions", "only 3 token ids");
  REQUIRE(paged_state(cache) == before);
  cache.restore(entries, {});  // without ids: an untracked sequence, never indexed
  REQUIRE(cache.layer_length(1, 0) == 4);
  REQUIRE(cache.stats().blocks_used == 2);
  require_consistent(cache);
}

TEST_CASE("a tracked sequence's K/V never runs past its ids: the off-by-one loop fails at once") {
  auto cache = make_cache(16, 4, 2, false);
  const auto prompt = iota_ids(20, 1);
  REQUIRE(cache.admit(0, prompt) == 0);
  kModel.prefill(cache, 0, prompt, 0, 20);
  // A buggy loop appends one K/V more than it registered ids: refused at that append.
  const auto before = paged_state(cache);
  const auto extra = kModel.kv(0, kvcache::test::concat(prompt, {0}), 20, 1);
  require_throws<position_error>(
      [&] { cache.append(0, 0, extra.k_block(0, 1), extra.v_block(0, 1)); },
      "append of 1 tokens to sequence 0 layer 0", "positions 20..20", "20 registered token ids");
  REQUIRE(paged_state(cache) == before);
  require_consistent(cache);

  // The right order: the id first, then its K/V in every layer.
  const auto ids = kvcache::test::concat(prompt, {77});
  cache.add_tokens(0, std::span<const token_id>(ids).subspan(20));
  kModel.prefill(cache, 0, ids, 20, 1);
  require_consistent(cache);
  REQUIRE(cache.seq_length(0) == 21);

  // An untracked sequence (K/V without ids) cannot claim ids afterwards.
  const auto kv = kModel.kv(0, prompt, 0, 3);
  cache.append(0, 1, kv.k_block(0, 3), kv.v_block(0, 3));
  const auto before1 = paged_state(cache);
  require_throws<position_error>([&] { cache.add_tokens(1, iota_ids(3, 1)); },
                                 "add_tokens to sequence 1", "K/V of 3 positions",
                                 "without token ids");
  require_throws<position_error>(
      [&] {
        cache.append(1, 1, std::span<const token_id>(prompt).first(3), kv.k_block(0, 3),
                     kv.v_block(0, 3));
      },
      "append with ids to sequence 1", "K/V of 3 positions");
  REQUIRE(paged_state(cache) == before1);
  cache.crop(1, 0);
  cache.add_tokens(1, iota_ids(3, 1));  // once empty, it may
  require_consistent(cache);
}

TEST_CASE("append with ids registers them with the first layer and checks them in the others") {
  auto cache = make_cache(16, 4, 3, false);
  const auto ids = iota_ids(10, 1);
  // Prefill without add_tokens: each layer's append carries the ids.
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto kv = kModel.kv(l, ids, 0, 10);
    cache.append(l, 0, ids, kv.k_block(0, 10), kv.v_block(0, 10));
    REQUIRE(std::ranges::equal(cache.tokens(0), ids));
  }
  require_consistent(cache);
  cache.release(0);
  REQUIRE(cache.match_prefix(ids) == 8);  // the two full blocks were indexed

  // A later prompt reuses them; the rest runs through append with ids after admit().
  const auto prompt =
      kvcache::test::concat(std::vector<token_id>(ids.begin(), ids.begin() + 9), {42, 43});
  REQUIRE(cache.admit(1, prompt) == 8);
  const std::span<const token_id> rest = std::span<const token_id>(prompt).subspan(8);
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto kv = kModel.kv(l, prompt, 8, 3);
    cache.append(l, 1, rest, kv.k_block(0, 3), kv.v_block(0, 3));
  }
  require_consistent(cache);
  // Decode: one step's id goes in with layer 0's K/V and is confirmed by layer 1's.
  const auto step = kvcache::test::concat(prompt, {7});
  const std::span<const token_id> one = std::span<const token_id>(step).subspan(11);
  auto kv0 = kModel.kv(0, step, 11, 1);
  cache.append(0, 1, one, kv0.k_block(0, 1), kv0.v_block(0, 1));
  REQUIRE(cache.tokens(1).size() == 12);
  // Layer 1 claiming another token at position 11 is refused, naming both ids.
  const std::vector<token_id> wrong{8};
  const auto kv1 = kModel.kv(1, step, 11, 1);
  const auto before = paged_state(cache);
  require_throws<position_error>(
      [&] { cache.append(1, 1, wrong, kv1.k_block(0, 1), kv1.v_block(0, 1)); },
      "sequence 1 layer 1", "token id 8", "position 11", "id 7 is registered");
  require_throws<shape_error>(
      [&] {
        cache.append(1, 1, std::span<const token_id>(step).first(2), kv1.k_block(0, 1),
                     kv1.v_block(0, 1));
      },
      "append of 2 token ids with the K/V of 1 tokens");
  REQUIRE(paged_state(cache) == before);
  cache.append(1, 1, one, kv1.k_block(0, 1), kv1.v_block(0, 1));
  require_consistent(cache);
  for (std::size_t l = 0; l < kLayers; ++l) {
    std::vector<float> k, v;
    std::vector<position_t> pos;
    reference::gather_view(cache.view(l, 1), k, v, pos);
    REQUIRE(k == kModel.kv(l, step, 0, 12).k);
    REQUIRE(v == kModel.kv(l, step, 0, 12).v);
  }
}
