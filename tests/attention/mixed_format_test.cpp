// SPDX-License-Identifier: Apache-2.0
// Attention over keys and values stored in different formats (KVFormats<K, V>), read through a
// SegmentView or a LayoutView over the caller's own storage: every CPU kernel equals the
// reference over the same rows, whether the rows sit in one segment, in paged blocks or in a
// ring, with absolute or cache-relative positions; KVFormats<T, T> computes exactly what T does; an
// inf or NaN on either side reaches exactly the queries that see it; and the error against fp32
// attention is stated for each pair the kernels are compiled for.
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
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

constexpr std::size_t kMaxSegments = 64;

template <class F>
using MixedView = SegmentView<F, kMaxSegments>;

// The view of sequence `seq` of layer 0 that takes its keys (and their scales) from `keys` and its
// values from `values`: two caches of the same shape filled with the same appends, so that their
// segments hold the same positions at the same element offsets.
template <KVElement K, KVElement V, class CK, class CV>
MixedView<KVFormats<K, V>> mixed_view(const CK& keys, const CV& values, std::size_t seq) {
  const auto kv = keys.view(0, seq);
  const auto vv = values.view(0, seq);
  REQUIRE(kv.num_segments() == vv.num_segments());
  REQUIRE(kv.num_segments() <= kMaxSegments);
  MixedView<KVFormats<K, V>> view(kv.num_kv_heads(), kv.head_dim(), kv.length(), kv.sink_end(),
                                  kv.recent_begin());
  for (std::size_t i = 0; i < kv.num_segments(); ++i) {
    const KVSegment<K> ks = kv.segment(i);
    const KVSegment<V> vs = vv.segment(i);
    REQUIRE(ks.first_pos == vs.first_pos);
    REQUIRE(ks.len == vs.len);
    REQUIRE(ks.head_stride == vs.head_stride);
    view.push({ks.k, vs.v, ks.head_stride, ks.first_pos, ks.len, ks.k_scale, vs.v_scale});
  }
  return view;
}

template <class F>
std::string pair_name() {
  return std::string("K ") + dtype_name(dtype_of<key_format_t<F>>) + ", V " +
         dtype_name(dtype_of<value_format_t<F>>);
}

// The same rows as a LayoutView over a KVLayout<KVFormats<K, V>>: the K side (and block table) of
// `keys`' layout, the V side of `values`', as an engine describes K and V arrays of its own.
template <KVElement K, KVElement V, class CK, class CV>
LayoutView<KVFormats<K, V>> mixed_layout_view(const CK& keys, const CV& values, std::size_t seq) {
  const auto kv = keys.view(0, seq);
  const auto vv = values.view(0, seq);
  const KVLayout<K>& kl = kv.layout();
  const KVLayout<V>& vl = vv.layout();
  REQUIRE(kl.layout == vl.layout);
  REQUIRE(kl.head_stride == vl.head_stride);
  REQUIRE(kl.seq_stride == vl.seq_stride);
  REQUIRE(kl.block_stride == vl.block_stride);
  const auto kt = kv.block_table();
  const auto vt = vv.block_table();
  REQUIRE(std::vector<block_id>(kt.begin(), kt.end()) ==
          std::vector<block_id>(vt.begin(), vt.end()));
  KVLayout<KVFormats<K, V>> layout;
  layout.k = kl.k;
  layout.v = vl.v;
  layout.k_scale = kl.k_scale;
  layout.v_scale = vl.v_scale;
  layout.num_seqs = kl.num_seqs;
  layout.num_kv_heads = kl.num_kv_heads;
  layout.head_dim = kl.head_dim;
  layout.layout = kl.layout;
  layout.seq_stride = kl.seq_stride;
  layout.head_stride = kl.head_stride;
  layout.num_sinks = kl.num_sinks;
  layout.ring_len = kl.ring_len;
  layout.block_table = kl.block_table;
  layout.max_blocks = kl.max_blocks;
  layout.block_size = kl.block_size;
  layout.block_stride = kl.block_stride;
  return LayoutView<KVFormats<K, V>>(layout, kv.seq(),
                                     KeyRange{kv.sink_end(), kv.recent_begin(), kv.length()});
}

}  // namespace

