// SPDX-License-Identifier: Apache-2.0
// Pieces the CUDA attention kernels share: which key positions a query block must visit, warp
// reductions, the score transform (scale, soft-cap, mask), and the host-side head checks and
// head_dim dispatch of their launchers.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

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

/// True for a finite x, false for inf and NaN (IEEE arithmetic: inf - inf and NaN - NaN are NaN).
__host__ __device__ __forceinline__ bool is_finite(float x) { return x - x == 0.0f; }

/// True on every thread of the block when `x` is true on any; `scratch` holds a float per warp
/// that no thread reads or writes around the call. A barrier: every thread must call it.
template <int kThreads>
__device__ __forceinline__ bool block_any(bool x, float* scratch) {
  const float any = warp_max(x ? 1.0f : 0.0f);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = any;
  __syncthreads();
  bool result = false;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) result = result || scratch[w] != 0.0f;
  return result;
}

/// Raises a running softmax max from m_old to m_new (>= m_old and every score): sets p[j] to the
/// weight e^(sc[j] - m_new) of each score (0 where masked, -inf) and returns the factor
/// e^(m_old - m_new) that sums over earlier scores must be scaled by (0 when m_old is -inf). While
/// every score so far is masked (m_new = -inf), the factor is 1 and every weight 0.
template <int N>
__device__ __forceinline__ float softmax_rescale(const float (&sc)[N], float (&p)[N], float m_old,
                                                 float m_new) {
#pragma unroll
  for (int j = 0; j < N; ++j) p[j] = 0.0f;
  if (m_new == -INFINITY) return 1.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) p[j] = sc[j] == -INFINITY ? 0.0f : __expf(sc[j] - m_new);
  return m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
}

/// Softmax partials over disjoint key sets (each its max m_i, sum l_i and accumulator acc_i)
/// combined under their common max m: {sum_i acc_i e^(m_i - m), sum_i l_i e^(m_i - m)}, partials
/// with no key (m_i = -inf) skipped; {0, 0} when m is -inf. A partial whose l_i is NaN (its keys
/// or q held an inf or NaN) makes the result {NaN, NaN}, whatever its m_i. m_at(i), l_at(i),
/// acc_at(i) read partial i (acc only for partials with keys).
template <class MAt, class LAt, class AccAt>
__device__ __forceinline__ float2 merge_partials(int n, float m, MAt&& m_at, LAt&& l_at,
                                                 AccAt&& acc_at) {
  for (int i = 0; i < n; ++i) {
    const float li = l_at(i);
    if (li != li) return make_float2(NAN, NAN);
  }
  float acc = 0.0f, l = 0.0f;
  if (m != -INFINITY) {
    for (int i = 0; i < n; ++i) {
      const float mi = m_at(i);
      if (mi == -INFINITY) continue;
      const float weight = __expf(mi - m);
      acc += acc_at(i) * weight;
      l += l_at(i) * weight;
    }
  }
  return make_float2(acc, l);
}

/// One step of a warp's online softmax over 64 scores, two per lane (-inf where masked): raises
/// the running max *m to include them, rescales the running sum *l and adds their weights, stores
/// in *corr the factor the accumulator of earlier steps must be scaled by, and returns in p the
/// weights e^(score - max) of the lane's two scores (0 where masked). A lane's `bad` (it saw a
/// non-finite score or V row, see transform_score) makes *l NaN from then on: the row's output is
/// NaN. Every lane of the warp calls it with the same m, l, corr (shared memory); lane 0 writes
/// them.
__device__ __forceinline__ void online_softmax_step(const float (&sc)[2], float (&p)[2], float* m,
                                                    float* l, float* corr, int lane, bool bad) {
  const float tile_max = warp_max(fmaxf(sc[0], sc[1]));
  const float m_new = fmaxf(*m, tile_max);
  const float correction = softmax_rescale(sc, p, *m, m_new);
  const float tile_sum = warp_sum(bad ? NAN : p[0] + p[1]);  // NaN reaches every lane's sum
  __syncwarp();  // every lane has read *m before lane 0 overwrites it
  if (lane == 0) {
    *m = m_new;
    *l = *l * correction + tile_sum;
    *corr = correction;
  }
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

/// scale * q.k (already scaled through q), soft-capped; -inf where masked. A visible score that is
/// not finite (q or the key's K row holds an inf or NaN) sets `bad` and is taken as masked, so
/// that the softmax state stays finite: the row is marked NaN instead (online_softmax_step's
/// `bad`). It is tested before the soft-cap, which maps inf to a finite value.
__host__ __device__ __forceinline__ float transform_score(float s, float softcap, bool visible,
                                                          bool& bad) {
  if (!visible) return -INFINITY;
  if (!is_finite(s)) {
    bad = true;
    return -INFINITY;
  }
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

}  // namespace kvcache::cuda::detail
