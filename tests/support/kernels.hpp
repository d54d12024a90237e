// SPDX-License-Identifier: Apache-2.0
// The CPU attention kernels a test can run on this machine, so that each property is checked on
// every SIMD path the CPU has, not only on the one Kernel::automatic picks.
#pragma once

#include <cstddef>
#include <vector>

#include "kvcache/kvcache.hpp"

namespace kvcache::test {

/// portable, then avx2 and avx512, or neon, where this CPU and head_dim allow them.
inline std::vector<cpu::Kernel> cpu_kernels(std::size_t head_dim) {
  std::vector<cpu::Kernel> kernels{cpu::Kernel::portable};
  if (cpu::avx2_supported(head_dim)) kernels.push_back(cpu::Kernel::avx2);
  if (cpu::avx512_supported(head_dim)) kernels.push_back(cpu::Kernel::avx512);
  if (cpu::neon_supported(head_dim)) kernels.push_back(cpu::Kernel::neon);
  return kernels;
}

[[nodiscard]] inline const char* kernel_name(cpu::Kernel kernel) noexcept {
  switch (kernel) {
    case cpu::Kernel::portable:
      return "portable";
    case cpu::Kernel::avx2:
      return "avx2";
    case cpu::Kernel::avx512:
      return "avx512";
    case cpu::Kernel::neon:
      return "neon";
    default:
      return "automatic";
  }
}

}  // namespace kvcache::test
