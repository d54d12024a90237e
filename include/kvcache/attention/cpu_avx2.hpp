// SPDX-License-Identifier: Apache-2.0
// The AVX2 + FMA + F16C vector traits of the fast CPU attention (8 lanes, 16 registers) and the
// micro-kernels of cpu_simd_ops.inc instantiated over them (Avx2Ops). fp16/bf16/int8/fp8 rows are
// converted in registers. Compiled with per-function target attributes and chosen at run time,
// so no -mavx2 flag is needed.
#pragma once

#include "kvcache/attention/cpu_micro.hpp"

#if KVCACHE_X86_DISPATCH

#include <immintrin.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#define KVCACHE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

// nvcc parses these host-only kernels too and reports GCC's unroll pragmas as unknown (1675).
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

namespace kvcache::cpu::detail::avx2 {

/// The vector traits cpu_simd_ops.inc is written over, at 8 lanes.
struct Vec {
  using F = __m256;
  using Flags = __m256i;
  static constexpr std::size_t kLanes = 8;
  /// Three keys a q.k block: 12 accumulators for 4 rows + 3 key vectors + the q vector fill the
  /// 16 registers.
  static constexpr std::size_t kQkKeys = 3;
  /// 16 columns a p.V pass: 8 accumulators for 4 rows.
  static constexpr std::size_t kPvVectors = 2;

