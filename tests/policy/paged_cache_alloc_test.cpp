// SPDX-License-Identifier: Apache-2.0
// PagedCache allocates at construction only: admit, append (new blocks, copy-on-write, commits,
// evictions), add_tokens, fork, crop, release, match_prefix, stats and attention over its views
// never allocate, and the pool keeps its size.
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/counting_new.hpp"
#include "support/prefix_helpers.hpp"

using namespace kvcache;

TEST_CASE("PagedCache never allocates after construction, whatever the requests do") {
  auto rng = kvcache::test::make_rng("paged-alloc");
  constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 16, kBs = 4, kTokens = 24;
  PagedCache<half> cache({.num_layers = kLayers,
                          .num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .num_blocks = 20,  // too few for every prompt: eviction runs
                          .block_size = kBs,
                          .max_batch = 3,
                          .max_seq_len = 40,
                          .evict_when_full = true});
  const kvcache::test::SyntheticModel model{kLayers, kHeads, kDim};
  // every input prepared up front: prompts, their K/V, queries, outputs
  std::vector<std::vector<token_id>> prompts;
  std::vector<std::vector<kvcache::test::TokenKV>> kv;  // [prompt][layer], kTokens + 8 tokens
  for (int i = 0; i < 6; ++i) {
    auto ids = kvcache::test::prompt_with_prefix(
        rng, i % 2 == 0 ? std::vector<token_id>{} : prompts[static_cast<std::size_t>(i - 1)],
        kTokens + 8);
    ids.resize(kTokens + 8);
    std::vector<kvcache::test::TokenKV> layers;
    for (std::size_t l = 0; l < kLayers; ++l) layers.push_back(model.kv(l, ids, 0, ids.size()));
    prompts.push_back(std::move(ids));
    kv.push_back(std::move(layers));
  }
  std::vector<float> q(2 * kHeads * kDim, 0.25f), out(q.size());
  const std::size_t pool_bytes = cache.memory_bytes();
  std::size_t allocations = 0;
  for (int round = 0; round < 40; ++round) {
    const std::size_t before = kvcache::test::g_allocations.load();
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const auto prompt = std::span<const token_id>(prompts[i]).first(kTokens);
      const std::size_t cached = cache.admit(0, prompt);
      for (std::size_t l = 0; l < kLayers; ++l) {
        cache.append(l, 0, kv[i][l].k_block(cached, kTokens - cached),
                     kv[i][l].v_block(cached, kTokens - cached));
      }
      cache.fork(0, 1);
      for (std::size_t s : {0u, 1u}) {  // one decode step each: copy-on-write, then in place
        cache.add_tokens(s, std::span<const token_id>(prompts[i]).subspan(kTokens, 1));
        for (std::size_t l = 0; l < kLayers; ++l) {
          cache.append(l, s, kv[i][l].k_block(kTokens, 1), kv[i][l].v_block(kTokens, 1));
          attend({q, 1, 2 * kHeads, kDim}, cache.view(l, s), {out, 1, 2 * kHeads, kDim});
        }
      }
      (void)cache.match_prefix(prompts[(i + 1) % prompts.size()]);
      (void)cache.stats();
      cache.crop(1, kTokens / 2);
      cache.release(1);
      cache.reset(0);
      if (round % 8 == 7) (void)cache.evict_cached(3);
    }
    allocations += kvcache::test::g_allocations.load() - before;
  }
  REQUIRE(allocations == 0);
  const auto st = cache.stats();
  REQUIRE(st.evictions > 0);
  REQUIRE(st.cow_copies > 0);
  REQUIRE(st.reused_tokens > 0);
  REQUIRE(cache.memory_bytes() == pool_bytes);
}
