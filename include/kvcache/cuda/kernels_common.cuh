// SPDX-License-Identifier: Apache-2.0
// Pieces the CUDA attention kernels share: which key positions a query block must visit, warp
// reductions, and the score transform (scale, soft-cap, mask).
#pragma once

#include <cstdint>

#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda::detail {

inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

/// The keys of one sequence that queries at positions >= qpos_min may see, as a logical list
/// [0, sink_end) then [recent_begin, length) of present positions: the sinks (positions below
/// the options' num_sink_tokens) and the window [qpos_min - window + 1, ...). Keys in the list
/// can still be masked for individual queries (causality, per-query window).
__device__ __forceinline__ KeyRange visible_keys(KeyRange present, const DeviceMask& mask,
                                                 std::int64_t qpos_min) {
  if (!mask.causal || mask.window == 0) return present;
  // contiguous present prefix: [0, sink_end) when something was evicted, else the whole range
  const bool gap = present.recent_begin > present.sink_end;
  const std::int64_t prefix = gap ? present.sink_end : present.length;
  KeyRange r;
  r.length = present.length;
  r.sink_end = mask.sinks < prefix ? mask.sinks : prefix;
  std::int64_t begin = qpos_min - mask.window + 1;
  if (gap && begin < present.recent_begin) begin = present.recent_begin;
  if (begin < r.sink_end) begin = r.sink_end;
  if (begin > r.length) begin = r.length;
  r.recent_begin = begin;
  return r;
}

/// scale * q.k (already scaled through q), soft-capped; -inf where masked.
__device__ __forceinline__ float transform_score(float s, float softcap, bool visible) {
  if (!visible) return -INFINITY;
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

}  // namespace kvcache::cuda::detail
