// SPDX-License-Identifier: Apache-2.0
// The AVX-512F vector traits of the fast CPU attention (16 lanes, 32 registers: four keys per q.k
// block, 64 columns per p.V pass, masked tails) and the micro-kernels of cpu_simd_ops.inc
// instantiated over them (Avx512Ops). Chosen at run time on CPUs with AVX-512F, where the AVX2
// kernel is bound by its FMA throughput.
#pragma once

#include "kvcache/attention/cpu_avx2.hpp"

#if KVCACHE_X86_DISPATCH

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

namespace kvcache::cpu::detail::avx512 {

/// The vector traits cpu_simd_ops.inc is written over, at 16 lanes with masked tails.
struct Vec {
  using F = __m512;
  using Flags = __mmask16;
  static constexpr std::size_t kLanes = 16;
  /// Four keys a q.k block: 16 accumulators for 4 rows, half the register file.
  static constexpr std::size_t kQkKeys = 4;
  /// 64 columns a p.V pass: 16 accumulators for 4 rows.
  static constexpr std::size_t kPvVectors = 4;

  KVCACHE_TARGET_AVX512 static F zero() noexcept { return _mm512_setzero_ps(); }
  KVCACHE_TARGET_AVX512 static F set1(float x) noexcept { return _mm512_set1_ps(x); }
  KVCACHE_TARGET_AVX512 static F loadu(const float* p) noexcept { return _mm512_loadu_ps(p); }
  KVCACHE_TARGET_AVX512 static void storeu(float* p, F v) noexcept { _mm512_storeu_ps(p, v); }
  KVCACHE_TARGET_AVX512 static F add(F a, F b) noexcept { return _mm512_add_ps(a, b); }
  KVCACHE_TARGET_AVX512 static F sub(F a, F b) noexcept { return _mm512_sub_ps(a, b); }
  KVCACHE_TARGET_AVX512 static F mul(F a, F b) noexcept { return _mm512_mul_ps(a, b); }
  KVCACHE_TARGET_AVX512 static F max(F a, F b) noexcept { return _mm512_max_ps(a, b); }
  KVCACHE_TARGET_AVX512 static F fma(F a, F b, F c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  KVCACHE_TARGET_AVX512 static F fnma(F a, F b, F c) noexcept { return _mm512_fnmadd_ps(a, b, c); }
  KVCACHE_TARGET_AVX512 static F floor(F a) noexcept { return _mm512_floor_ps(a); }

  /// 16 consecutive elements as 16 floats (codes as code_value reads them).
  template <KVElement T>
  KVCACHE_TARGET_AVX512 static F load(const T* p) noexcept {
    if constexpr (std::same_as<T, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::same_as<T, half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else if constexpr (std::same_as<T, qint8>) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else if constexpr (std::same_as<T, fp8_e4m3>) {
      // as avx2::Vec::e4m3_as_half, 16 codes at a time
      const __m256i codes =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(codes, kFp8HalfShift),
                                              _mm256_set1_epi16(static_cast<short>(kFp8HalfMask))));
    } else {
      const __m512i wide =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
  }

  /// The mask of the first n < 16 lanes.
  KVCACHE_TARGET_AVX512 static __mmask16 first_lanes(std::size_t n) noexcept {
    return static_cast<__mmask16>((1u << n) - 1u);
  }
  /// p[0..n) and `fill` in lanes n..15 (nothing past p + n is read). @pre n < 16.
  KVCACHE_TARGET_AVX512 static F load_tail(const float* p, std::size_t n, float fill) noexcept {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p);
  }
  /// Stores lanes 0..n of v to p[0..n). @pre n < 16.
  KVCACHE_TARGET_AVX512 static void store_tail(float* p, std::size_t n, F v) noexcept {
    _mm512_mask_storeu_ps(p, first_lanes(n), v);
  }

