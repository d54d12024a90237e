// SPDX-License-Identifier: Apache-2.0
// Cache-relative positions (StreamingLLM) on the device: before an attention kernel runs, one
// small kernel computes the scores of every query row's attention-sink keys with q turned back
// by the window's shift (KVMask::sink_shift), into caller-owned workspace; the
// attention kernels then take those scores instead of their own q.k for the sink keys
// (DeviceMask::score). Keys stay stored rotated at their absolute positions, as on the CPU.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstddef>
#include <cstdint>

#include "kvcache/attention/options.hpp"
#include "kvcache/attention/rope.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda::detail {

/// A Rope's frequencies for device code, passed by value as a kernel parameter.
struct DeviceRope {
  static constexpr int kMaxPairs = 128;  // head_dim 256
  int pairs = 0;
  bool interleaved = false;
  float inv_freq[kMaxPairs] = {};
};

/// Whether an attention call with these options needs sink scores: cache_relative positions
/// with a window and sinks (otherwise no query is ever turned back).
[[nodiscard]] inline bool needs_sink_scores(const AttentionOptions& opts) noexcept {
  return opts.positions == PositionMode::cache_relative && opts.window > 0 &&
         opts.num_sink_tokens > 0;
}

/// `bytes` rounded up to a multiple of 256 (where workspace parts start).
[[nodiscard]] inline std::size_t round_up_256(std::size_t bytes) noexcept {
  return (bytes + 255) / 256 * 256;
}

/// Bytes of sink scores a launch over num_seqs sequences of up to rows_per_seq query rows needs
/// (0 unless needs_sink_scores), rounded up to 256 bytes.
[[nodiscard]] inline std::size_t sink_score_bytes(const AttentionOptions& opts, int num_seqs,
                                                  int rows_per_seq, int num_q_heads) noexcept {
  if (!needs_sink_scores(opts)) return 0;
  const std::size_t bytes =
      static_cast<std::size_t>(num_seqs) * static_cast<std::size_t>(rows_per_seq) *
      static_cast<std::size_t>(num_q_heads) * opts.num_sink_tokens * sizeof(float);
  return round_up_256(bytes);
}

/// The frequencies of opts.rope for the device. @throws shape_error when the RoPE is for another
/// head_dim than the view's.
[[nodiscard]] inline DeviceRope device_rope(const AttentionOptions& opts, int head_dim) {
  const Rope& rope = *opts.rope;  // check_options: cache_relative comes with a rope
  if (rope.head_dim() != static_cast<std::size_t>(head_dim)) {
    throw shape_error(
        kvcache::detail::message("CUDA attention: cache_relative positions with a "
                                 "RoPE for head_dim ",
                                 rope.head_dim(), " but the view has head_dim ", head_dim));
  }
  DeviceRope r;
  r.pairs = static_cast<int>(rope.inv_freq().size());  // <= head_dim / 2 <= 128
  r.interleaved = rope.config().pairing == RopePairing::interleaved;
  for (int i = 0; i < r.pairs; ++i) r.inv_freq[i] = rope.inv_freq()[static_cast<std::size_t>(i)];
  return r;
}

/// One block per (query row within its sequence, query head, sequence): turns q back by the
/// row's shift max(0, qpos - window + 1 - sinks) in shared memory (pair i by -shift *
/// inv_freq[i], angle in double, cos and sin rounded to float, as Rope::turn does), then writes
/// scale * q.k of each sink key the view holds (positions below min(sinks, length)) to `out`,
/// indexed as DeviceMask::score reads mask.sink_scores. Rows past a sequence's query count write
/// nothing. q_offsets null: decode, one row per non-empty sequence (row s of q).
template <KVFormat T, int D>
__global__ void sink_score_kernel(DeviceKVView<T> view, const float* __restrict__ q,
                                  const std::int32_t* __restrict__ q_offsets, DeviceRope rope,
                                  DeviceMask mask, float scale, float* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char smem[];  // as every kernel here declares it
  float* qt = reinterpret_cast<float*>(smem);             // [D]: q of the row, then turned
  const int row_in_seq = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y),
            seq = static_cast<int>(blockIdx.z);
  const std::int64_t length = view.length[seq];
  const std::int64_t q_len =
      q_offsets != nullptr ? q_offsets[seq + 1] - q_offsets[seq] : (length > 0 ? 1 : 0);
  if (row_in_seq >= q_len) return;
  const std::int64_t row = q_offsets != nullptr ? q_offsets[seq] + row_in_seq : seq;
  const std::int64_t qpos = length - q_len + row_in_seq;
  const std::int64_t shift = mask.sink_shift(qpos, true);
  const float* q_row = q + (row * mask.sink_heads + head) * D;
  for (int d = static_cast<int>(threadIdx.x); d < D; d += static_cast<int>(blockDim.x)) {
    qt[d] = q_row[d];
  }
  __syncthreads();
  if (shift > 0) {  // disjoint pairs: each thread reads and writes only its own
    for (int i = static_cast<int>(threadIdx.x); i < rope.pairs; i += static_cast<int>(blockDim.x)) {
      const int a = rope.interleaved ? 2 * i : i, b = rope.interleaved ? 2 * i + 1 : i + rope.pairs;
      const double angle = -static_cast<double>(shift) * static_cast<double>(rope.inv_freq[i]);
      const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
      const float x = qt[a], y = qt[b];
      qt[a] = x * c - y * s;
      qt[b] = x * s + y * c;
    }
  }
  __syncthreads();
  const int kv_head = head / (mask.sink_heads / view.num_kv_heads);
  const std::int64_t count = mask.sinks < length ? mask.sinks : length;
  for (std::int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    const std::int64_t off = view.row_offset(seq, kv_head, j);
    const key_format_t<T>* k = view.k + off;
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot += qt[d] * element_value(k[d]);
    if constexpr (scaled_v<key_format_t<T>>) dot *= static_cast<float>(view.k_scale[off / D]);
    out[((seq * mask.sink_rows + row_in_seq) * mask.sink_heads + head) * mask.sinks + j] =
        dot * scale;
  }
}

/// Sets up `mask` for cache_relative positions and launches sink_score_kernel on `stream`, the
/// scores going to `scores` (sink_score_bytes(...) bytes). Does nothing unless
/// needs_sink_scores(opts). @throws shape_error (a RoPE for another head_dim), cuda_error.
template <KVFormat T, int D>
void launch_sink_scores(const DeviceKVView<T>& view, const float* q, const std::int32_t* q_offsets,
                        int rows_per_seq, int num_q_heads, const AttentionOptions& opts,
                        float scale, float* scores, DeviceMask& mask, cudaStream_t stream) {
  if (!needs_sink_scores(opts) || view.num_seqs == 0) return;
  const DeviceRope rope = device_rope(opts, D);
  mask.sink_scores = scores;
  mask.sink_rows = rows_per_seq;
  mask.sink_heads = num_q_heads;
  const dim3 grid(static_cast<unsigned>(rows_per_seq), static_cast<unsigned>(num_q_heads),
                  static_cast<unsigned>(view.num_seqs));
  sink_score_kernel<T, D>
      <<<grid, 64, D * sizeof(float), stream>>>(view, q, q_offsets, rope, mask, scale, scores);
  check_launch("kvcache::cuda::sink_score_kernel");
}

}  // namespace kvcache::cuda::detail
