// SPDX-License-Identifier: Apache-2.0
// Pieces the CUDA attention kernels share: which key positions a query block must visit, warp
// reductions, the score transform (scale, soft-cap, mask), and the host-side head checks and
// head_dim dispatch of their launchers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/core/error.hpp"
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

/// Calls f(std::integral_constant<int, D>{}) for a supported head_dim.
/// @throws shape_error listing the supported values.
template <class F>
void dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    default:
      throw shape_error(kvcache::detail::message("CUDA attention: head_dim ", head_dim,
                                                 " unsupported; supported: 64, 128, 256"));
  }
}

/// @throws shape_error unless num_q_heads is a positive multiple of num_kv_heads.
inline void check_heads(const char* what, int num_q_heads, int num_kv_heads) {
  if (num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % num_kv_heads != 0) {
    throw shape_error(kvcache::detail::message(what, ": num_q_heads ", num_q_heads,
                                               " is not a positive multiple of num_kv_heads ",
                                               num_kv_heads));
  }
}

/// The keys of one sequence that queries at positions >= qpos_min may see, as a logical list
/// [0, sink_end) then [recent_begin, length) of present positions: the sinks (positions below
/// the options' num_sink_tokens) and the window [qpos_min - window + 1, ...). Keys in the list
/// can still be masked for individual queries (causality, per-query window).
__host__ __device__ __forceinline__ KeyRange visible_keys(KeyRange present, const DeviceMask& mask,
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
__host__ __device__ __forceinline__ float transform_score(float s, float softcap, bool visible) {
  if (!visible) return -INFINITY;
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

}  // namespace kvcache::cuda::detail
