// SPDX-License-Identifier: Apache-2.0
// Attention over int8 and fp8 K/V: every CPU kernel equals the reference recomputed over the same
// codes and scales (the kernels read codes directly); the result does not depend on how the
// tokens were chunked; inf and NaN in a quantized row reach exactly the queries that see it; and
// the error quantization costs against fp32 attention stays within the bounds measured for it.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

struct ErrorStats {
  double max_abs = 0.0;  // largest |quantized - fp32|
  double rms = 0.0;      // RMS of the difference over RMS of the fp32 output
};

ErrorStats error_of(const std::vector<float>& got, const std::vector<float>& want) {
  double diff2 = 0.0, want2 = 0.0;
  ErrorStats e;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    e.max_abs = std::max(e.max_abs, std::fabs(d));
    diff2 += d * d;
    want2 += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  e.rms = std::sqrt(diff2 / want2);
  return e;
}

}  // namespace

TEMPLATE_TEST_CASE("attention over quantized K/V equals the reference over the same codes",
                   "[attention][quantized]", qint8, fp8_e4m3) {
  using T = TestType;
  auto rng = test::make_rng("quantized attention equals reference");
  for (std::size_t dim : {8u, 64u, 128u, 256u}) {
    const std::size_t kv_heads = 2, q_heads = 8, tokens = 70 + test::uniform(rng, 0, 90);
    const test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
    StaticCache<T> flat({1, kv_heads, dim, 1, tokens});
    SlidingWindowCache<T> ring({.num_layers = 1,
                                .num_kv_heads = kv_heads,
                                .head_dim = dim,
                                .max_batch = 1,
                                .window = 40,
                                .num_sink_tokens = 3,
                                .max_append_len = 8});
    test::append_in_chunks(flat, 0, 0, kv, 0, tokens, {5, 1, 17});
    test::append_in_chunks(ring, 0, 0, kv, 0, tokens, {8, 3, 1});
    for (std::size_t n : {1u, 6u}) {
      std::vector<float> q = test::normal_floats(rng, n * q_heads * dim);
      for (float& x : q) x *= 2.0f;  // a peakier softmax than N(0, 1) queries give
      const auto first = static_cast<position_t>(tokens - n);
      AttentionOptions opts{.query_pos = first};
      AttentionOptions windowed{.window = 40, .num_sink_tokens = 3, .query_pos = first};
      for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
        INFO(dtype_name(dtype_of<T>) << ", head_dim " << dim << ", " << n << " queries, "
                                     << test::kernel_name(kernel) << " kernel");
        // The fast kernel adds in fp32 what the reference adds in double.
        const Tolerance tol{2e-6, 2e-5};
        test::require_close(test::attend_fast(q, n, q_heads, flat.view(0, 0), opts, kernel),
                            test::attend_slow(q, n, q_heads, flat.view(0, 0), opts), tol);
        test::require_close(test::attend_fast(q, n, q_heads, ring.view(0, 0), windowed, kernel),
                            test::attend_slow(q, n, q_heads, ring.view(0, 0), windowed), tol);
      }
    }
  }
}

TEMPLATE_TEST_CASE("quantized K/V: chunking changes no bit, windows agree with full caches",
                   "[attention][quantized]", qint8, fp8_e4m3) {
  using T = TestType;
  auto rng = test::make_rng("quantized chunking");
  const std::size_t dim = 64, kv_heads = 2, q_heads = 4, tokens = 150;
  const test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
  StaticCache<T> one({1, kv_heads, dim, 1, tokens}), many({1, kv_heads, dim, 1, tokens});
  SlidingWindowCache<T> ring({1, kv_heads, dim, 1, 64, 4, 16});
  test::append_in_chunks(one, 0, 0, kv, 0, tokens, {tokens});
  test::append_in_chunks(many, 0, 0, kv, 0, tokens, {1, 7, 2, 13});
  test::append_in_chunks(ring, 0, 0, kv, 0, tokens, {16, 5});
  REQUIRE(test::view_contents(one.view(0, 0)) == test::view_contents(many.view(0, 0)));
  const std::vector<float> q = test::normal_floats(rng, q_heads * dim);
  const AttentionOptions opts{.query_pos = tokens - 1};
  const AttentionOptions windowed{.window = 64, .num_sink_tokens = 4, .query_pos = tokens - 1};
  for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
    INFO(test::kernel_name(kernel));
    REQUIRE(test::same_bits(test::attend_fast(q, 1, q_heads, one.view(0, 0), opts, kernel),
                            test::attend_fast(q, 1, q_heads, many.view(0, 0), opts, kernel)));
    // The ring holds the same rows at other addresses: the same bits as the full cache masked.
    REQUIRE(test::same_bits(test::attend_fast(q, 1, q_heads, ring.view(0, 0), windowed, kernel),
                            test::attend_fast(q, 1, q_heads, one.view(0, 0), windowed, kernel)));
  }
}

