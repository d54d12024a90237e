// SPDX-License-Identifier: Apache-2.0
// The CPU attention kernels a test can run on this machine, so that each property is checked on
// every SIMD path the CPU has, not only on the one Kernel::automatic picks; and the outputs of a
// kernel and of the reference over a view, as vectors.
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

/// One kernel's output for queries q ([n][q_heads][head_dim], at opts.query_pos on) over `view`.
template <KVView V>
std::vector<float> attend_fast(const std::vector<float>& q, std::size_t n, std::size_t q_heads,
                               const V& view, const AttentionOptions& opts, cpu::Kernel kernel) {
  std::vector<float> out(q.size());
  cpu::attend(TokenBlock<const float>{q, n, q_heads, view.head_dim()}, view,
              TokenBlock<float>{out, n, q_heads, view.head_dim()}, opts, kernel);
  return out;
}

/// The reference's output (double accumulation) for the same call.
template <KVView V>
std::vector<float> attend_slow(const std::vector<float>& q, std::size_t n, std::size_t q_heads,
                               const V& view, const AttentionOptions& opts) {
  std::vector<float> out(q.size());
  reference::attend(TokenBlock<const float>{q, n, q_heads, view.head_dim()}, view,
                    TokenBlock<float>{out, n, q_heads, view.head_dim()}, opts);
  return out;
}

}  // namespace kvcache::test
