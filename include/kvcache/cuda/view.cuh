// SPDX-License-Identifier: Apache-2.0
// Device views: one layer of a batch of sequences in device memory, described by the layout
// descriptor the host caches also use (KVLayout: contiguous, ring with sinks, paged) and the mask
// (KVMask), plus the element conversions device code needs (the quantized formats' codes and
// scales: core/format.hpp, whose functions run on the device too). Absolute positions, the present
// set [0, sink_end) and [recent_begin, length) per sequence, as the CPU views.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/layout.hpp"
#include "kvcache/core/mask.hpp"
#include "kvcache/cuda/runtime.cuh"

namespace kvcache::cuda {

/// How a view maps (sequence, KV head, absolute position) to memory (core/layout.hpp).
using Layout = LayoutKind;

/// One layer of a batch of sequences in device memory: the library's one layout descriptor
/// (KVLayout, core/layout.hpp) with device pointers. Built by DeviceCache::view(), or by hand for
/// K/V an engine keeps in its own buffers; kernels take it by value.
template <KVFormat T>
using DeviceKVView = KVLayout<T>;

/// The mask of an attention call, as the kernels read it (KVMask, core/mask.hpp; the sink scores
/// filled in by launch_sink_scores under cache_relative positions).
using DeviceMask = KVMask;

namespace detail {

/// Element <-> float on the device (to_f32 / from_f32), bit-exact with the CPU conversions (round
/// to nearest even).
template <Element T>
__device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, kvcache::half>) {
    return __half2float(__ushort_as_half(x.bits));
  } else {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
  }
}
template <Element T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T out;
    if constexpr (std::is_same_v<T, kvcache::half>) {
      out.bits = __half_as_ushort(__float2half_rn(x));
    } else {
      out.bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    return out;
  }
}

/// A stored K/V element as a float: the element itself, or a quantized code's value (the row's
/// scale applied apart, once per row).
template <KVElement T>
__device__ __forceinline__ float element_value(T x) {
  if constexpr (Element<T>) {
    return to_f32(x);
  } else {
    return decode(x);
  }
}

using kvcache::KeyRange;

}  // namespace detail
}  // namespace kvcache::cuda
