// SPDX-License-Identifier: Apache-2.0
// The policies' restore() hooks: restoring what a view reports reproduces the cache bit for bit,
// including a sliding window's ring, sinks and evicted gap, so that later appends, crops and
// attention behave as in the original; invalid states are refused with nothing changed.
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/snapshot_helpers.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::append_random;
using kvcache::test::pack_all;
using kvcache::test::require_same_contents;

namespace {

template <class Cache>
std::vector<LayerRestore<typename Cache::value_type>> entries_of(
    const std::vector<kvcache::test::PackedLayer<typename Cache::value_type>>& packed) {
  std::vector<LayerRestore<typename Cache::value_type>> out;
  for (const auto& p : packed) out.push_back(p.entry());
  return out;
}

template <class Cache>
std::size_t spare_bytes(const Cache& c) {
  if constexpr (requires { c.spare_bytes(); }) {
    return c.spare_bytes();
  } else {
    return 0;
  }
}

/// Fills `a` at random, restores its packed contents into the fresh `b`, checks equality, then
/// drives both with the same appends and crops and checks that they stay equal.
template <class Cache>
void check_round_trip(Cache& a, Cache& b, std::mt19937_64& rng, std::size_t max_len,
                      std::size_t max_chunk) {
  for (std::size_t s = 0; s < a.max_batch(); ++s) {
    append_random(a, rng, s, kvcache::test::uniform(rng, 0, max_len), max_chunk);
  }
  const auto packed = pack_all(a);
  b.restore(entries_of<Cache>(packed));
  require_same_contents(a, b);
  REQUIRE(a.memory_bytes() == b.memory_bytes() - spare_bytes(b));  // b may keep its old chunks
  for (int round = 0; round < 3; ++round) {
    for (std::size_t s = 0; s < a.max_batch(); ++s) {
      const std::size_t n = kvcache::test::uniform(rng, 1, max_chunk);
      auto rng_b = rng;  // the same random tokens for both caches
      append_random(a, rng, s, n, max_chunk);
      append_random(b, rng_b, s, n, max_chunk);
      const std::size_t len = a.seq_length(s);
      for (std::size_t target = len; target + 4 >= len && target > 0; --target) {
        REQUIRE(a.can_crop(s, target) == b.can_crop(s, target));
      }
      const std::size_t back = kvcache::test::uniform(rng, 0, std::min<std::size_t>(len, 2));
      if (a.can_crop(s, len - back)) {
        a.crop(s, len - back);
        b.crop(s, len - back);
      }
    }
    require_same_contents(a, b);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("restore reproduces a static cache exactly", "", float, half, bfloat16, qint8,
                   fp8_e4m3) {
  auto rng = kvcache::test::make_rng("restore-static");
  const StaticCacheConfig cfg{
      .num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .max_batch = 3, .max_seq_len = 64};
  StaticCache<TestType> a(cfg), b(cfg);
  check_round_trip(a, b, rng, 40, 7);
}

TEMPLATE_TEST_CASE("restore reproduces a dynamic cache exactly, chunks and memory included", "",
                   float, half, bfloat16, qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("restore-dynamic");
  const DynamicCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 3, .head_dim = 4, .max_batch = 3, .chunk_len = 5};
  DynamicCache<TestType> a(cfg), b(cfg);
  append_random(b, rng, 2, 23, 4);  // b's old contents are replaced, memory accounted
  check_round_trip(a, b, rng, 40, 6);
}

TEST_CASE("a dynamic cache's restore reuses the chunks it replaces and its spares") {
  auto rng = kvcache::test::make_rng("restore-dynamic-reuse");
  const DynamicCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .max_batch = 2, .chunk_len = 4};
  const std::size_t chunk = 2 * 4 * 2 * 4 * sizeof(float);  // K and V of chunk_len tokens
  DynamicCache<float> a(cfg);
  append_random(a, rng, 0, 10, 3);  // 3 chunks per layer
  append_random(a, rng, 1, 7, 3);   // 2 chunks per layer
  REQUIRE(a.memory_bytes() == 10 * chunk);
  const auto packed = pack_all(a);
  const auto entries = entries_of<DynamicCache<float>>(packed);

  DynamicCache<float> b(cfg);  // 8 chunks held by sequence 0, 4 spare from sequence 1
  append_random(b, rng, 0, 13, 5);
  append_random(b, rng, 1, 5, 5);
  b.reset(1);
  REQUIRE(b.memory_bytes() == 12 * chunk);
  REQUIRE(b.spare_bytes() == 4 * chunk);
  b.restore(entries);
  require_same_contents(a, b);
  REQUIRE(b.memory_bytes() == 12 * chunk);  // nothing allocated, nothing freed
  REQUIRE(b.spare_bytes() == 2 * chunk);

  DynamicCache<float> c(cfg);  // 2 chunks held: the other 8 are allocated
  append_random(c, rng, 1, 3, 3);
  c.restore(entries);
  require_same_contents(a, c);
  REQUIRE(c.memory_bytes() == 10 * chunk);
  REQUIRE(c.spare_bytes() == 0);

  DynamicCacheConfig no_spares = cfg;  // max_spare_chunks 0: the 10 chunks left over are freed
  no_spares.max_spare_chunks = 0;
  DynamicCache<float> d(no_spares);
  append_random(d, rng, 0, 40, 8);
  REQUIRE(d.memory_bytes() == 20 * chunk);
  d.restore(entries);
  require_same_contents(a, d);
  REQUIRE(d.memory_bytes() == 10 * chunk);
  REQUIRE(d.spare_bytes() == 0);
  // and each restored cache goes on like the original
  for (auto* x : {&b, &c, &d}) {
    auto rng_x = rng;
    append_random(*x, rng_x, 1, 6, 4);
  }
  append_random(a, rng, 1, 6, 4);
  require_same_contents(a, b);
  require_same_contents(a, c);
  require_same_contents(a, d);
}

TEMPLATE_TEST_CASE("restore reproduces a sliding window: ring, sinks, evicted gap", "", float, half,
                   qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("restore-sliding");
  for (std::size_t sinks : {0, 1, 4}) {
    for (std::size_t max_append : {1, 5}) {
      const SlidingWindowCacheConfig cfg{.num_layers = 2,
                                         .num_kv_heads = 2,
                                         .head_dim = 4,
                                         .max_batch = 3,
                                         .window = 8,
                                         .num_sink_tokens = sinks,
                                         .max_append_len = max_append};
      SlidingWindowCache<TestType> a(cfg), b(cfg);
      INFO("sinks " << sinks << " max_append_len " << max_append);
      check_round_trip(a, b, rng, 300, max_append);
    }
  }
}

TEST_CASE("a sliding window of length 10000 restores with only sinks + ring held") {
  auto rng = kvcache::test::make_rng("restore-long-window");
  const SlidingWindowCacheConfig cfg{.num_layers = 1,
                                     .num_kv_heads = 1,
                                     .head_dim = 2,
                                     .window = 16,
                                     .num_sink_tokens = 3,
                                     .max_append_len = 4};
  SlidingWindowCache<float> a(cfg), b(cfg);
  append_random(a, rng, 0, 10000, 4);
  const auto packed = pack_all(a);
  REQUIRE(packed[0].length == 10000);
  REQUIRE(packed[0].sink_end == 3);
  REQUIRE(packed[0].recent_begin >= 10000 - 19);
  b.restore(entries_of<SlidingWindowCache<float>>(packed));
  require_same_contents(a, b);
  const auto view = b.view(0, 0);
  kvcache::test::check_view_invariants(view);
  // attention over the restored window equals attention over the original
  const auto q = kvcache::test::normal_floats(rng, 2 * 2);
  std::vector<float> out_a(q.size()), out_b(q.size());
  const AttentionOptions opts{.window = 16, .num_sink_tokens = 3};
  attend({q, 1, 2, 2}, a.view(0, 0), {out_a, 1, 2, 2}, opts);
  attend({q, 1, 2, 2}, view, {out_b, 1, 2, 2}, opts);
  REQUIRE(out_a == out_b);
}

TEST_CASE("restore refuses bad entries with a typed error and changes nothing") {
  auto rng = kvcache::test::make_rng("restore-errors");
  const StaticCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 1, .head_dim = 2, .max_batch = 2, .max_seq_len = 8};
  StaticCache<float> c(cfg);
  append_random(c, rng, 0, 5, 3);
  const auto before = kvcache::test::cache_contents(c);
  std::vector<float> kv(2 * 3, 1.0f);
  const std::span<const float> three(kv);  // 3 positions of 1 head x 2 dims
  const LayerRestore<float> good{0, 1, 3, 0, 0, three, three};
  auto with = [&](LayerRestore<float> bad) {
    return std::vector<LayerRestore<float>>{good, bad};  // the good one must not land either
  };
  using kvcache::test::require_throws;
  require_throws<layer_error>(
      [&] {
        c.restore(with({2, 1, 3, 0, 0, three, three}));
      },
      "layer 2", "num_layers 2");
  require_throws<batch_error>(
      [&] {
        c.restore(with({1, 2, 3, 0, 0, three, three}));
      },
      "sequence 2", "max_batch 2");
  require_throws<shape_error>([&] { c.restore(with(good)); }, "entries 0 and 1", "layer 0");
  require_throws<shape_error>(
      [&] {
        c.restore(with({1, 1, 2, 0, 0, three, three}));
      },
      "holds 2 positions", "got 6");
  require_throws<position_error>(
      [&] {
        c.restore(with({1, 1, 3, 2, 1, three, three}));
      },
      "sink_end <= recent_begin");
  require_throws<position_error>(
      [&] {
        c.restore(with({1, 1, 4, 1, 2, three, three}));
      },
      "drops positions [1, 2)");
  std::vector<float> big(2 * 9, 0.0f);
  require_throws<capacity_error>(
      [&] {
        c.restore(with({1, 1, 9, 0, 0, big, big}));
      },
      "holds 9", "max_seq_len 8");
  REQUIRE(kvcache::test::cache_contents(c) == before);