  /// 2^f for each lane (f integral, in 2^-126 .. 2^127 once exp_nonpositive has clamped it).
  KVCACHE_TARGET_AVX512 static F exp2_int(F f) noexcept {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(f), _mm512_set1_epi32(127)), 23));
  }
  /// v where x >= bound (ordered: NaN lanes give 0), 0 elsewhere.
  KVCACHE_TARGET_AVX512 static F zero_below(F v, F x, F bound) noexcept {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, bound, _CMP_GE_OQ), v);
  }

  /// The sum of the 16 lanes: (v[i] + v[i + 8]) for i < 8, then as avx2::Vec::hsum.
  KVCACHE_TARGET_AVX512 static float hsum(F v) noexcept {
    return avx2::Vec::hsum(
        _mm256_add_ps(_mm512_castps512_ps256(v),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  KVCACHE_TARGET_AVX512 static float reduce_max(F m) noexcept { return _mm512_reduce_max_ps(m); }

  KVCACHE_TARGET_AVX512 static Flags no_flags() noexcept { return 0; }
  /// flags with the lanes of v that are inf or NaN (every exponent bit set) added.
  KVCACHE_TARGET_AVX512 static Flags flag_nonfinite(Flags flags, F v) noexcept {
    const __m512i exp_bits = _mm512_set1_epi32(0x7f800000);
    return static_cast<__mmask16>(
        flags |
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exp_bits), exp_bits));
  }
  KVCACHE_TARGET_AVX512 static bool any(Flags flags) noexcept { return flags != 0; }

  /// Lane i of the result = the sum of the 16 lanes of v[i], for 16 vectors at once: a
  /// transposing tree of 15 adds (of lane shuffles) instead of 16 separate reductions. Each sum is
  /// associated the same way whatever the other 15 vectors hold: within each 128-bit block
  /// (l0 + l2) + (l1 + l3), then the four blocks as (b0 + b1) + (b2 + b3).
  KVCACHE_TARGET_AVX512 static F sum16x16(const F* v) noexcept {
    F pairs[8];  // block k of pairs[i]: l0 + l2, l1 + l3 of v[2i] and v[2i + 1], interleaved
#pragma GCC unroll 8
    for (std::size_t i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                               _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    F quads[4];  // block k of quads[i]: the block-k sums of v[4i .. 4i + 3]
#pragma GCC unroll 4
    for (std::size_t i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                               _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // Blocks (0 + 1) and (2 + 3): halves[0] holds v[0..7], halves[1] v[8..15], a pair of blocks
    // each.
    F halves[2];
#pragma GCC unroll 2
    for (std::size_t i = 0; i < 2; ++i) {
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
  }

  /// s[r * stride + a] = the lane sum of acc[a][r], all of a block's sums in one sum16x16 (row
  /// r's in lanes 4r .. 4r + 3; a block smaller than 4 x 4 adds zeros).
  template <std::size_t R, std::size_t J>
  KVCACHE_TARGET_AVX512 static void store_dots(const F (&acc)[J][R], float* s,
                                               std::size_t stride) noexcept {
    static_assert(R <= 4 && J <= 4);
    F all[16];
#pragma GCC unroll 4
    for (std::size_t r = 0; r < 4; ++r) {
#pragma GCC unroll 4
      for (std::size_t a = 0; a < 4; ++a) {
        all[4 * r + a] = r < R && a < J ? acc[a][r] : _mm512_setzero_ps();
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum16x16(all));
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t a = 0; a < J; ++a) s[r * stride + a] = sums[4 * r + a];
    }
  }
};

#define KVCACHE_SIMD_TARGET KVCACHE_TARGET_AVX512
#include "kvcache/attention/cpu_simd_ops.inc"
#undef KVCACHE_SIMD_TARGET

}  // namespace kvcache::cpu::detail::avx512

namespace kvcache::cpu::detail {
/// The AVX-512 operation set of the tile loop (see cpu.hpp). @pre head_dim % 16 == 0.
template <KVFormat F>
using Avx512Ops = avx512::Ops<F>;
}  // namespace kvcache::cpu::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#undef KVCACHE_TARGET_AVX512

#endif  // KVCACHE_X86_DISPATCH