TEMPLATE_TEST_CASE("K and V in different formats: every kernel equals the reference",
                   "[attention][mixed]", (KVFormats<half, qint8>), (KVFormats<half, fp8_e4m3>),
                   (KVFormats<bfloat16, qint8>), (KVFormats<bfloat16, fp8_e4m3>),
                   (KVFormats<qint8, half>), (KVFormats<fp8_e4m3, half>)) {
  using K = key_format_t<TestType>;
  using V = value_format_t<TestType>;
  auto rng = test::make_rng("mixed formats equal reference");
  for (std::size_t dim : {8u, 64u, 128u}) {
    const std::size_t kv_heads = 2, q_heads = 8, tokens = 70 + test::uniform(rng, 0, 90);
    const test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
    // One segment (static caches) and one segment per 16-token block (paged caches).
    StaticCache<K> flat_k({1, kv_heads, dim, 1, tokens});
    StaticCache<V> flat_v({1, kv_heads, dim, 1, tokens});
    const PagedCacheConfig paged_config{.num_layers = 1,
                                        .num_kv_heads = kv_heads,
                                        .head_dim = dim,
                                        .num_blocks = (tokens + 15) / 16,
                                        .block_size = 16,
                                        .max_batch = 1};
    PagedCache<K> paged_k(paged_config);
    PagedCache<V> paged_v(paged_config);
    test::append_in_chunks(flat_k, 0, 0, kv, 0, tokens, {5, 1, 17});
    test::append_in_chunks(flat_v, 0, 0, kv, 0, tokens, {5, 1, 17});
    test::append_in_chunks(paged_k, 0, 0, kv, 0, tokens, {3, 16, 40});
    test::append_in_chunks(paged_v, 0, 0, kv, 0, tokens, {3, 16, 40});
    // A ring of sinks and a window, as SlidingWindowCache keeps it.
    const SlidingWindowCacheConfig ring_config{.num_layers = 1,
                                               .num_kv_heads = kv_heads,
                                               .head_dim = dim,
                                               .max_batch = 1,
                                               .window = 40,
                                               .num_sink_tokens = 3,
                                               .max_append_len = 8};
    SlidingWindowCache<K> ring_k(ring_config);
    SlidingWindowCache<V> ring_v(ring_config);
    test::append_in_chunks(ring_k, 0, 0, kv, 0, tokens, {8, 3, 1});
    test::append_in_chunks(ring_v, 0, 0, kv, 0, tokens, {8, 3, 1});
    const auto flat = mixed_view<K, V>(flat_k, flat_v, 0);
    const auto paged = mixed_view<K, V>(paged_k, paged_v, 0);
    REQUIRE(paged.num_segments() > 1);
    const auto paged_layout = mixed_layout_view<K, V>(paged_k, paged_v, 0);
    const auto ring = mixed_layout_view<K, V>(ring_k, ring_v, 0);
    for (std::size_t n : {1u, 6u}) {
      std::vector<float> q = test::normal_floats(rng, n * q_heads * dim);
      for (float& x : q) x *= 2.0f;  // a peakier softmax than N(0, 1) queries give
      const auto first = static_cast<position_t>(tokens - n);
      const AttentionOptions opts{.query_pos = first};
      const AttentionOptions windowed{.window = 40, .num_sink_tokens = 3, .query_pos = first};
      for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
        INFO(pair_name<TestType>() << ", head_dim " << dim << ", " << n << " queries, "
                                   << test::kernel_name(kernel) << " kernel");
        // The fast kernel adds in fp32 what the reference adds in double.
        const Tolerance tol{2e-6, 2e-5};
        const auto want = test::attend_slow(q, n, q_heads, flat, opts);
        test::require_close(test::attend_fast(q, n, q_heads, flat, opts, kernel), want, tol);
        test::require_close(test::attend_fast(q, n, q_heads, paged, opts, kernel), want, tol);
        const auto want_windowed = test::attend_slow(q, n, q_heads, flat, windowed);
        test::require_close(test::attend_fast(q, n, q_heads, flat, windowed, kernel), want_windowed,
                            tol);
        test::require_close(test::attend_fast(q, n, q_heads, ring, windowed, kernel),
                            test::attend_slow(q, n, q_heads, ring, windowed), tol);
        // Cache-relative positions: the sinks are scored from q turned back, over the K side.
        const Rope rope({}, dim);
        AttentionOptions relative = windowed;
        relative.positions = PositionMode::cache_relative;
        relative.rope = &rope;
        test::require_close(test::attend_fast(q, n, q_heads, ring, relative, kernel),
                            test::attend_slow(q, n, q_heads, ring, relative), tol);
        // Paged or not, the same rows take the same slots of each tile: the same bits.
        REQUIRE(test::same_bits(test::attend_fast(q, n, q_heads, paged, windowed, kernel),
                                test::attend_fast(q, n, q_heads, flat, windowed, kernel)));
        REQUIRE(test::same_bits(test::attend_fast(q, n, q_heads, paged_layout, opts, kernel),
                                test::attend_fast(q, n, q_heads, paged, opts, kernel)));
      }
    }
  }
}

