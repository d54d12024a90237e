// SPDX-License-Identifier: Apache-2.0
// AVX-512 micro-kernels of the fast CPU attention: the operation set of cpu_avx2.hpp at 16 lanes
// with 32 registers (four keys per q.k block, 64 columns per p.V pass, masked tails). Chosen at
// run time on CPUs with AVX-512F, where the AVX2 kernel is bound by its FMA throughput.
#pragma once

#include "kvcache/attention/cpu_avx2.hpp"

#if KVCACHE_X86_DISPATCH

#include <cpuid.h>
#include <immintrin.h>

#include <cstddef>
#include <limits>

#define KVCACHE_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// nvcc parses these host-only kernels too and reports GCC's unroll pragmas as unknown (1675).
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

// GCC 12's AVX-512 intrinsics pass a self-initialised _mm512_undefined_*() as the merge source of
// unmasked operations, which -Wuninitialized reports once they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvcache::cpu::detail {

/// True when the running CPU (and OS) supports AVX-512F besides AVX2+FMA+F16C. Read once with
/// CPUID, as cpu_has_avx2_fma_f16c is.
[[nodiscard]] inline bool cpu_has_avx512f() noexcept {
  static const bool supported = [] {
    if (!kvcache::detail::cpu_has_avx2_fma_f16c()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if (((b >> 16) & 1u) == 0) return false;  // AVX-512F
    // the OS saves XMM, YMM, the opmask registers and all of ZMM
    return (kvcache::detail::read_xcr0() & 0xE6u) == 0xE6u;
  }();
  return supported;
}

/// Loads 16 consecutive elements as 16 floats (codes as code_value reads them).
template <KVElement T>
KVCACHE_TARGET_AVX512 inline __m512 load16(const T* p) noexcept {
  if constexpr (std::same_as<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::same_as<T, half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::same_as<T, qint8>) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (std::same_as<T, fp8_e4m3>) {
    const __m256i codes =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(codes, 7),
                                            _mm256_set1_epi16(static_cast<short>(0xbfff))));
  } else {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

/// v[i] + v[i + 8] for i < 8: a 16-lane sum folded to 8 lanes for hsum to finish.
KVCACHE_TARGET_AVX512 inline __m256 fold16(__m512 v) noexcept {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/// Lane i of the result = the sum of the 16 lanes of v[i], for 16 vectors at once: a transposing
/// tree of 15 adds (of lane shuffles) instead of 16 separate reductions. Each sum is associated the
/// same way whatever the other 15 vectors hold: within each 128-bit block (l0 + l2) + (l1 + l3),
/// then the four blocks as (b0 + b1) + (b2 + b3).
KVCACHE_TARGET_AVX512 inline __m512 sum16x16(const __m512* v) noexcept {
  __m512 pairs[8];  // block k of pairs[i]: l0 + l2, l1 + l3 of v[2i] and v[2i + 1], interleaved
#pragma GCC unroll 8
  for (std::size_t i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[4];  // block k of quads[i]: the block-k sums of v[4i .. 4i + 3]
#pragma GCC unroll 4
  for (std::size_t i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Blocks (0 + 1) and (2 + 3): halves[0] holds v[0..7], halves[1] v[8..15], a pair of blocks each.
  __m512 halves[2];
#pragma GCC unroll 2
  for (std::size_t i = 0; i < 2; ++i) {
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/// exp8_nonpositive at 16 lanes, with the same operations, so each lane's result is the same.
KVCACHE_TARGET_AVX512 inline __m512 exp16_nonpositive(__m512 x) noexcept {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_floor_ps(fx);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i pow2n =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n)));
}

/// The mask of the first n < 16 lanes.
KVCACHE_TARGET_AVX512 inline __mmask16 first_lanes(std::size_t n) noexcept {
  return static_cast<__mmask16>((1u << n) - 1u);
}

/// s[r * stride + a] = q_r . k[a] for R query rows and J key rows (as qk_block, 16 lanes).
template <KVElement T, std::size_t R, std::size_t J>
KVCACHE_TARGET_AVX512 inline void qk_block16(const float* q, const T* const* k, std::size_t d,
                                             float* s, std::size_t stride) noexcept {
  __m512 acc[J][R];
#pragma GCC unroll 4
  for (std::size_t a = 0; a < J; ++a) {
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) acc[a][r] = _mm512_setzero_ps();
  }
  for (std::size_t x = 0; x < d; x += 16) {
    __m512 kx[J];
#pragma GCC unroll 4
    for (std::size_t a = 0; a < J; ++a) kx[a] = load16(k[a] + x);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * d + x);
#pragma GCC unroll 4
      for (std::size_t a = 0; a < J; ++a) acc[a][r] = _mm512_fmadd_ps(qv, kx[a], acc[a][r]);
    }
  }
  // Row r's scores are lanes 4r .. 4r + 3 of the sums; blocks shorter than 4 x 4 add zeros.
  __m512 all[16];
#pragma GCC unroll 4
  for (std::size_t r = 0; r < 4; ++r) {
#pragma GCC unroll 4
    for (std::size_t a = 0; a < 4; ++a)
      all[4 * r + a] = r < R && a < J ? acc[a][r] : _mm512_setzero_ps();
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum16x16(all));
#pragma GCC unroll 4
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t a = 0; a < J; ++a) s[r * stride + a] = sums[4 * r + a];
  }
}

