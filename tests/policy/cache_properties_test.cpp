// SPDX-License-Identifier: Apache-2.0
// Properties every policy and storage format must have: attention over a cache filled in any order
// of chunks, over several turns and several sequences, equals attention recomputed from scratch;
// crop + re-append equals a fresh fill; reset forgets; every bad argument throws a typed error and
// changes nothing.
#include <tuple>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

template <class C>
struct Policy;

template <KVElement T>
struct Policy<StaticCache<T>> {
  static StaticCache<T> make(std::size_t layers, std::size_t heads, std::size_t dim,
                             std::size_t batch, std::size_t capacity) {
    return StaticCache<T>({.num_layers = layers,
                           .num_kv_heads = heads,
                           .head_dim = dim,
                           .max_batch = batch,
                           .max_seq_len = capacity});
  }
  static constexpr std::size_t kMaxChunk = 1u << 20;
};

template <KVElement T>
struct Policy<DynamicCache<T>> {
  static DynamicCache<T> make(std::size_t layers, std::size_t heads, std::size_t dim,
                              std::size_t batch, std::size_t capacity) {
    return DynamicCache<T>({.num_layers = layers,
                            .num_kv_heads = heads,
                            .head_dim = dim,
                            .max_batch = batch,
                            .max_seq_len = capacity,
                            .chunk_len = 16});
  }
  static constexpr std::size_t kMaxChunk = 1u << 20;
};

// A window as long as the capacity: nothing is evicted, so full attention must come out.
template <KVElement T>
struct Policy<SlidingWindowCache<T>> {
  static SlidingWindowCache<T> make(std::size_t layers, std::size_t heads, std::size_t dim,
                                    std::size_t batch, std::size_t capacity) {
    return SlidingWindowCache<T>({.num_layers = layers,
                                  .num_kv_heads = heads,
                                  .head_dim = dim,
                                  .max_batch = batch,
                                  .window = capacity,
                                  .num_sink_tokens = 3,
                                  .max_append_len = kMaxChunk});
  }
  static constexpr std::size_t kMaxChunk = 64;
};

// Enough blocks for every sequence at full capacity, blocks of 16 tokens.
template <KVElement T>
struct Policy<PagedCache<T>> {
  static PagedCache<T> make(std::size_t layers, std::size_t heads, std::size_t dim,
                            std::size_t batch, std::size_t capacity) {
    return PagedCache<T>({.num_layers = layers,
                          .num_kv_heads = heads,
                          .head_dim = dim,
                          .num_blocks = batch * ((capacity + 15) / 16),
                          .block_size = 16,
                          .max_batch = batch,
                          .max_seq_len = capacity});
  }
  static constexpr std::size_t kMaxChunk = 1u << 20;
};

template <class T>
Tolerance unrounded_tolerance() {
  if constexpr (std::same_as<T, float>) return {2e-5, 2e-5};
  if constexpr (std::same_as<T, half>) return {6e-3, 6e-3};
  if constexpr (std::same_as<T, fp8_e4m3>) return {0.2, 0.2};
  return {5e-2, 5e-2};  // bfloat16, int8
}

}  // namespace

#define KVCACHE_ALL_POLICIES                                                                       \
  StaticCache<float>, StaticCache<half>, StaticCache<bfloat16>, DynamicCache<float>,               \
      DynamicCache<half>, DynamicCache<bfloat16>, SlidingWindowCache<float>,                       \
      SlidingWindowCache<half>, SlidingWindowCache<bfloat16>, PagedCache<float>, PagedCache<half>, \
      PagedCache<bfloat16>, StaticCache<qint8>, StaticCache<fp8_e4m3>, DynamicCache<qint8>,        \
      DynamicCache<fp8_e4m3>, SlidingWindowCache<qint8>, SlidingWindowCache<fp8_e4m3>,             \
      PagedCache<qint8>, PagedCache<fp8_e4m3>

