// SPDX-License-Identifier: Apache-2.0
// PagedCache: prompts share the cached blocks of their common prefix and prefill only the rest;
// memory is counted in blocks; fork, crop, eviction and re-fill keep attention equal to the
// reference recomputed from scratch; every error is typed, names the numbers, changes nothing.
#include <algorithm>
#include <numeric>

#include "kvcache/kvcache.hpp"
// A hasher of this file's own (CollidingHasher): its BlockManager's members compile here, as the
// tests are built with KVCACHE_EXTERN_KERNELS (manager/block_manager_impl.hpp).
#include "kvcache/manager/block_manager_impl.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::concat;
using kvcache::test::iota_ids;
using kvcache::test::require_throws;
using kvcache::test::SyntheticModel;
using kvcache::test::table_of;

namespace {

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 8;
const SyntheticModel kModel{kLayers, kHeads, kDim};

template <Element T = float, class Hasher = DefaultBlockHasher>
PagedCache<T, Hasher> make_cache(std::size_t num_blocks, std::size_t block_size,
                                 std::size_t max_batch, bool evict = false,
                                 std::size_t max_seq_len = 0) {
  return PagedCache<T, Hasher>({.num_layers = kLayers,
                                .num_kv_heads = kHeads,
                                .head_dim = kDim,
                                .num_blocks = num_blocks,
                                .block_size = block_size,
                                .max_batch = max_batch,
                                .max_seq_len = max_seq_len,
                                .evict_when_full = evict});
}

}  // namespace

