// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for cuda_bf16.h: the __nv_bfloat16 functions kvcache's kernels use, bit-exact
// (round to nearest even) through kvcache's own conversions.
#pragma once
#include "kvcache/core/dtype.hpp"
#include "kvemu.hpp"

struct __nv_bfloat16 {
  unsigned short bits;
};
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline float __bfloat162float(__nv_bfloat16 h) { return kvcache::bfloat16::to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return {kvcache::bfloat16::from_float_bits(f)};
}