  SlidingWindowCache<float> w({.num_layers = 1,
                               .num_kv_heads = 1,
                               .head_dim = 2,
                               .window = 4,
                               .num_sink_tokens = 2,
                               .max_append_len = 1});
  append_random(w, rng, 0, 20, 1);
  const auto wbefore = kvcache::test::cache_contents(w);
  std::vector<float> eight(2 * 8, 0.0f), four(2 * 4, 0.0f);
  // 20 positions holding sinks [0, 2) and [14, 20): 6 ring positions > ring_len 4
  require_throws<capacity_error>(
      [&] {
        w.restore(std::vector{LayerRestore<float>{0, 0, 20, 2, 14, eight, eight}});
      },
      "6 ring positions", "ring_len 4");
  // sink_end must be min(length, num_sink_tokens)
  require_throws<position_error>(
      [&] {
        w.restore(std::vector{LayerRestore<float>{0, 0, 20, 1, 17, four, four}});
      },
      "not a state of a window with 2 sink tokens");
  require_throws<position_error>(
      [&] {
        w.restore(std::vector{LayerRestore<float>{0, 0, 1, 0, 1, {}, {}}});
      },
      "length 1, sink_end 0");
  REQUIRE(kvcache::test::cache_contents(w) == wbefore);
}

TEST_CASE("TokenTrackedCache restore sets the ids with the K/V, or nothing") {
  auto rng = kvcache::test::make_rng("restore-tracked");
  const StaticCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 1, .head_dim = 2, .max_batch = 2, .max_seq_len = 16};
  TokenTrackedCache<StaticCache<float>> a{StaticCache<float>(cfg)};
  TokenTrackedCache<StaticCache<float>> b{StaticCache<float>(cfg)};
  const std::vector<token_id> ids{5, 9, 2, 7, 7};
  append_random(a, rng, 1, ids.size(), 2);
  a.commit(1, ids);
  append_random(a, rng, 1, 2, 2);  // appended but not committed
  const auto packed = pack_all(a);
  const auto entries = entries_of<StaticCache<float>>(packed);
  using kvcache::test::require_throws;
  require_throws<shape_error>([&] { b.restore(entries, {}); }, "sequence 0 without its token ids");
  const std::vector<token_id> too_many(8, 1);
  const std::vector<SequenceTokens> bad{{0, {}}, {1, too_many}};
  require_throws<position_error>([&] { b.restore(entries, bad); }, "8 token ids",
                                 "will hold 7 tokens");
  REQUIRE(b.seq_length(1) == 0);
  const std::vector<SequenceTokens> tokens{{0, {}}, {1, ids}};
  b.restore(entries, tokens);
  require_same_contents(a.cache(), b.cache());
  REQUIRE(std::vector<token_id>(b.tokens(1).begin(), b.tokens(1).end()) == ids);
  // the wrapper works as before: the next prompt reuses the committed prefix only
  const std::vector<token_id> prompt{5, 9, 2, 8};
  REQUIRE(b.reuse_prefix(1, prompt) == 3);
  REQUIRE(b.seq_length(1) == 3);
}