TEMPLATE_TEST_CASE(
    "a prompt sharing a prefix with an earlier one reuses its full blocks and "
    "prefills only the rest; attention equals the reference",
    "", float, half, bfloat16) {
  auto rng = kvcache::test::make_rng("paged-share");
  auto cache = make_cache<TestType>(32, 4, 4);
  const auto a = kvcache::test::prompt_with_prefix(rng, {}, 18);
  auto b = std::vector<token_id>(a.begin(), a.begin() + 10);
  b.push_back(a[10] % 50 + 1);  // diverges at position 10: blocks 0 and 1 are common
  b = kvcache::test::prompt_with_prefix(rng, b, 18);

  REQUIRE(kModel.run_prompt(cache, 0, a) == 0);
  REQUIRE(cache.match_prefix(a) == 16);  // the four full blocks
  REQUIRE(cache.match_prefix(b) == 8);
  REQUIRE(kModel.run_prompt(cache, 1, b) == 8);
  const auto t0 = table_of(cache, 0), t1 = table_of(cache, 1);
  REQUIRE(t0.size() == 5);
  REQUIRE(t1.size() == 5);
  REQUIRE(std::equal(t0.begin(), t0.begin() + 2, t1.begin()));
  REQUIRE(cache.ref_count(t0[0]) == 2);
  REQUIRE(cache.ref_count(t0[2]) == 1);
  REQUIRE(cache.stats().blocks_used == 8);
  kModel.require_attention_matches(cache, 0, a, rng);
  kModel.require_attention_matches(cache, 1, b, rng);
  auto st = cache.stats();
  REQUIRE(st.prompts == 2);
  REQUIRE(st.prompt_tokens == 36);
  REQUIRE(st.reused_tokens == 8);
  REQUIRE(st.hit_rate() == Approx(8.0 / 36.0));

  // releasing a keeps its two unshared full blocks cached; its partial block is freed
  cache.release(0);
  st = cache.stats();
  REQUIRE(st.blocks_used == 5);
  REQUIRE(st.blocks_cached == 2);
  REQUIRE(st.blocks_free == 25);
  REQUIRE(cache.match_prefix(a) == 16);
  // a later request with prompt a hits all four blocks, the cached ones included
  REQUIRE(cache.admit(2, a) == 16);
  REQUIRE(table_of(cache, 2) == std::vector<block_id>(t0.begin(), t0.begin() + 4));
  REQUIRE(cache.stats().blocks_used == 7);
  REQUIRE(cache.stats().blocks_cached == 0);
  kModel.prefill(cache, 2, a, 16, 2);  // positions 16, 17: one new block
  REQUIRE(cache.stats().blocks_used == 8);
  kModel.require_attention_matches(cache, 2, a, rng);
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE(
    "a fully cached prompt leaves its last token to run, and the copy it writes is folded "
    "back into the cached block") {
  auto rng = kvcache::test::make_rng("paged-full-hit");
  auto cache = make_cache(8, 4, 2);
  const auto p = iota_ids(16, 100);
  REQUIRE(kModel.run_prompt(cache, 0, p) == 0);
  const auto original = table_of(cache, 0);
  cache.release(0);
  REQUIRE(cache.stats().blocks_cached == 4);

  REQUIRE(cache.admit(1, p) == 15);
  REQUIRE(cache.seq_length(1) == 15);
  REQUIRE(cache.layer_length(1, 1) == 15);
  REQUIRE(cache.tokens(1).size() == 16);
  REQUIRE(table_of(cache, 1) == original);
  kModel.prefill(cache, 1, p, 15, 1);  // the last prompt token, for its logits
  const auto st = cache.stats();
  REQUIRE(st.cow_copies == 1);              // position 15 was written into a private copy ...
  REQUIRE(table_of(cache, 1) == original);  // ... which the commit swapped for the equal block
  REQUIRE(st.blocks_used == 4);
  REQUIRE(st.blocks_free == 4);
  kModel.require_attention_matches(cache, 1, p, rng);
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE("two sequences prefilling the same prompt at once end up sharing one copy") {
  auto rng = kvcache::test::make_rng("paged-dedup");
  auto cache = make_cache(16, 4, 2);
  const auto p = iota_ids(13, 1);
  REQUIRE(cache.admit(0, p) == 0);
  REQUIRE(cache.admit(1, p) == 0);  // nothing cached yet: both compute the prompt
  kModel.prefill(cache, 0, p, 0, 13, 4);
  kModel.prefill(cache, 1, p, 0, 13, 4);
  // sequence 1 switched to sequence 0's committed blocks and freed its own; only the partial
  // last blocks differ
  const auto t0 = table_of(cache, 0), t1 = table_of(cache, 1);
  REQUIRE(std::equal(t0.begin(), t0.begin() + 3, t1.begin()));
  REQUIRE(t0[3] != t1[3]);
  REQUIRE(cache.stats().blocks_used == 5);
  kModel.require_attention_matches(cache, 0, p, rng);
  kModel.require_attention_matches(cache, 1, p, rng);
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE(
    "N requests sharing a P-token prefix hold ceil(P/bs) + sum ceil(suffix/bs) blocks, the "
    "block straddling the prefix end aside") {
  auto rng = kvcache::test::make_rng("paged-memory");
  constexpr std::size_t kBs = 8, kN = 8;
  for (std::size_t p : {40u, 43u}) {
    auto cache = make_cache(256, kBs, kN);
    const auto prefix = iota_ids(p, 1);
    std::size_t expect_blocks = 0, unshared_blocks = 0;
    const std::size_t rem = p % kBs;
    if (rem == 0) expect_blocks = p / kBs;
    for (std::size_t i = 0; i < kN; ++i) {
      const std::size_t suffix = kvcache::test::uniform(rng, 1, 20);
      const auto prompt = concat(prefix, iota_ids(suffix, static_cast<token_id>(1000 * (i + 1))));
      const std::size_t cached = kModel.run_prompt(cache, i, prompt);
      REQUIRE(cached == (i == 0 ? 0 : p / kBs * kBs));
      if (rem == 0) {
        expect_blocks += (suffix + kBs - 1) / kBs;
      } else {
        // the prefix's full blocks once; each request owns the block holding the prefix's last
        // rem tokens and its first suffix tokens (its ids differ per request)
        expect_blocks += (i == 0 ? p / kBs : 0) + (rem + suffix + kBs - 1) / kBs;
      }
      unshared_blocks += (p + suffix + kBs - 1) / kBs;
      INFO("P " << p << " request " << i << " suffix " << suffix);
      REQUIRE(cache.stats().blocks_used == expect_blocks);
    }
    REQUIRE(cache.stats().blocks_used < unshared_blocks / 2);
    REQUIRE(cache.check_consistency().empty());
  }
}

TEST_CASE(
    "fork shares every block; divergent appends copy on write and the other holder sees "
    "no change") {
  auto rng = kvcache::test::make_rng("paged-fork");
  auto cache = make_cache(16, 4, 3);
  auto ids0 = iota_ids(10, 1);
  REQUIRE(kModel.run_prompt(cache, 0, ids0) == 0);
  cache.fork(0, 1);
  auto ids1 = ids0;
  const auto t = table_of(cache, 0);
  REQUIRE(table_of(cache, 1) == t);
  for (block_id b : t) REQUIRE(cache.ref_count(b) == 2);
  REQUIRE(cache.stats().blocks_used == 3);
  REQUIRE(std::ranges::equal(cache.tokens(1), ids1));

  const auto before0 = kvcache::test::cache_contents(cache);
  kModel.decode(cache, 1, ids1, 77);  // writes into the shared partial block 2: copied first
  REQUIRE(cache.stats().cow_copies == 1);
  REQUIRE(cache.stats().blocks_used == 4);
  const auto t1 = table_of(cache, 1);
  REQUIRE(std::equal(t.begin(), t.begin() + 2, t1.begin()));
  REQUIRE(t1[2] != t[2]);
  for (std::size_t l = 0; l < kLayers; ++l) {
    REQUIRE(kvcache::test::view_contents(cache.view(l, 0)) == before0[l * 3 + 0]);
  }
  kModel.decode(cache, 0, ids0, 88);  // block 2 is now sequence 0's alone: written in place
  REQUIRE(cache.stats().cow_copies == 1);
  REQUIRE(table_of(cache, 0) == t);
  kModel.require_attention_matches(cache, 0, ids0, rng);
  kModel.require_attention_matches(cache, 1, ids1, rng);

  for (token_id x = 0; x < 5; ++x) {
    kModel.decode(cache, 0, ids0, 200 + x);
    kModel.decode(cache, 1, ids1, 300 + x);
  }
  REQUIRE(cache.match_prefix(ids0) == 16);
  REQUIRE(cache.match_prefix(ids1) == 16);
  kModel.require_attention_matches(cache, 0, ids0, rng);
  kModel.require_attention_matches(cache, 1, ids1, rng);
  cache.release(0);
  cache.release(1);
  const auto st = cache.stats();
  REQUIRE(st.blocks_used == 0);
  REQUIRE(st.blocks_cached == 6);  // two shared blocks, two of each branch
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE(
    "crop into an indexed block and append other tokens: a copy is written, the cached "
    "prefix survives, attention equals a fresh fill") {
  auto rng = kvcache::test::make_rng("paged-crop");
  auto cache = make_cache(16, 4, 2);
  const auto p = iota_ids(16, 1);
  REQUIRE(kModel.run_prompt(cache, 0, p) == 0);
  cache.crop(0, 10);
  REQUIRE(cache.seq_length(0) == 10);
  REQUIRE(cache.tokens(0).size() == 10);
  REQUIRE(cache.block_table(0).size() == 3);
  REQUIRE(cache.stats().blocks_cached == 1);  // block 3 left the table but stays cached
  auto ids = std::vector<token_id>(p.begin(), p.begin() + 10);
  for (token_id x = 0; x < 6; ++x) kModel.decode(cache, 0, ids, 500 + x);
  REQUIRE(cache.stats().cow_copies == 1);
  REQUIRE(cache.match_prefix(p) == 16);    // the original blocks 2 and 3 are still indexed
  REQUIRE(cache.match_prefix(ids) == 16);  // and so are the new ones
  kModel.require_attention_matches(cache, 0, ids, rng);
  REQUIRE(cache.admit(1, p) == 15);
  kModel.prefill(cache, 1, p, 15, 1);
  kModel.require_attention_matches(cache, 1, p, rng);
  REQUIRE(cache.check_consistency().empty());

  cache.crop(1, 0);
  REQUIRE(cache.seq_length(1) == 0);
  REQUIRE(cache.block_table(1).empty());
  REQUIRE(cache.tokens(1).empty());
}

TEST_CASE(
    "with evict_when_full, cached blocks are evicted least recently released first, and "
    "re-filled prompts attend correctly") {
  auto rng = kvcache::test::make_rng("paged-evict");
  auto cache = make_cache(6, 4, 2, /*evict=*/true);
  const auto a = iota_ids(8, 1), b = iota_ids(8, 11), c = iota_ids(16, 21);
  REQUIRE(kModel.run_prompt(cache, 0, a) == 0);
  cache.release(0);
  REQUIRE(kModel.run_prompt(cache, 0, b) == 0);
  cache.release(0);
  REQUIRE(cache.stats().blocks_cached == 4);
  REQUIRE(cache.stats().blocks_free == 2);
  REQUIRE(kModel.run_prompt(cache, 0, c, 16) == 0);  // 4 blocks: 2 free + 2 evicted (a's)
  REQUIRE(cache.stats().evictions == 2);
  REQUIRE(cache.match_prefix(a) == 0);
  REQUIRE(cache.match_prefix(b) == 8);
  kModel.require_attention_matches(cache, 0, c, rng);
  cache.release(0);
  REQUIRE(cache.stats().blocks_cached == 6);
  REQUIRE(kModel.run_prompt(cache, 1, a) == 0);  // re-fill a: evicts b, the older of b and c
  REQUIRE(cache.stats().evictions == 4);
  REQUIRE(cache.match_prefix(b) == 0);
  REQUIRE(cache.match_prefix(c) == 16);
  kModel.require_attention_matches(cache, 1, a, rng);
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE(
    "pool exhaustion throws pool_exhausted_error with blocks needed, free and evictable, "
    "and changes nothing") {
  auto rng = kvcache::test::make_rng("paged-exhaust");
  SECTION("new blocks, eviction not opted into") {
    auto cache = make_cache(6, 4, 2);
    const auto a = iota_ids(8, 1), b = iota_ids(8, 11), c = iota_ids(16, 21);
    kModel.run_prompt(cache, 0, a);
    cache.release(0);
    kModel.run_prompt(cache, 0, b);
    cache.release(0);
    REQUIRE(cache.admit(0, c) == 0);
    const auto before = kvcache::test::paged_state(cache);
    const auto kv = kModel.kv(0, c, 0, 16);
    const auto what = require_throws<pool_exhausted_error>(
        [&] { cache.append(0, 0, kv.k_block(0, 16), kv.v_block(0, 16)); },
        "append of 16 tokens to sequence 0 layer 0", "needs 4 blocks", "2 free", "4 evictable",
        "evict_when_full");
    try {
      cache.append(0, 0, kv.k_block(0, 16), kv.v_block(0, 16));
    } catch (const pool_exhausted_error& e) {
      REQUIRE(e.needed() == 4);
      REQUIRE(e.free() == 2);
      REQUIRE(e.evictable() == 4);
      REQUIRE(dynamic_cast<const capacity_error*>(&e) != nullptr);
    }
    REQUIRE(kvcache::test::paged_state(cache) == before);
    REQUIRE(cache.evict_cached(2) == 2);
    kModel.prefill(cache, 0, c, 0, 16);
    kModel.require_attention_matches(cache, 0, c, rng);
  }
  SECTION("copy-on-write needs a block too") {
    auto cache = make_cache(3, 4, 2);
    auto ids = iota_ids(10, 1);
    kModel.run_prompt(cache, 0, ids);
    cache.fork(0, 1);  // forking needs no block
    REQUIRE(cache.stats().blocks_free == 0);
    const auto ids1 = concat(ids, {9});
    cache.add_tokens(1, std::span<const token_id>(ids1).subspan(10));  // the id, then its K/V
    const auto before = kvcache::test::paged_state(cache);
    const auto kv = kModel.kv(0, ids1, 10, 1);
    require_throws<pool_exhausted_error>(
        [&] { cache.append(0, 1, kv.k_block(0, 1), kv.v_block(0, 1)); }, "sequence 1",
        "needs 1 blocks", "0 free", "0 evictable");
    REQUIRE(kvcache::test::paged_state(cache) == before);
    cache.release(0);  // now sequence 1 holds block 2 alone and writes it in place
    kModel.prefill(cache, 1, ids1, 10, 1);
    REQUIRE(cache.stats().cow_copies == 0);
    kModel.require_attention_matches(cache, 1, ids1, rng);
  }
  SECTION("with eviction opted in, only what is neither free nor cached is missing") {
    auto cache = make_cache(4, 4, 2, /*evict=*/true, /*max_seq_len=*/32);
    kModel.run_prompt(cache, 0, iota_ids(8, 1));
    cache.release(0);
    REQUIRE(cache.admit(1, iota_ids(20, 50)) == 0);
    const auto before = kvcache::test::paged_state(cache);
    const auto kv = kModel.kv(0, iota_ids(20, 50), 0, 20);
    require_throws<pool_exhausted_error>(
        [&] { cache.append(0, 1, kv.k_block(0, 20), kv.v_block(0, 20)); }, "needs 5 blocks",
        "2 free", "2 evictable");
    REQUIRE(kvcache::test::paged_state(cache) == before);
  }
}

namespace {
struct CollidingHasher {
  std::uint64_t operator()(std::uint64_t, std::span<const token_id>) const noexcept { return 42; }
};
}  // namespace

TEST_CASE(
    "with a hasher that collides everything, sharing stays exact: same answers as the "
    "default hasher, attention equals the reference") {
  auto rng = kvcache::test::make_rng("paged-collide");
  constexpr std::size_t kBatch = 4;
  auto exact = make_cache<float, CollidingHasher>(64, 2, kBatch, true);
  auto normal = make_cache<float>(64, 2, kBatch, true);
  std::vector<std::vector<token_id>> ids(kBatch);
  for (int step = 0; step < 300; ++step) {
    const std::size_t seq = kvcache::test::uniform(rng, 0, kBatch - 1);
    if (!ids[seq].empty()) {
      exact.release(seq);
      normal.release(seq);
      ids[seq].clear();
      continue;
    }
    // a two-letter alphabet and blocks of 2: equal blocks under different parents everywhere
    std::vector<token_id> prompt(kvcache::test::uniform(rng, 1, 12));
    for (auto& t : prompt) t = static_cast<token_id>(kvcache::test::uniform(rng, 1, 2));
    REQUIRE(exact.match_prefix(prompt) == normal.match_prefix(prompt));
    const std::size_t got = kModel.run_prompt(exact, seq, prompt, 3);
    REQUIRE(kModel.run_prompt(normal, seq, prompt, 3) == got);
    ids[seq] = prompt;
    kModel.require_attention_matches(exact, seq, prompt, rng, 2, 1);
    REQUIRE(exact.stats() == normal.stats());
  }
  REQUIRE(exact.check_consistency().empty());
}

TEST_CASE("a block is indexed once every layer holds it and its ids are registered") {
  auto cache = make_cache(16, 4, 3);
  const auto p = iota_ids(8, 1);
  REQUIRE(cache.admit(0, p) == 0);
  const auto kv0 = kModel.kv(0, p, 0, 8), kv1 = kModel.kv(1, p, 0, 8);
  cache.append(0, 0, kv0.k_block(0, 8), kv0.v_block(0, 8));
  REQUIRE(cache.match_prefix(p) == 0);  // layer 1 holds nothing yet
  cache.append(1, 0, kv1.k_block(0, 5), kv1.v_block(0, 5));
  REQUIRE(cache.match_prefix(p) == 4);
  cache.append(1, 0, kv1.k_block(5, 3), kv1.v_block(5, 3));
  REQUIRE(cache.match_prefix(p) == 8);

  // K/V appended without ids is never shared, nor can ids be claimed for it afterwards
  const auto q = iota_ids(8, 30);
  kModel.prefill(cache, 1, q, 0, 8);
  REQUIRE(cache.match_prefix(q) == 0);
  require_throws<position_error>([&] { cache.add_tokens(1, q); }, "add_tokens to sequence 1",
                                 "without token ids");
  cache.release(1);
  // ids first: a block is indexed when the last layer's K/V completes it
  cache.add_tokens(1, std::span<const token_id>(q).first(6));
  kModel.prefill(cache, 1, q, 0, 6);
  REQUIRE(cache.match_prefix(q) == 4);
  cache.add_tokens(1, std::span<const token_id>(q).subspan(6));
  REQUIRE(cache.match_prefix(q) == 4);
  kModel.prefill(cache, 1, q, 6, 2);
  REQUIRE(cache.match_prefix(q) == 8);

  // ids registered ahead of K/V index nothing
  const auto r = iota_ids(8, 60);
  REQUIRE(cache.admit(2, r) == 0);
  REQUIRE(cache.match_prefix(r) == 0);
  REQUIRE(cache.check_consistency().empty());

  // without prefix caching nothing is ever indexed
  PagedCache<float> off({.num_layers = kLayers,
                         .num_kv_heads = kHeads,
                         .head_dim = kDim,
                         .num_blocks = 8,
                         .block_size = 4,
                         .enable_prefix_caching = false});
  REQUIRE(kModel.run_prompt(off, 0, p) == 0);
  REQUIRE(off.match_prefix(p) == 0);
  off.release(0);
  REQUIRE(off.stats().blocks_free == 8);
  REQUIRE(kModel.run_prompt(off, 0, p) == 0);
  REQUIRE(off.stats().reused_tokens == 0);
}

TEST_CASE("reorder moves block tables between beams without copying K/V") {
  auto rng = kvcache::test::make_rng("paged-reorder");
  auto cache = make_cache(32, 4, 4);
  std::vector<std::vector<token_id>> beam(3, iota_ids(9, 1));
  kModel.run_prompt(cache, 0, beam[0]);
  cache.fork(0, 1);
  cache.fork(0, 2);
  for (std::size_t i = 0; i < 3; ++i)
    kModel.decode(cache, i, beam[i], static_cast<token_id>(40 + i));
  const auto used = cache.stats().blocks_used;
  const auto cows = cache.stats().cow_copies;
  std::vector<std::vector<block_id>> tables;
  for (std::size_t i = 0; i < 3; ++i) tables.push_back(table_of(cache, i));

  const std::vector<std::size_t> dst{0, 1, 2}, src{1, 1, 0};  // beam 2 dies, beam 1 doubles
  cache.reorder(dst, src);
  REQUIRE(table_of(cache, 0) == tables[1]);
  REQUIRE(table_of(cache, 1) == tables[1]);
  REQUIRE(table_of(cache, 2) == tables[0]);
  REQUIRE(cache.stats().cow_copies == cows);
  REQUIRE(cache.stats().blocks_used == used - 1);  // beam 2's own last block is gone
  REQUIRE(cache.ref_count(tables[1][2]) == 2);
  const std::vector<std::vector<token_id>> now{beam[1], beam[1], beam[0]};
  for (std::size_t i = 0; i < 3; ++i) {
    REQUIRE(std::ranges::equal(cache.tokens(i), now[i]));
    kModel.require_attention_matches(cache, i, now[i], rng);
  }
  REQUIRE(cache.check_consistency().empty());
}

TEST_CASE(
    "attention over paged views with windows, sinks, soft-cap, prefill queries and "
    "non-causal masks equals the reference") {
  auto rng = kvcache::test::make_rng("paged-masks");
  for (std::size_t bs : {4u, 7u, 16u, 33u}) {  // tiles of 32 keys made of 8, 5, 2, 1-2 runs
    auto cache = make_cache<half>(80, bs, 1);
    const auto ids = kvcache::test::prompt_with_prefix(rng, {}, 150);
    kModel.run_prompt(cache, 0, ids, 9);
    const auto view = cache.view(1, 0);
    REQUIRE(view.num_segments() == (150 + bs - 1) / bs);
    kvcache::test::check_view_invariants(view);
    const std::vector<AttentionOptions> options{
        {},
        {.window = 13, .num_sink_tokens = 2},
        {.window = 40, .num_sink_tokens = 5},
        {.window = 5},
        {.softcap = 3.0f},
        {.causal = false},
        {.query_pos = 20},
    };
    constexpr std::size_t kNq = 7, kQHeads = 2 * kHeads;
    const auto q = kvcache::test::normal_floats(rng, kNq * kQHeads * kDim);
    for (const auto& opts : options) {
      std::vector<float> expect(q.size());
      reference::attend({q, kNq, kQHeads, kDim}, view, {expect, kNq, kQHeads, kDim}, opts);
      for (auto kernel : {cpu::Kernel::automatic, cpu::Kernel::portable}) {
        std::vector<float> got(q.size());
        cpu::attend({q, kNq, kQHeads, kDim}, view, {got, kNq, kQHeads, kDim}, opts, kernel);
        INFO("block_size " << bs << " window " << opts.window << " sinks " << opts.num_sink_tokens
                           << " causal " << opts.causal);
        kvcache::test::require_close(got, expect, {2e-5, 2e-5});
      }
    }
  }
}

TEST_CASE("a paged view is one segment per block, read in place from the pool") {
  auto cache = make_cache<bfloat16>(8, 4, 2);
  const auto ids = iota_ids(11, 1);
  kModel.run_prompt(cache, 1, ids);
  REQUIRE(cache.memory_bytes() == kv_cache_bytes(kLayers, kHeads, kDim, 8 * 4, 2));
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto view = cache.view(l, 1);
    REQUIRE(view.num_segments() == 3);
    REQUIRE(view.length() == 11);
    REQUIRE(std::ranges::equal(view.block_table(), cache.block_table(1)));
    const auto pos = kvcache::test::check_view_invariants(view);
    REQUIRE(pos.size() == 11);
    for (std::size_t i = 0; i < 3; ++i) {
      const auto seg = view.segment(i);
      REQUIRE(seg.first_pos == static_cast<position_t>(4 * i));
      REQUIRE(seg.len == (i < 2 ? 4u : 3u));
      REQUIRE(seg.head_stride == 4 * kDim);
      REQUIRE(seg.v == seg.k + kHeads * 4 * kDim);
      if (i > 0) {  // different blocks of one layer are whole blocks apart
        const auto gap = std::abs(seg.k - view.segment(i - 1).k);
        REQUIRE(gap % static_cast<std::ptrdiff_t>(2 * kHeads * 4 * kDim) == 0);
        REQUIRE(gap != 0);
      }
    }
    // the K/V read back are exactly what was appended
    std::vector<float> k, v;
    std::vector<position_t> p;
    reference::gather_view(view, k, v, p);
    const auto kv = kModel.kv(l, ids, 0, 11);
    REQUIRE(k == kvcache::test::rounded<bfloat16>(kv.k));
    REQUIRE(v == kvcache::test::rounded<bfloat16>(kv.v));
  }
  REQUIRE(cache.view(0, 0).num_segments() == 0);
}

TEST_CASE("every PagedCache error is typed, names the numbers and changes nothing") {
  auto rng = kvcache::test::make_rng("paged-errors");
  auto cache = make_cache(8, 4, 3, false, 12);
  const auto ids = iota_ids(10, 1);
  kModel.run_prompt(cache, 1, ids);
  cache.fork(1, 2);
  const auto before = kvcache::test::paged_state(cache);
  const auto kv = kModel.kv(0, iota_ids(12, 1), 0, 5);
  const auto wrong = kvcache::test::random_kv(rng, 2, 3, kDim);
  require_throws<capacity_error>([&] { cache.append(0, 1, kv.k_block(0, 5), kv.v_block(0, 5)); },
                                 "append of 5 tokens to sequence 1 layer 0",
                                 "exceeds max_seq_len 12", "holds 10");
  require_throws<layer_error>([&] { cache.append(2, 1, kv.k_block(0, 1), kv.v_block(0, 1)); },
                              "layer 2", "num_layers 2");
  require_throws<batch_error>([&] { cache.append(0, 3, kv.k_block(0, 1), kv.v_block(0, 1)); },
                              "sequence 3", "max_batch 3");
  require_throws<shape_error>([&] { cache.append(0, 1, wrong.k_block(0, 2), wrong.v_block(0, 2)); },
                              "3 heads", "2 heads");
  require_throws<shape_error>([&] { cache.append(0, 1, kv.k_block(0, 0), kv.v_block(0, 0)); },
                              "zero-length");
  require_throws<position_error>([&] { (void)cache.admit(1, ids); },
                                 "admit to sequence 1, which holds 10 tokens and 10 ids");
  require_throws<capacity_error>([&] { (void)cache.admit(0, iota_ids(13, 1)); }, "13-token prompt",
                                 "max_seq_len 12");
  require_throws<batch_error>([&] { (void)cache.admit(3, ids); }, "sequence 3");
  require_throws<capacity_error>([&] { cache.add_tokens(1, iota_ids(3, 1)); },
                                 "add_tokens of 3 ids to sequence 1", "max_seq_len 12",
                                 "holds 10 ids");
  require_throws<batch_error>([&] { cache.fork(1, 1); }, "fork of sequence 1 into itself");
  require_throws<position_error>([&] { cache.fork(1, 2); }, "fork into sequence 2");
  require_throws<batch_error>([&] { cache.fork(1, 7); }, "sequence 7");
  const std::vector<std::size_t> two{0, 1}, one{1}, twice{2, 2};
  require_throws<shape_error>([&] { cache.reorder(two, one); }, "reorder of 2 sequences",
                              "1 sources");
  require_throws<batch_error>([&] { cache.reorder(twice, two); }, "sequence 2 twice");
  require_throws<batch_error>([&] { cache.reorder(one, std::vector<std::size_t>{5}); },
                              "sequence 5");
  require_throws<position_error>([&] { cache.crop(1, 11); }, "to 11 tokens", "holds only 10");
  require_throws<batch_error>([&] { cache.release(3); }, "sequence 3");
  require_throws<shape_error>([&] { (void)cache.ref_count(8); }, "block 8", "num_blocks 8");
  require_throws<layer_error>([&] { (void)cache.view(5, 0); }, "layer 5");
  REQUIRE(kvcache::test::paged_state(cache) == before);

  const auto config = [](std::size_t blocks, std::size_t bs) {
    return PagedCacheConfig{
        .num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .num_blocks = blocks, .block_size = bs};
  };
  require_throws<shape_error>([&] { PagedCache<float> c(config(0, 4)); }, "num_blocks");
  require_throws<shape_error>([&] { PagedCache<float> c(config(4, 0)); }, "block_size");
  require_throws<shape_error>(
      [&] { PagedCache<float> c({.num_layers = 0, .num_kv_heads = 1, .head_dim = 4}); },
      "num_layers");
}