TEMPLATE_TEST_CASE(
    "attention over a cache filled in random chunks over several turns equals "
    "attention recomputed from scratch",
    "", KVCACHE_ALL_POLICIES) {
  using T = typename TestType::value_type;
  auto rng = kvcache::test::make_rng("chunked-fill");
  constexpr std::size_t kLayers = 2, kHeads = 2, kGroup = 4, kDim = 32, kBatch = 3, kTotal = 300;
  auto cache = Policy<TestType>::make(kLayers, kHeads, kDim, kBatch, kTotal);
  const AttentionOptions opts{
      .window = std::is_same_v<TestType, SlidingWindowCache<T>> ? kTotal : 0,
      .num_sink_tokens = std::is_same_v<TestType, SlidingWindowCache<T>> ? 3u : 0u};
  // per sequence, per layer: the tokens' K/V
  std::vector<std::vector<kvcache::test::TokenKV>> data(kBatch);
  std::vector<std::size_t> len(kBatch, 0);
  for (auto& seq : data) {
    for (std::size_t l = 0; l < kLayers; ++l)
      seq.push_back(kvcache::test::random_kv(rng, kTotal, kHeads, kDim));
  }
  const std::vector<std::size_t> sizes{1, 7, 64, 3, 1, 33};
  for (int turn = 0; turn < 12; ++turn) {
    const std::size_t s = kvcache::test::uniform(rng, 0, kBatch - 1);  // sequences interleave
    const std::size_t n = std::min(kvcache::test::uniform(rng, 1, 60), kTotal - len[s]);
    if (n == 0) continue;
    std::vector<std::size_t> chunked;
    for (std::size_t c : sizes) chunked.push_back(std::min(c, Policy<TestType>::kMaxChunk));
    std::rotate(chunked.begin(), chunked.begin() + static_cast<std::ptrdiff_t>(turn % 6),
                chunked.end());
    for (std::size_t l = 0; l < kLayers; ++l) {
      kvcache::test::append_in_chunks(cache, l, s, data[s][l], len[s], n, chunked);
    }
    len[s] += n;
    REQUIRE(cache.seq_length(s) == len[s]);
    // the turn's new tokens query every layer; compare with from-scratch attention
    const std::size_t nq = std::min<std::size_t>(n, 16);
    const auto q = kvcache::test::normal_floats(rng, nq * kHeads * kGroup * kDim);
    for (std::size_t l = 0; l < kLayers; ++l) {
      const auto view = cache.view(l, s);
      kvcache::test::check_view_invariants(view);
      std::vector<float> got(q.size());
      attend({q, nq, kHeads * kGroup, kDim}, view, {got, nq, kHeads * kGroup, kDim}, opts);
      const auto& kv = data[s][l];
      const position_t first = static_cast<position_t>(len[s] - nq);
      const auto exact = kvcache::test::scratch_attention(
          q, nq, kHeads * kGroup, kvcache::test::rounded<T>(kv.k, kDim),
          kvcache::test::rounded<T>(kv.v, kDim), len[s], kHeads, kDim, first, opts);
      INFO("turn " << turn << " sequence " << s << " layer " << l << " length " << len[s]);
      // same stored values: fp32 accumulation vs double only
      kvcache::test::require_close(got, exact, Tolerance{2e-5, 2e-5});
      // against the unrounded fp32 K/V: bounded by the element type's rounding
      const auto fp32 = kvcache::test::scratch_attention(q, nq, kHeads * kGroup, kv.k, kv.v, len[s],
                                                         kHeads, kDim, first, opts);
      kvcache::test::require_close(got, fp32, unrounded_tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("crop then re-append equals a fresh fill; reset forgets one sequence only", "",
                   KVCACHE_ALL_POLICIES) {
  auto rng = kvcache::test::make_rng("crop-reappend");
  constexpr std::size_t kLayers = 2, kHeads = 1, kDim = 8, kCap = 200;
  auto cache = Policy<TestType>::make(kLayers, kHeads, kDim, 2, kCap);
  auto fresh = Policy<TestType>::make(kLayers, kHeads, kDim, 2, kCap);
  const auto a = kvcache::test::random_kv(rng, 100, kHeads, kDim);
  const auto b = kvcache::test::random_kv(rng, 50, kHeads, kDim);
  const std::vector<std::size_t> sizes{std::min<std::size_t>(37, Policy<TestType>::kMaxChunk), 1};
  for (std::size_t l = 0; l < kLayers; ++l) {
    kvcache::test::append_in_chunks(cache, l, 0, a, 0, 100, sizes);
    kvcache::test::append_in_chunks(cache, l, 1, b, 0, 50, sizes);
  }
  const auto seq1_before = kvcache::test::view_contents(cache.view(1, 1));
  const std::size_t keep = 61;
  REQUIRE(cache.can_crop(0, keep));
  cache.crop(0, keep);
  REQUIRE(cache.seq_length(0) == keep);
  for (std::size_t l = 0; l < kLayers; ++l) {
    kvcache::test::append_in_chunks(cache, l, 0, b, 0, 50, sizes);
    kvcache::test::append_in_chunks(fresh, l, 0, a, 0, keep, sizes);
    kvcache::test::append_in_chunks(fresh, l, 0, b, 0, 50, sizes);
  }
  for (std::size_t l = 0; l < kLayers; ++l) {
    REQUIRE(kvcache::test::view_contents(cache.view(l, 0)) ==
            kvcache::test::view_contents(fresh.view(l, 0)));
  }
  REQUIRE(kvcache::test::view_contents(cache.view(1, 1)) == seq1_before);
  cache.reset(0);
  REQUIRE(cache.seq_length(0) == 0);
  REQUIRE(cache.view(0, 0).num_segments() == 0);
  REQUIRE(kvcache::test::view_contents(cache.view(1, 1)) == seq1_before);
}

TEMPLATE_TEST_CASE("every bad argument throws a typed error naming the numbers, cache unchanged",
                   "", KVCACHE_ALL_POLICIES) {
  using kvcache::test::require_throws;
  auto rng = kvcache::test::make_rng("errors");
  auto cache = Policy<TestType>::make(3, 2, 8, 2, 32);
  const auto kv = kvcache::test::random_kv(rng, 8, 2, 8);
  for (std::size_t l = 0; l < 3; ++l) cache.append(l, 1, kv.k_block(0, 5), kv.v_block(0, 5));
  const auto before = kvcache::test::cache_contents(cache);
  const auto wrong_dim = kvcache::test::random_kv(rng, 2, 2, 4);
  const auto wrong_heads = kvcache::test::random_kv(rng, 2, 4, 8);
  require_throws<shape_error>(
      [&] { cache.append(0, 1, wrong_dim.k_block(0, 2), wrong_dim.v_block(0, 2)); }, "head_dim 4",
      "head_dim 8");
  require_throws<shape_error>(
      [&] { cache.append(0, 1, wrong_heads.k_block(0, 2), wrong_heads.v_block(0, 2)); }, "4 heads",
      "2 heads");
  require_throws<shape_error>([&] { cache.append(0, 1, kv.k_block(0, 2), kv.v_block(0, 3)); },
                              "2 K tokens", "3 V tokens");
  require_throws<shape_error>([&] { cache.append(0, 1, kv.k_block(0, 0), kv.v_block(0, 0)); },
                              "zero-length");
  require_throws<layer_error>([&] { cache.append(3, 1, kv.k_block(0, 1), kv.v_block(0, 1)); },
                              "layer 3", "num_layers 3");
  require_throws<layer_error>([&] { (void)cache.view(7, 0); }, "layer 7");
  require_throws<batch_error>([&] { cache.append(0, 2, kv.k_block(0, 1), kv.v_block(0, 1)); },
                              "sequence 2", "max_batch 2");
  require_throws<position_error>([&] { cache.crop(1, 6); }, "to 6 tokens", "holds only 5");
  REQUIRE_FALSE(cache.can_crop(1, 6));
  std::vector<float> q(5 * 8), out(5 * 8);
  require_throws<shape_error>(
      [&] {
        attend({q, 1, 5, 8}, cache.view(0, 1), {out, 1, 5, 8});
      },
      "num_q_heads 5", "num_kv_heads 2");
  REQUIRE(kvcache::test::cache_contents(cache) == before);
}