/// qk_rows at 16 lanes: four keys a block (16 accumulators for 4 rows, half the register file),
/// then the remainder as one block; K prefetched into L2 over the blocks.
template <KVElement T, std::size_t R>
KVCACHE_TARGET_AVX512 void qk_rows16(const float* q, const T* const* k, std::size_t nk,
                                     std::size_t d, float* s, std::size_t stride,
                                     FetchLines ahead) noexcept {
  const std::size_t blocks = nk / 4;
  const std::size_t lines_per_block = ahead.per_slice(blocks);
  std::size_t j = 0;
  for (std::size_t b = 0; b < blocks; ++b, j += 4) {
    ahead.fetch(lines_per_block);
    qk_block16<T, R, 4>(q, k + j, d, s + j, stride);
  }
  ahead.fetch_rest();
  switch (nk - j) {
    case 3:
      return qk_block16<T, R, 3>(q, k + j, d, s + j, stride);
    case 2:
      return qk_block16<T, R, 2>(q, k + j, d, s + j, stride);
    case 1:
      return qk_block16<T, R, 1>(q, k + j, d, s + j, stride);
    default:
      return;
  }
}

/// acc_r[x0, x0 + 16C) += sum_j p[r * stride + j] * v[j][x0, x0 + 16C) for R rows: R x C
/// accumulators held across the whole tile. The V side of `ahead` is prefetched one line per value
/// row visited, as in pv_rows.
template <KVElement T, std::size_t R, std::size_t C>
KVCACHE_TARGET_AVX512 inline void pv_columns16(const float* p, std::size_t stride,
                                               const T* const* v, std::size_t nk, std::size_t d,
                                               std::size_t x0, float* acc,
                                               FetchLines& ahead) noexcept {
  __m512 a[R][C];
#pragma GCC unroll 4
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) a[r][c] = _mm512_loadu_ps(acc + r * d + x0 + 16 * c);
  }
  for (std::size_t j = 0; j < nk; ++j) {
    ahead.fetch(1);
    __m512 vx[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) vx[c] = load16(v[j] + x0 + 16 * c);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * stride + j]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pr, vx[c], a[r][c]);
    }
  }
#pragma GCC unroll 4
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * d + x0 + 16 * c, a[r][c]);
  }
}

/// pv_rows at 16 lanes: 64 columns a pass, then the last 16, 32 or 48.
template <KVElement T, std::size_t R>
KVCACHE_TARGET_AVX512 void pv_rows16(const float* p, std::size_t stride, const T* const* v,
                                     std::size_t nk, std::size_t d, float* acc,
                                     FetchLines ahead) noexcept {
  std::size_t x = 0;
  for (; x + 64 <= d; x += 64) pv_columns16<T, R, 4>(p, stride, v, nk, d, x, acc, ahead);
  switch ((d - x) / 16) {
    case 3:
      pv_columns16<T, R, 3>(p, stride, v, nk, d, x, acc, ahead);
      break;
    case 2:
      pv_columns16<T, R, 2>(p, stride, v, nk, d, x, acc, ahead);
      break;
    case 1:
      pv_columns16<T, R, 1>(p, stride, v, nk, d, x, acc, ahead);
      break;
    default:
      break;
  }
  ahead.fetch_rest();
}

