// SPDX-License-Identifier: Apache-2.0
// The second kernel of split-KV decode: combines the splits' partial results.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstdint>

#include "kvcache/cuda/kernels_common.cuh"

namespace kvcache::cuda::detail {

/// Combines the splits of each (sequence, query head): out = sum_s acc_s e^(m_s - M) / L; NaN
/// throughout where a split's l is NaN (it saw an inf or NaN), 0 where no split has a key.
template <int D>
__global__ void decode_merge_kernel(const float* __restrict__ partial_acc,
                                    const float* __restrict__ partial_ml, float* __restrict__ out,
                                    int num_q_heads, int num_splits) {
  const std::int64_t head_row = static_cast<std::int64_t>(blockIdx.x) * num_q_heads + blockIdx.y;
  const float* ml = partial_ml + head_row * num_splits * 2;
  float m = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, ml[2 * s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float2 sums = merge_partials(
        num_splits, m, [&](int s) { return ml[2 * s]; }, [&](int s) { return ml[2 * s + 1]; },
        [&](int s) { return partial_acc[(head_row * num_splits + s) * D + d]; });
    out[head_row * D + d] = sums.y > 0.0f ? sums.x / sums.y : sums.y == 0.0f ? 0.0f : NAN;
  }
}

}  // namespace kvcache::cuda::detail
