// SPDX-License-Identifier: Apache-2.0
// TokenTrackedCache: reusing a cache for a different prompt must never let the new prompt attend
// to K/V of tokens it does not contain (the seed's cross-contamination warning).
#include <map>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

constexpr std::size_t kHeads = 2, kDim = 16, kLayers = 2;

// A toy "model": each token id has fixed K/V rows (per layer), so that the right attention
// output for any prompt can be recomputed from scratch.
struct ToyModel {
  std::map<token_id, std::vector<float>> rows;
  std::mt19937_64 rng{7};
  const std::vector<float>& row(token_id t, std::size_t layer) {
    auto& r = rows[t * 16 + static_cast<token_id>(layer)];
    if (r.empty()) r = kvcache::test::normal_floats(rng, 2 * kHeads * kDim);  // K then V
    return r;
  }
  // Appends ids to every layer of seq and commits them.
  template <class Cache>
  void prefill(Cache& c, std::size_t seq, std::span<const token_id> ids) {
    for (std::size_t l = 0; l < kLayers; ++l) {
      std::vector<float> k, v;
      for (token_id t : ids) {
        const auto& r = row(t, l);
        k.insert(k.end(), r.begin(), r.begin() + kHeads * kDim);
        v.insert(v.end(), r.begin() + kHeads * kDim, r.end());
      }
      c.append(l, seq, TokenBlock<const float>{k, ids.size(), kHeads, kDim},
               TokenBlock<const float>{v, ids.size(), kHeads, kDim});
    }
    c.commit(seq, ids);
  }
  // From-scratch attention of query q at the last position of `prompt`, layer 1.
  std::vector<float> scratch(const std::vector<token_id>& prompt, const std::vector<float>& q) {
    std::vector<float> k, v;
    for (token_id t : prompt) {
      const auto& r = row(t, 1);
      k.insert(k.end(), r.begin(), r.begin() + kHeads * kDim);
      v.insert(v.end(), r.begin() + kHeads * kDim, r.end());
    }
    return kvcache::test::scratch_attention(q, 1, kHeads, k, v, prompt.size(), kHeads, kDim,
                                            static_cast<position_t>(prompt.size() - 1), {});
  }
};

template <class Cache>
std::vector<float> attend_last(const Cache& c, std::size_t seq, const std::vector<float>& q) {
  std::vector<float> out(q.size());
  attend({q, 1, kHeads, kDim}, c.view(1, seq), {out, 1, kHeads, kDim});
  return out;
}

}  // namespace

TEST_CASE("reusing a cache for a different prompt crops to the common prefix; no contamination") {
  ToyModel model;
  TokenTrackedCache<StaticCache<float>> cache(StaticCache<float>(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .max_seq_len = 64}));
  const std::vector<token_id> prompt_a{1, 10, 11, 12, 13, 14, 15};
  const std::vector<token_id> prompt_b{1, 10, 11, 99, 98};  // shares 3 tokens with A
  REQUIRE(cache.reuse_prefix(0, prompt_a) == 0);
  model.prefill(cache, 0, prompt_a);
  const auto q = kvcache::test::normal_floats(model.rng, kHeads * kDim);

  SECTION("naive reuse attends to prompt A's tokens (what the guard prevents)") {
    // Appending B's new tokens after A's would put A's 4 extra tokens in B's context.
    const std::vector<token_id> suffix(prompt_b.begin() + 3, prompt_b.end());
    model.prefill(cache, 0, suffix);
    const auto naive = attend_last(cache, 0, q);
    const auto report =
        kvcache::test::mismatch_report(naive, model.scratch(prompt_b, q), {1e-4, 1e-4});
    REQUIRE_FALSE(report.empty());  // the contaminated output differs from B's true output
  }
  SECTION("reuse_prefix crops to the shared prefix, and the result equals a from-scratch run") {
    const std::size_t reused = cache.reuse_prefix(0, prompt_b);
    REQUIRE(reused == 3);
    REQUIRE(cache.seq_length(0) == 3);
    const std::vector<token_id> suffix(prompt_b.begin() + static_cast<std::ptrdiff_t>(reused),
                                       prompt_b.end());
    model.prefill(cache, 0, suffix);
    REQUIRE(std::vector<token_id>(cache.tokens(0).begin(), cache.tokens(0).end()) == prompt_b);
    kvcache::test::require_close(attend_last(cache, 0, q), model.scratch(prompt_b, q),
                                 Tolerance{2e-5, 2e-5});
  }
  SECTION("an identical prompt reuses all but its last token, which must be run for logits") {
    REQUIRE(cache.reuse_prefix(0, prompt_a) == prompt_a.size() - 1);
  }
  SECTION("a completely different prompt reuses nothing") {
    const std::vector<token_id> other{2, 3, 4};
    REQUIRE(cache.reuse_prefix(0, other) == 0);
    REQUIRE(cache.seq_length(0) == 0);
  }
}