// A view of KVFormats<T, T> runs T's kernels (canonical_format_t): no kernels of its own to
// compile, and its segments reach them unchanged.
TEMPLATE_TEST_CASE("KVFormats<T, T> computes exactly what T does", "[attention][mixed]", half,
                   qint8, fp8_e4m3) {
  static_assert(std::same_as<canonical_format_t<KVFormats<TestType, TestType>>, TestType>);
  static_assert(std::same_as<canonical_format_t<KVFormats<half, qint8>>, KVFormats<half, qint8>>);
  using T = TestType;
  auto rng = test::make_rng("mixed formats same pair");
  const std::size_t dim = 64, kv_heads = 2, q_heads = 4, tokens = 130;
  const test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
  StaticCache<T> cache({1, kv_heads, dim, 1, tokens});
  test::append_in_chunks(cache, 0, 0, kv, 0, tokens, {7, 64});
  const auto pair = mixed_view<T, T>(cache, cache, 0);
  const std::vector<float> q = test::normal_floats(rng, 3 * q_heads * dim);
  const AttentionOptions opts{.window = 50, .num_sink_tokens = 2, .query_pos = tokens - 3};
  for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
    INFO(dtype_name(dtype_of<T>) << ", " << test::kernel_name(kernel));
    REQUIRE(test::same_bits(test::attend_fast(q, 3, q_heads, pair, opts, kernel),
                            test::attend_fast(q, 3, q_heads, cache.view(0, 0), opts, kernel)));
  }
}

