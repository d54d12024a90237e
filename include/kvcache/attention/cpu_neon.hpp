// SPDX-License-Identifier: Apache-2.0
// The AArch64 Advanced SIMD (NEON) vector traits of the fast CPU attention (4 lanes, 32
// registers) and the micro-kernels of cpu_simd_ops.inc instantiated over them (NeonOps). NEON is
// part of every AArch64 CPU, so there is nothing to detect and no target attribute.
#pragma once

#include "kvcache/attention/cpu_micro.hpp"
#include "kvcache/core/cpu_features.hpp"

#if KVCACHE_NEON_KERNELS

#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvcache::cpu::detail::neon {

/// The vector traits cpu_simd_ops.inc is written over, at 4 lanes.
struct Vec {
  using F = float32x4_t;
  using Flags = uint32x4_t;
  static constexpr std::size_t kLanes = 4;
  /// Four keys a q.k block: 16 accumulators for 4 rows + 4 key vectors + the q vector, of 32.
  static constexpr std::size_t kQkKeys = 4;
  /// 16 columns a p.V pass: 16 accumulators for 4 rows.
  static constexpr std::size_t kPvVectors = 4;

  static F zero() noexcept { return vdupq_n_f32(0.0f); }
  static F set1(float x) noexcept { return vdupq_n_f32(x); }
  static F loadu(const float* p) noexcept { return vld1q_f32(p); }
  static void storeu(float* p, F v) noexcept { vst1q_f32(p, v); }
  static F add(F a, F b) noexcept { return vaddq_f32(a, b); }
  static F sub(F a, F b) noexcept { return vsubq_f32(a, b); }
  static F mul(F a, F b) noexcept { return vmulq_f32(a, b); }
  static F max(F a, F b) noexcept { return vmaxq_f32(a, b); }
  static F fma(F a, F b, F c) noexcept { return vfmaq_f32(c, a, b); }
  static F fnma(F a, F b, F c) noexcept { return vfmsq_f32(c, a, b); }
  static F floor(F a) noexcept { return vrndmq_f32(a); }

  /// 4 consecutive elements as 4 floats (codes as code_value reads them).
  template <KVElement T>
  static F load(const T* p) noexcept {
    if constexpr (std::same_as<T, float>) {
      return vld1q_f32(p);
    } else if constexpr (std::same_as<T, half>) {
      return vcvt_f32_f16(
          vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))));
    } else if constexpr (std::same_as<T, bfloat16>) {
      return vreinterpretq_f32_u32(
          vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)), 16));
    } else {
      std::int32_t four = 0;  // four 8-bit codes
      std::memcpy(&four, p, sizeof four);
      const int16x4_t codes =
          vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four))));  // sign-extended
      if constexpr (std::same_as<T, qint8>) {
        return vcvtq_f32_s32(vmovl_s16(codes));
      } else {
        // fp8 e4m3: the half exactly 2^-8 of each code's value (see kFp8HalfMask), as on x86.
        const uint16x4_t bits = vand_u16(vreinterpret_u16_s16(vshl_n_s16(codes, kFp8HalfShift)),
                                         vdup_n_u16(kFp8HalfMask));
        return vcvt_f32_f16(vreinterpret_f16_u16(bits));
      }
    }
  }

  /// p[0..n) and `fill` in lanes n..3. @pre n < 4.
  static F load_tail(const float* p, std::size_t n, float fill) noexcept {
    float lanes[4] = {fill, fill, fill, fill};
    std::memcpy(lanes, p, n * sizeof(float));
    return vld1q_f32(lanes);
  }
  /// Stores lanes 0..n of v to p[0..n). @pre n < 4.
  static void store_tail(float* p, std::size_t n, F v) noexcept {
    float lanes[4];
    vst1q_f32(lanes, v);
    std::memcpy(p, lanes, n * sizeof(float));
  }

  /// 2^f for each lane (f integral, in 2^-126 .. 2^127 once exp_nonpositive has clamped it).
  static F exp2_int(F f) noexcept {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(f), vdupq_n_s32(127)), 23));
  }
  /// v where x >= bound (ordered: NaN lanes give 0), 0 elsewhere.
  static F zero_below(F v, F x, F bound) noexcept {
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), vcgeq_f32(x, bound)));
  }

  /// The sum of the 4 lanes, associated as (v0 + v1) + (v2 + v3).
  static float hsum(F v) noexcept {
    const float32x4_t pairs = vpaddq_f32(v, v);  // v0+v1, v2+v3, ..
    return vgetq_lane_f32(pairs, 0) + vgetq_lane_f32(pairs, 1);
  }
  static float reduce_max(F m) noexcept { return vmaxvq_f32(m); }

  static Flags no_flags() noexcept { return vdupq_n_u32(0); }
  /// flags with the lanes of v that are inf or NaN (every exponent bit set) added.
  static Flags flag_nonfinite(Flags flags, F v) noexcept {
    const uint32x4_t exp_bits = vdupq_n_u32(0x7f800000u);
    return vorrq_u32(flags, vceqq_u32(vandq_u32(vreinterpretq_u32_f32(v), exp_bits), exp_bits));
  }
  static bool any(Flags flags) noexcept { return vmaxvq_u32(flags) != 0; }

  /// s[r * stride + a] = the lane sum of acc[a][r] (associated as hsum, whatever R and J: four
  /// rows' sums at once by pairwise adds).
  template <std::size_t R, std::size_t J>
  static void store_dots(const F (&acc)[J][R], float* s, std::size_t stride) noexcept {
    if constexpr (R == 4) {
      for (std::size_t a = 0; a < J; ++a) {
        const float32x4_t sums = vpaddq_f32(vpaddq_f32(acc[a][0], acc[a][1]),
                                            vpaddq_f32(acc[a][2], acc[a][3]));  // lane r: row r
        s[a] = vgetq_lane_f32(sums, 0);
        s[stride + a] = vgetq_lane_f32(sums, 1);
        s[2 * stride + a] = vgetq_lane_f32(sums, 2);
        s[3 * stride + a] = vgetq_lane_f32(sums, 3);
      }
    } else {
      for (std::size_t a = 0; a < J; ++a) {
        for (std::size_t r = 0; r < R; ++r) s[r * stride + a] = hsum(acc[a][r]);
      }
    }
  }
};

#define KVCACHE_SIMD_TARGET
#include "kvcache/attention/cpu_simd_ops.inc"
#undef KVCACHE_SIMD_TARGET

}  // namespace kvcache::cpu::detail::neon

namespace kvcache::cpu::detail {
/// The NEON operation set of the tile loop (see cpu.hpp). @pre head_dim % 4 == 0.
template <KVFormat F>
using NeonOps = neon::Ops<F>;
}  // namespace kvcache::cpu::detail

#endif  // KVCACHE_NEON_KERNELS