TEST_CASE("uncommitted appends are dropped by the next reuse_prefix") {
  ToyModel model;
  TokenTrackedCache<DynamicCache<half>> cache(DynamicCache<half>(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .chunk_len = 4}));
  const std::vector<token_id> p{5, 6, 7};
  model.prefill(cache, 0, p);
  // an aborted request: K/V appended to layer 0 only, never committed
  std::vector<float> junk(kHeads * kDim, 3.0f);
  cache.append(0, 0, TokenBlock<const float>{junk, 1, kHeads, kDim},
               TokenBlock<const float>{junk, 1, kHeads, kDim});
  kvcache::test::require_throws<position_error>([&] { cache.commit(0, std::vector<token_id>{8}); },
                                                "layer 1 holds 3");
  const std::vector<token_id> next{5, 6, 7, 8, 9};
  REQUIRE(cache.reuse_prefix(0, next) == 3);
  REQUIRE(cache.layer_length(0, 0) == 3);
  REQUIRE(cache.layer_length(1, 0) == 3);
}

TEST_CASE("a sliding window that evicted the shared prefix is reset rather than reused") {
  ToyModel model;
  TokenTrackedCache<SlidingWindowCache<float>> cache(SlidingWindowCache<float>(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .window = 4}));
  std::vector<token_id> p;
  for (token_id t = 0; t < 12; ++t) {
    p.push_back(t);
    model.prefill(cache, 0, std::vector<token_id>{t});
  }
  std::vector<token_id> extended(p);
  extended.push_back(78);
  REQUIRE(cache.reuse_prefix(0, extended) == p.size());  // a continuation keeps everything
  std::vector<token_id> q(p.begin(), p.begin() + 6);
  q.push_back(77);
  REQUIRE(cache.reuse_prefix(0, q) == 0);  // positions 3..5 were evicted: start over
  REQUIRE(cache.seq_length(0) == 0);
  REQUIRE(cache.tokens(0).empty());
}

TEST_CASE("a DynamicCache reused for a new prompt keeps the cropped chunks for the next turn") {
  ToyModel model;
  TokenTrackedCache<DynamicCache<float>> cache(DynamicCache<float>(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .chunk_len = 4}));
  const std::vector<token_id> prompt_a{1, 10, 11, 12, 13, 14, 15, 16, 17, 18};  // 3 chunks
  const std::vector<token_id> prompt_b{1, 10, 11, 99, 98, 97, 96, 95, 94};      // shares 3
  model.prefill(cache, 0, prompt_a);
  const std::size_t chunk = kv_cache_bytes(1, kHeads, kDim, 4, sizeof(float));
  REQUIRE(cache.memory_bytes() == kLayers * 3 * chunk);

  REQUIRE(cache.reuse_prefix(0, prompt_b) == 3);
  REQUIRE(cache.cache().spare_bytes() == kLayers * 2 * chunk);  // chunks 2 and 3 of each layer
  const auto q = kvcache::test::normal_floats(model.rng, kHeads * kDim);
  SECTION("the next turn's tokens go into the spares: no new memory, no contamination") {
    model.prefill(cache, 0, std::span<const token_id>(prompt_b).subspan(3));
    REQUIRE(cache.memory_bytes() == kLayers * 3 * chunk);
    REQUIRE(cache.cache().spare_bytes() == 0);
    kvcache::test::require_close(attend_last(cache, 0, q), model.scratch(prompt_b, q),
                                 Tolerance{2e-5, 2e-5});
  }
  SECTION("shrink_to_fit frees the spares and keeps the shared prefix") {
    cache.shrink_to_fit();
    REQUIRE(cache.memory_bytes() == kLayers * 1 * chunk);
    REQUIRE(cache.tokens(0).size() == 3);
    const std::vector<token_id> prefix(prompt_b.begin(), prompt_b.begin() + 3);
    kvcache::test::require_close(attend_last(cache, 0, q), model.scratch(prefix, q),
                                 Tolerance{2e-5, 2e-5});
  }
}

TEST_CASE("shrink_to_fit on a tracked cache without spares changes nothing") {
  ToyModel model;
  TokenTrackedCache<StaticCache<float>> cache(StaticCache<float>(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .max_seq_len = 8}));
  const std::vector<token_id> prompt{1, 2, 3};
  model.prefill(cache, 0, prompt);
  const std::size_t bytes = cache.memory_bytes();
  cache.shrink_to_fit();
  REQUIRE(cache.memory_bytes() == bytes);
  REQUIRE(cache.seq_length(0) == 3);
}