TEMPLATE_TEST_CASE("quantized K/V: inf and NaN reach exactly the queries that see them",
                   "[attention][quantized]", qint8, fp8_e4m3) {
  using T = TestType;
  auto rng = test::make_rng("quantized nonfinite");
  const std::size_t dim = 32, kv_heads = 1, q_heads = 2, tokens = 100;
  for (bool in_v : {false, true}) {
    for (float bad : {INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
      test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
      const std::size_t poisoned = 20;  // token 20's row holds one bad value
      (in_v ? kv.v : kv.k)[poisoned * dim + 7] = bad;
      StaticCache<T> cache({1, kv_heads, dim, 1, tokens});
      test::append_in_chunks(cache, 0, 0, kv, 0, tokens, {9});
      const std::vector<float> q = test::normal_floats(rng, q_heads * dim);
      for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
        INFO((in_v ? "V" : "K") << " holds " << bad << ", " << test::kernel_name(kernel));
        // The last query sees token 20 without a window and not with a window of 50.
        const auto seen =
            test::attend_fast(q, 1, q_heads, cache.view(0, 0), {.query_pos = tokens - 1}, kernel);
        for (float x : seen) REQUIRE(std::isnan(x));
        const auto unseen = test::attend_fast(q, 1, q_heads, cache.view(0, 0),
                                              {.window = 50, .query_pos = tokens - 1}, kernel);
        for (float x : unseen) REQUIRE(std::isfinite(x));
        test::require_close(unseen,
                            test::attend_slow(q, 1, q_heads, cache.view(0, 0),
                                              {.window = 50, .query_pos = tokens - 1}),
                            {2e-6, 2e-5});
      }
    }
  }
}

// The error quantization costs: decode attention (8 query heads over 2 KV heads) over N(0, 1)
// K/V, queries N(0, 4), against the same attention over fp32 K/V (the README states the measured
// values). The relative RMS error is concentrated; the largest error is not: it comes from the
// few keys that dominate a query, whose weights a quantized logit can trade, so its bound is set
// well above the tail seen, not at twice a typical seed.
TEMPLATE_TEST_CASE("quantized K/V: error against fp32 attention within the measured bounds",
                   "[attention][quantized]", qint8, fp8_e4m3) {
  using T = TestType;
  auto rng = test::make_rng("quantized error");
  const std::size_t kv_heads = 2, q_heads = 8;
  // RMS error relative to the output's RMS, and the largest absolute error, over 120 seeds
  // (KVCACHE_TEST_SEED=1..120) x these 4 shapes: int8 RMS worst 0.022, largest median 0.006,
  // worst 0.031; fp8 RMS worst 0.124, largest median 0.027, worst 0.119 (and 0.182 once in ~1,600
  // runs of a shape under fresh seeds: the bound this replaced, 0.15, failed there).
  const double rms_bound = std::same_as<T, qint8> ? 0.05 : 0.25;
  const double max_bound = std::same_as<T, qint8> ? 0.08 : 0.45;
  struct Case {
    std::size_t dim, tokens;
  };
  for (const Case c : {Case{64, 1024}, Case{128, 4096}, Case{256, 2048}, Case{128, 32768}}) {
    const test::TokenKV kv = test::random_kv(rng, c.tokens, kv_heads, c.dim);
    StaticCache<float> exact({1, kv_heads, c.dim, 1, c.tokens});
    StaticCache<T> quantized({1, kv_heads, c.dim, 1, c.tokens});
    test::append_in_chunks(exact, 0, 0, kv, 0, c.tokens, {512});
    test::append_in_chunks(quantized, 0, 0, kv, 0, c.tokens, {512});
    std::vector<float> q = test::normal_floats(rng, q_heads * c.dim);
    for (float& x : q) x *= 2.0f;
    const AttentionOptions opts{.query_pos = static_cast<position_t>(c.tokens - 1)};
    const auto want =
        test::attend_fast(q, 1, q_heads, exact.view(0, 0), opts, cpu::Kernel::automatic);
    const auto got =
        test::attend_fast(q, 1, q_heads, quantized.view(0, 0), opts, cpu::Kernel::automatic);
    const ErrorStats e = error_of(got, want);
    std::printf("%s head_dim %zu, %zu tokens: max |error| %.3g, relative RMS error %.3g\n",
                dtype_name(dtype_of<T>), c.dim, c.tokens, e.max_abs, e.rms);
    INFO(dtype_name(dtype_of<T>) << ", head_dim " << c.dim << ", " << c.tokens << " tokens: max "
                                 << e.max_abs << ", relative RMS " << e.rms);
    REQUIRE(e.rms <= rms_bound);
    REQUIRE(e.max_abs <= max_bound);
  }
}

TEMPLATE_TEST_CASE("quantized caches: memory within 0.53 of half's", "[attention][quantized]",
                   qint8, fp8_e4m3) {
  using T = TestType;
  for (std::size_t dim : {64u, 128u, 256u}) {
    const StaticCache<T> q({4, 8, dim, 2, 1000});
    const StaticCache<half> h({4, 8, dim, 2, 1000});
    const SlidingWindowCache<T> qr({4, 8, dim, 2, 256, 4, 16});
    const SlidingWindowCache<half> hr({4, 8, dim, 2, 256, 4, 16});
    INFO("head_dim " << dim);
    REQUIRE(q.memory_bytes() == kv_cache_bytes(q.shape(), 1000, 2));
    REQUIRE(q.memory_bytes() == 2u * 4 * 8 * 1000 * 2 * (dim + 2));
    REQUIRE(static_cast<double>(q.memory_bytes()) <= 0.53 * static_cast<double>(h.memory_bytes()));
    REQUIRE(static_cast<double>(qr.memory_bytes()) <=
            0.53 * static_cast<double>(hr.memory_bytes()));
  }
}
