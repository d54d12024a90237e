// SPDX-License-Identifier: Apache-2.0
// The few <cmath> functions that the headers every translation unit parses use (attention options,
// the reference attention, RoPE, quantized appends), without <cmath> itself: with GCC 12 in C++20
// mode <cmath> (its special functions and overload sets) adds about a third of the front-end time
// of <memory> + <string> + <vector> by itself, more than any other standard header kvcache needs
// (tests/consumer/include_cost.sh). GCC and clang compile these builtins to what the std::
// functions compile to (an instruction, or the same libm call); other compilers, and nvcc, get
// <cmath>. The kernel bodies compiled once (cpu_sweep.hpp) include <cmath> themselves.
#pragma once

#include "kvcache/core/host_device.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define KVCACHE_DETAIL_MATH_BUILTINS 1
#else
#define KVCACHE_DETAIL_MATH_BUILTINS 0
#include <cmath>
#endif

namespace kvcache::detail::math {

#if KVCACHE_DETAIL_MATH_BUILTINS
[[nodiscard]] inline float sqrt(float x) noexcept { return __builtin_sqrtf(x); }
[[nodiscard]] inline double sqrt(double x) noexcept { return __builtin_sqrt(x); }
[[nodiscard]] inline double exp(double x) noexcept { return __builtin_exp(x); }
[[nodiscard]] inline double log(double x) noexcept { return __builtin_log(x); }
[[nodiscard]] inline float pow(float x, float y) noexcept { return __builtin_powf(x, y); }
[[nodiscard]] inline double pow(double x, double y) noexcept { return __builtin_pow(x, y); }
[[nodiscard]] inline double tanh(double x) noexcept { return __builtin_tanh(x); }
[[nodiscard]] inline double cos(double x) noexcept { return __builtin_cos(x); }
[[nodiscard]] inline double sin(double x) noexcept { return __builtin_sin(x); }
[[nodiscard]] inline double floor(double x) noexcept { return __builtin_floor(x); }
[[nodiscard]] inline double ceil(double x) noexcept { return __builtin_ceil(x); }
[[nodiscard]] inline bool isfinite(float x) noexcept { return __builtin_isfinite(x); }
[[nodiscard]] inline bool isfinite(double x) noexcept { return __builtin_isfinite(x); }
/// x rounded to an integer in the current rounding mode (to nearest even by default).
[[nodiscard]] inline float nearbyint(float x) noexcept { return __builtin_nearbyintf(x); }
#else
[[nodiscard]] inline float sqrt(float x) noexcept { return std::sqrt(x); }
[[nodiscard]] inline double sqrt(double x) noexcept { return std::sqrt(x); }
[[nodiscard]] inline double exp(double x) noexcept { return std::exp(x); }
[[nodiscard]] inline double log(double x) noexcept { return std::log(x); }
[[nodiscard]] inline float pow(float x, float y) noexcept { return std::pow(x, y); }
[[nodiscard]] inline double pow(double x, double y) noexcept { return std::pow(x, y); }
[[nodiscard]] inline double tanh(double x) noexcept { return std::tanh(x); }
[[nodiscard]] inline double cos(double x) noexcept { return std::cos(x); }
[[nodiscard]] inline double sin(double x) noexcept { return std::sin(x); }
[[nodiscard]] inline double floor(double x) noexcept { return std::floor(x); }
[[nodiscard]] inline double ceil(double x) noexcept { return std::ceil(x); }
[[nodiscard]] inline bool isfinite(float x) noexcept { return std::isfinite(x); }
[[nodiscard]] inline bool isfinite(double x) noexcept { return std::isfinite(x); }
/// x rounded to an integer in the current rounding mode (to nearest even by default); also in
/// CUDA device code.
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE float nearbyint(float x) noexcept { return nearbyintf(x); }
#endif

}  // namespace kvcache::detail::math