  KVCACHE_TARGET_AVX2 static F zero() noexcept { return _mm256_setzero_ps(); }
  KVCACHE_TARGET_AVX2 static F set1(float x) noexcept { return _mm256_set1_ps(x); }
  KVCACHE_TARGET_AVX2 static F loadu(const float* p) noexcept { return _mm256_loadu_ps(p); }
  KVCACHE_TARGET_AVX2 static void storeu(float* p, F v) noexcept { _mm256_storeu_ps(p, v); }
  KVCACHE_TARGET_AVX2 static F add(F a, F b) noexcept { return _mm256_add_ps(a, b); }
  KVCACHE_TARGET_AVX2 static F sub(F a, F b) noexcept { return _mm256_sub_ps(a, b); }
  KVCACHE_TARGET_AVX2 static F mul(F a, F b) noexcept { return _mm256_mul_ps(a, b); }
  KVCACHE_TARGET_AVX2 static F max(F a, F b) noexcept { return _mm256_max_ps(a, b); }
  KVCACHE_TARGET_AVX2 static F fma(F a, F b, F c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  KVCACHE_TARGET_AVX2 static F fnma(F a, F b, F c) noexcept { return _mm256_fnmadd_ps(a, b, c); }
  KVCACHE_TARGET_AVX2 static F floor(F a) noexcept { return _mm256_floor_ps(a); }

  /// The 8 halves exactly 2^-8 of 8 fp8 e4m3 codes (sign-extended to 16 bits; see kFp8HalfMask).
  KVCACHE_TARGET_AVX2 static __m128i e4m3_as_half(__m128i codes16) noexcept {
    return _mm_and_si128(_mm_slli_epi16(codes16, kFp8HalfShift),
                         _mm_set1_epi16(static_cast<short>(kFp8HalfMask)));
  }

  /// 8 consecutive elements as 8 floats (codes as code_value reads them).
  template <KVElement T>
  KVCACHE_TARGET_AVX2 static F load(const T* p) noexcept {
    if constexpr (std::same_as<T, float>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::same_as<T, half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else if constexpr (std::same_as<T, qint8>) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else if constexpr (std::same_as<T, fp8_e4m3>) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return _mm256_cvtph_ps(e4m3_as_half(_mm_cvtepi8_epi16(codes)));
    } else {
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
  }

  /// p[0..n) and `fill` in lanes n..7. @pre n < 8.
  KVCACHE_TARGET_AVX2 static F load_tail(const float* p, std::size_t n, float fill) noexcept {
    alignas(32) float lanes[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
    std::memcpy(lanes, p, n * sizeof(float));
    return _mm256_load_ps(lanes);
  }
  /// Stores lanes 0..n of v to p[0..n). @pre n < 8.
  KVCACHE_TARGET_AVX2 static void store_tail(float* p, std::size_t n, F v) noexcept {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::memcpy(p, lanes, n * sizeof(float));
  }

  /// 2^f for each lane (f integral, in 2^-126 .. 2^127 once exp_nonpositive has clamped it).
  KVCACHE_TARGET_AVX2 static F exp2_int(F f) noexcept {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(f), _mm256_set1_epi32(127)), 23));
  }
  /// v where x >= bound (ordered: NaN lanes give 0), 0 elsewhere.
  KVCACHE_TARGET_AVX2 static F zero_below(F v, F x, F bound) noexcept {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, bound, _CMP_GE_OQ));
  }

  /// The sum of the 8 lanes, associated as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)):
  /// exactly as sum4x8, so a dot product rounds the same whichever path computes it.
  KVCACHE_TARGET_AVX2 static float hsum(F v) noexcept {
    const __m256 pairs = _mm256_hadd_ps(v, v);          // v0+v1, v2+v3, .. | v4+v5, v6+v7, ..
    const __m256 quads = _mm256_hadd_ps(pairs, pairs);  // (v0+v1)+(v2+v3) | (v4+v5)+(v6+v7)
    return _mm_cvtss_f32(
        _mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
  }
  /// Lane r of the result = the sum of the 8 lanes of a[r], r < 4, associated as hsum does.
  KVCACHE_TARGET_AVX2 static __m128 sum4x8(F a0, F a1, F a2, F a3) noexcept {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  KVCACHE_TARGET_AVX2 static float reduce_max(F m) noexcept {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }

  KVCACHE_TARGET_AVX2 static Flags no_flags() noexcept { return _mm256_setzero_si256(); }
  /// flags with the lanes of v that are inf or NaN (every exponent bit set) added.
  KVCACHE_TARGET_AVX2 static Flags flag_nonfinite(Flags flags, F v) noexcept {
    const __m256i exp_bits = _mm256_set1_epi32(0x7f800000);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exp_bits);
    return _mm256_or_si256(flags, _mm256_cmpeq_epi32(e, exp_bits));
  }
  KVCACHE_TARGET_AVX2 static bool any(Flags flags) noexcept {
    return _mm256_testz_si256(flags, flags) == 0;
  }

  /// s[r * stride + a] = the lane sum of acc[a][r] (associated as hsum, whatever R and J).
  template <std::size_t R, std::size_t J>
  KVCACHE_TARGET_AVX2 static void store_dots(const F (&acc)[J][R], float* s,
                                             std::size_t stride) noexcept {
    if constexpr (R == 4) {
#pragma GCC unroll 4
      for (std::size_t a = 0; a < J; ++a) {
        const __m128 sums = sum4x8(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);  // lane r: row r
        s[a] = _mm_cvtss_f32(sums);
        s[stride + a] = _mm_cvtss_f32(_mm_movehdup_ps(sums));
        s[2 * stride + a] = _mm_cvtss_f32(_mm_movehl_ps(sums, sums));
        s[3 * stride + a] = _mm_cvtss_f32(_mm_shuffle_ps(sums, sums, 3));
      }
    } else {
#pragma GCC unroll 4
      for (std::size_t a = 0; a < J; ++a) {
#pragma GCC unroll 4
        for (std::size_t r = 0; r < R; ++r) s[r * stride + a] = hsum(acc[a][r]);
      }
    }
  }
};

#define KVCACHE_SIMD_TARGET KVCACHE_TARGET_AVX2
#include "kvcache/attention/cpu_simd_ops.inc"
#undef KVCACHE_SIMD_TARGET

}  // namespace kvcache::cpu::detail::avx2

namespace kvcache::cpu::detail {
/// The AVX2 operation set of the tile loop (see cpu.hpp). @pre head_dim % 8 == 0.
template <KVFormat F>
using Avx2Ops = avx2::Ops<F>;
}  // namespace kvcache::cpu::detail

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#undef KVCACHE_TARGET_AVX2

#endif  // KVCACHE_X86_DISPATCH
