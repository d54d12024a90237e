// SPDX-License-Identifier: Apache-2.0
// What the running CPU can do, for the run-time choice of the SIMD paths: which instruction-set
// families this build can dispatch to (KVCACHE_X86_DISPATCH, KVCACHE_NEON_KERNELS) and, on x86-64,
// CPUID + XGETBV checks read once per process. Cheap to include: no intrinsic headers (only
// <cpuid.h>, a few macros); the code that uses the instructions lives in the kernel headers.
#pragma once

#include <cstdint>

/// 1 where the x86-64 SIMD paths (AVX2, AVX-512, F16C) are compiled, with per-function target
/// attributes, and chosen at run time; 0 elsewhere.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define KVCACHE_X86_DISPATCH 1
#else
#define KVCACHE_X86_DISPATCH 0
#endif

/// 1 where the AArch64 NEON attention kernel is compiled (every AArch64 CPU has NEON); 0 elsewhere.
#if defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
#define KVCACHE_NEON_KERNELS 1
#else
#define KVCACHE_NEON_KERNELS 0
#endif

#if KVCACHE_X86_DISPATCH
namespace kvcache::detail {

/// XCR0: which register state the OS saves on a context switch. @pre CPUID reports OSXSAVE.
[[nodiscard]] inline std::uint64_t read_xcr0() noexcept {
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (std::uint64_t{hi} << 32) | lo;
}

/// True when the running CPU (and OS) supports AVX2, FMA and F16C, the fast CPU paths'
/// requirement. Read once with CPUID and cached in a function-local constant: a fact about the
/// machine, not mutable state.
[[nodiscard]] inline bool cpu_has_avx2_fma_f16c() noexcept {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool fma = (c >> 12) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
    const bool f16c = (c >> 29) & 1u;
    if (!(fma && osxsave && avx && f16c)) return false;
    if ((read_xcr0() & 0x6u) != 0x6u) return false;  // the OS saves XMM and YMM state
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    return ((b >> 5) & 1u) != 0;  // AVX2
  }();
  return supported;
}

/// True when the running CPU (and OS) supports AVX-512F besides AVX2+FMA+F16C. Read once, as
/// cpu_has_avx2_fma_f16c is.
[[nodiscard]] inline bool cpu_has_avx512f() noexcept {
  static const bool supported = [] {
    if (!cpu_has_avx2_fma_f16c()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if (((b >> 16) & 1u) == 0) return false;  // AVX-512F
    // the OS saves XMM, YMM, the opmask registers and all of ZMM
    return (read_xcr0() & 0xE6u) == 0xE6u;
  }();
  return supported;
}

}  // namespace kvcache::detail
#endif