/// The AVX-512 operation set of the tile loop (see cpu.hpp). @pre head_dim % 16 == 0.
template <KVElement T>
struct Avx512Ops {
  KVCACHE_TARGET_AVX512 static void qk(const float* q, std::size_t rows, const T* const* k,
                                       std::size_t nk, std::size_t d, float* s, std::size_t stride,
                                       const Prefetch* ahead, std::size_t num_ahead) noexcept {
    const FetchLines lines(ahead, num_ahead, false);
    with_rows(rows,
              [&](auto r) { qk_rows16<T, decltype(r)::value>(q, k, nk, d, s, stride, lines); });
  }
  KVCACHE_TARGET_AVX512 static void pv(const float* p, std::size_t stride, std::size_t rows,
                                       const T* const* v, std::size_t nk, std::size_t d, float* acc,
                                       const Prefetch* ahead, std::size_t num_ahead) noexcept {
    const FetchLines lines(ahead, num_ahead, true);
    with_rows(rows,
              [&](auto r) { pv_rows16<T, decltype(r)::value>(p, stride, v, nk, d, acc, lines); });
  }
  /// The largest of x[0..n), n >= 1.
  KVCACHE_TARGET_AVX512 static float max(const float* x, std::size_t n) noexcept {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 m = neg_inf;
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg_inf, first_lanes(n - i), x + i));
    return _mm512_reduce_max_ps(m);
  }
  /// max(x, n), and sets `found` when some x[i] is inf or NaN: the same pass, the same max.
  KVCACHE_TARGET_AVX512 static float max_nonfinite(const float* x, std::size_t n,
                                                   bool& found) noexcept {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i exp_bits = _mm512_set1_epi32(0x7f800000);
    __m512 m = neg_inf;
    __mmask16 any = 0;
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      m = _mm512_max_ps(m, v);
      any = static_cast<__mmask16>(
          any |
          _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exp_bits), exp_bits));
    }
    if (i < n) {  // lanes past n read -inf for the max and are left out of the check
      const __mmask16 tail = first_lanes(n - i);
      const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail, x + i);
      m = _mm512_max_ps(m, v);
      any = static_cast<__mmask16>(
          any | _mm512_mask_cmpeq_epi32_mask(
                    tail, _mm512_and_si512(_mm512_castps_si512(v), exp_bits), exp_bits));
    }
    found = found || any != 0;
    return _mm512_reduce_max_ps(m);
  }
  /// True when some x[i] is inf or NaN (every exponent bit set).
  KVCACHE_TARGET_AVX512 static bool nonfinite(const float* x, std::size_t n) noexcept {
    const __m512i exp_bits = _mm512_set1_epi32(0x7f800000);
    __mmask16 any = 0;
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512i e = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)), exp_bits);
      any = static_cast<__mmask16>(any | _mm512_cmpeq_epi32_mask(e, exp_bits));
    }
    if (i < n) {  // lanes past n read 0, which is finite
      const __m512i e = _mm512_and_si512(
          _mm512_castps_si512(_mm512_maskz_loadu_ps(first_lanes(n - i), x + i)), exp_bits);
      any = static_cast<__mmask16>(any | _mm512_cmpeq_epi32_mask(e, exp_bits));
    }
    return any != 0;
  }
  /// x[i] = exp(x[i] - shift) for x[i] <= shift (-inf gives 0); returns the sum of the results.
  KVCACHE_TARGET_AVX512 static float exp_sum(float* x, std::size_t n, float shift) noexcept {
    const __m512 sv = _mm512_set1_ps(shift);
    __m512 sum = _mm512_setzero_ps();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + i), sv));
      _mm512_storeu_ps(x + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {  // the tail: lanes past n read -inf, which gives 0, and are not stored
      const __mmask16 tail = first_lanes(n - i);
      const __m512 xs = _mm512_mask_loadu_ps(
          _mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, x + i);
      const __m512 e = exp16_nonpositive(_mm512_sub_ps(xs, sv));
      _mm512_mask_storeu_ps(x + i, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    return hsum(fold16(sum));
  }
  KVCACHE_TARGET_AVX512 static void scale(float* x, std::size_t n, float c) noexcept {
    const __m512 cv = _mm512_set1_ps(c);
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), cv));
    if (i < n) {
      const __mmask16 tail = first_lanes(n - i);
      _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), cv));
    }
  }
};

}  // namespace kvcache::cpu::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#undef KVCACHE_TARGET_AVX512

#endif  // KVCACHE_X86_DISPATCH