TEMPLATE_TEST_CASE(
    "K and V in different formats: inf and NaN reach exactly the queries that see "
    "them",
    "[attention][mixed]", (KVFormats<half, qint8>), (KVFormats<qint8, half>),
    (KVFormats<bfloat16, fp8_e4m3>)) {
  using K = key_format_t<TestType>;
  using V = value_format_t<TestType>;
  auto rng = test::make_rng("mixed formats nonfinite");
  const std::size_t dim = 32, kv_heads = 1, q_heads = 2, tokens = 100;
  for (bool in_v : {false, true}) {
    for (float bad : {INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
      test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
      const std::size_t poisoned = 20;  // token 20's K or V row holds one bad value
      (in_v ? kv.v : kv.k)[poisoned * dim + 7] = bad;
      StaticCache<K> keys({1, kv_heads, dim, 1, tokens});
      StaticCache<V> values({1, kv_heads, dim, 1, tokens});
      test::append_in_chunks(keys, 0, 0, kv, 0, tokens, {9});
      test::append_in_chunks(values, 0, 0, kv, 0, tokens, {9});
      const auto view = mixed_view<K, V>(keys, values, 0);
      const std::vector<float> q = test::normal_floats(rng, q_heads * dim);
      for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
        INFO(pair_name<TestType>() << ", " << (in_v ? "V" : "K") << " holds " << bad << ", "
                                   << test::kernel_name(kernel));
        // The last query sees token 20 without a window and not with a window of 50.
        const auto seen = test::attend_fast(q, 1, q_heads, view, {.query_pos = tokens - 1}, kernel);
        for (float x : seen) REQUIRE(std::isnan(x));
        const AttentionOptions windowed{.window = 50, .query_pos = tokens - 1};
        const auto unseen = test::attend_fast(q, 1, q_heads, view, windowed, kernel);
        for (float x : unseen) REQUIRE(std::isfinite(x));
        test::require_close(unseen, test::attend_slow(q, 1, q_heads, view, windowed), {2e-6, 2e-5});
      }
    }
  }
}

// The error each pair costs against fp32 attention, on the quantized test's data (decode, 8 query
// heads over 2 KV heads, N(0, 1) K/V, N(0, 4) queries): printed for the README, and bounded by the
// bounds of the same format on both sides (quantized_attention_test), which one full-precision
// side cannot make worse.
TEMPLATE_TEST_CASE("K and V in different formats: error against fp32 attention",
                   "[attention][mixed]", (KVFormats<half, qint8>), (KVFormats<half, fp8_e4m3>),
                   (KVFormats<qint8, half>), (KVFormats<fp8_e4m3, half>)) {
  using K = key_format_t<TestType>;
  using V = value_format_t<TestType>;
  using Quantized = std::conditional_t<QuantizedElement<K>, K, V>;
  auto rng = test::make_rng("mixed formats error");
  const std::size_t kv_heads = 2, q_heads = 8, dim = 128, tokens = 4096;
  const double rms_bound = std::same_as<Quantized, qint8> ? 0.05 : 0.25;
  const double max_bound = std::same_as<Quantized, qint8> ? 0.08 : 0.45;
  const test::TokenKV kv = test::random_kv(rng, tokens, kv_heads, dim);
  StaticCache<float> exact({1, kv_heads, dim, 1, tokens});
  StaticCache<K> keys({1, kv_heads, dim, 1, tokens});
  StaticCache<V> values({1, kv_heads, dim, 1, tokens});
  test::append_in_chunks(exact, 0, 0, kv, 0, tokens, {512});
  test::append_in_chunks(keys, 0, 0, kv, 0, tokens, {512});
  test::append_in_chunks(values, 0, 0, kv, 0, tokens, {512});
  std::vector<float> q = test::normal_floats(rng, q_heads * dim);
  for (float& x : q) x *= 2.0f;
  const AttentionOptions opts{.query_pos = static_cast<position_t>(tokens - 1)};
  const auto want =
      test::attend_fast(q, 1, q_heads, exact.view(0, 0), opts, cpu::Kernel::automatic);
  const auto got = test::attend_fast(q, 1, q_heads, mixed_view<K, V>(keys, values, 0), opts,
                                     cpu::Kernel::automatic);
  double diff2 = 0.0, want2 = 0.0, max_abs = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    max_abs = std::max(max_abs, std::fabs(d));
    diff2 += d * d;
    want2 += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  const double rms = std::sqrt(diff2 / want2);
  std::printf("%s, head_dim %zu, %zu tokens: max |error| %.3g, relative RMS error %.3g\n",
              pair_name<TestType>().c_str(), dim, tokens, max_abs, rms);
  INFO(pair_name<TestType>() << ": max " << max_abs << ", relative RMS " << rms);
  REQUIRE(rms <= rms_bound);
  REQUIRE(max_abs <= max_bound);
}
