// SPDX-License-Identifier: Apache-2.0
// The two macros that let a plain .hpp function run in CUDA device code too (the element
// conversions, the quantizer, the layout descriptor's arithmetic), and the bit casts those
// functions use: std::bit_cast is a host function, so device code cannot call it.
#pragma once

#include <cstdint>

/// Marks a function callable from host code and from CUDA device code: __host__ __device__
/// under nvcc, nothing for a plain C++ compiler (for the few constexpr helpers that plain .hpp
/// headers share with the kernels).
#if defined(__CUDACC__)
#define KVCACHE_HOST_DEVICE __host__ __device__
#else
#define KVCACHE_HOST_DEVICE
#endif

/// As KVCACHE_HOST_DEVICE, for small functions the kernels call per key: forced inline in device
/// code, plain `inline` on the host.
#if defined(__CUDACC__)
#define KVCACHE_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define KVCACHE_HOST_DEVICE_INLINE inline
#endif

namespace kvcache::detail {

/// The bits of a float, and the float of some bits (std::bit_cast, usable in device code).
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr std::uint32_t float_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr float bits_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

}  // namespace kvcache::detail
