// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for cuda_fp16.h: the few __half functions kvcache's kernels use, bit-exact
// (round to nearest even) through kvcache's own conversions.
#pragma once
#include "kvcache/core/dtype.hpp"
#include "kvemu.hpp"

struct __half {
  unsigned short bits;
};
struct alignas(4) __half2 {
  __half x, y;
};
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) { return kvcache::half::to_float(h.bits); }
inline __half __float2half_rn(float f) { return {kvcache::half::from_float_bits(f)}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
