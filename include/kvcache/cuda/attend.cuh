// SPDX-License-Identifier: Apache-2.0
// The CUDA side of kvcache::attend: given a device view it validates on the host, then launches
// the decode kernel (one query token per sequence, split-KV + merge) or the prefill kernel (many
// query tokens per sequence) on the caller's stream, with caller-owned workspace.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/cuda/decode.cuh"
#include "kvcache/cuda/prefill.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/sink_scores.cuh"
#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda {

/// What a device attention call needs besides the CPU call's arguments.
struct DeviceAttendArgs {
  cudaStream_t stream = nullptr;
  /// Decode: workspace of at least decode_workspace_bytes(...) bytes; prefill: of
  /// prefill_workspace_bytes(...) bytes (nullptr where that is 0: prefill with absolute
  /// positions needs none).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  /// Prefill: device array [num_seqs + 1]; the query tokens of sequence s are rows
  /// q_offsets[s] .. q_offsets[s + 1] - 1 of q, at that sequence's last positions. nullptr:
  /// decode, exactly one query token per sequence (row s), at position length - 1.
  const std::int32_t* q_offsets = nullptr;
  /// Prefill: the largest q_offsets[s + 1] - q_offsets[s] (host-side; sizes the grid).
  int max_q_len = 1;
  /// Decode: make_decode_setup(...) of this device, dtype, head_dim and group, or nullptr to
  /// query the device on every launch. With one the launch makes no CUDA call but cudaGetDevice
  /// and the kernel launches.
  const DecodeSetup* decode_setup = nullptr;
};

namespace detail {

// The device kernels' mask, before launch_sink_scores adds the sink scores of cache_relative
// positions.
inline DeviceMask device_mask(const AttentionOptions& opts) {
  return DeviceMask{.causal = opts.causal,
                    .window = static_cast<std::int64_t>(opts.window),
                    .sinks = static_cast<std::int64_t>(opts.num_sink_tokens)};
}

// Where a launch's workspace puts the sink scores: after the `first` bytes of other parts.
// Returns the total; the scores start at round_up_256(first) when sink_bytes != 0.
inline std::size_t with_sink_scores(std::size_t first, std::size_t sink_bytes) noexcept {
  return sink_bytes == 0 ? first : round_up_256(first) + sink_bytes;
}

}  // namespace detail

/// Bytes of workspace launch_decode_attention needs for this view (decode_workspace_bytes for
/// the view's shape and max_keys, the options' window applied, plus the sink scores of
/// cache_relative positions), with `setup` if given (no CUDA call), else on the current device.
template <KVFormat T>
[[nodiscard]] std::size_t decode_workspace_bytes(const DeviceKVView<T>& view, int num_q_heads,
                                                 const AttentionOptions& opts = {},
                                                 const DecodeSetup* setup = nullptr) {
  const std::int64_t keys = detail::decode_keys(view.max_keys, opts);
  const std::size_t partials =
      setup != nullptr ? decode_workspace_bytes<T>(*setup, view.num_seqs, num_q_heads,
                                                   view.num_kv_heads, view.head_dim, keys)
                       : decode_workspace_bytes<T>(view.num_seqs, num_q_heads, view.num_kv_heads,
                                                   view.head_dim, keys);
  return detail::with_sink_scores(partials,
                                  detail::sink_score_bytes(opts, view.num_seqs, 1, num_q_heads));
}

/// Bytes of workspace launch_prefill_attention needs: the sink scores of cache_relative
/// positions for num_seqs x max_q_len query rows; 0 for absolute positions (no workspace).
template <KVFormat T>
[[nodiscard]] std::size_t prefill_workspace_bytes(const DeviceKVView<T>& view, int num_q_heads,
                                                  int max_q_len, const AttentionOptions& opts) {
  return detail::sink_score_bytes(opts, view.num_seqs, max_q_len < 1 ? 0 : max_q_len, num_q_heads);
}

/// Decode attention: q and out [num_seqs][num_q_heads][head_dim] device arrays, one query token
/// per sequence of the view (at position length - 1). Empty sequences get a zero output. Any
/// GQA/MQA group: each block serves up to kMaxGroup query heads of one KV head (fewer with
/// DecodeKernel::tensor_cores_per_warp for bf16 or head_dim 256). Splits each
/// sequence's keys over several blocks (merged by a second kernel) so that the grid fills the
/// device's waves; workspace must hold decode_workspace_bytes(...) bytes. `setup`, if given
/// (make_decode_setup on this device), replaces the device queries every launch makes without.
/// Inf and NaN as kvcache::attend on the CPU: a query head whose q, or the K or V row of a key it
/// sees, holds an inf or NaN gets NaN throughout (whichever kernel and split computed it); inf
/// and NaN elsewhere (other heads, keys outside the window, slots the view does not present)
/// change none of the other heads' bits; an empty sequence gets zeros whatever q holds.
/// int8 and fp8 views (DeviceCache of qint8 / fp8_e4m3): the codes are read directly and each
/// row's scale applied to its score and weight (DecodeKernel::cuda_cores); a row whose scale is
/// NaN (it was appended holding an inf or NaN) counts as a non-finite row. A KVFormats<K, V>
/// view: each side read in its own format, the same way (DecodeKernel::cuda_cores).
/// @throws shape_error (head_dim not 64/128/256, num_q_heads not a multiple of num_kv_heads,
///         workspace too small, setup made for another dtype, head_dim, group or device),
///         cuda_error.
template <KVFormat T>
void launch_decode_attention(const DeviceKVView<T>& view, const float* q, float* out,
                             int num_q_heads, const AttentionOptions& opts, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream,
                             const DecodeSetup* setup = nullptr) {
  detail::check_heads("CUDA decode attention", num_q_heads, view.num_kv_heads);
  const int group = num_q_heads / view.num_kv_heads;
  if (setup != nullptr) {
    detail::check_setup<T>(*setup, view.head_dim, group, "CUDA decode attention");
    int device = -1;
    check(cudaGetDevice(&device), "cudaGetDevice");
    if (device != setup->device) {
      throw shape_error(kvcache::detail::message("CUDA decode attention: DecodeSetup of device ",
                                                 setup->device, " used on device ", device));
    }
  }
  const float scale =
      opts.scale > 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(view.head_dim));
  const std::int64_t max_keys = detail::decode_keys(view.max_keys, opts);
  detail::dispatch_head_dim(view.head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    const DecodeSetup sized =
        setup != nullptr ? *setup
                         : detail::query_decode_setup<T, D>(group, default_decode_kernel<T>);
    const detail::DecodePlan plan =
        detail::plan_decode(sized, view.num_seqs, view.num_kv_heads, max_keys);
    const std::size_t partials = plan.workspace_bytes(view.num_seqs, num_q_heads, D);
    const std::size_t sink_bytes = detail::sink_score_bytes(opts, view.num_seqs, 1, num_q_heads);
    const std::size_t need = detail::with_sink_scores(partials, sink_bytes);
    if (workspace_bytes < need || (need > 0 && workspace == nullptr)) {
      throw shape_error(kvcache::detail::message("CUDA decode attention: workspace of ",
                                                 workspace_bytes, " bytes, needs ", need, " (",
                                                 plan.splits, " splits of ", plan.keys_per_split,
                                                 " keys, ", sink_bytes, " bytes of sink scores)"));
    }
    float* partial_acc = partials == 0 ? nullptr : static_cast<float*>(workspace);
    float* partial_ml = partials == 0 ? nullptr
                                      : partial_acc + static_cast<std::size_t>(view.num_seqs) *
                                                          num_q_heads * plan.splits * D;
    DeviceMask mask = detail::device_mask(opts);
    if (sink_bytes != 0) {
      float* scores = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) +
                                               detail::round_up_256(partials));
      detail::launch_sink_scores<T, D>(view, q, nullptr, 1, num_q_heads, opts, scale, scores, mask,
                                       stream);
    }
    const dim3 grid(static_cast<unsigned>(plan.splits),
                    static_cast<unsigned>(view.num_kv_heads * plan.num_chunks),
                    static_cast<unsigned>(view.num_seqs));
    const detail::DecodeArgs args{.q = q,
                                  .out = out,
                                  .partial_acc = partial_acc,
                                  .partial_ml = partial_ml,
                                  .num_q_heads = num_q_heads,
                                  .chunk_group = plan.chunk_group,
                                  .num_splits = plan.splits,
                                  .keys_per_split = plan.keys_per_split,
                                  .mask = mask,
                                  .scale = scale,
                                  .softcap = opts.softcap};
    if constexpr (kCudaCoreDecode<T>) {
      detail::dispatch_head_bucket(plan.chunk_group, [&](auto g) {
        detail::decode_attention_kernel<T, D, decltype(g)::value>
            <<<grid, kDecodeThreads, sized.smem_bytes, stream>>>(view, args);
        check_launch("kvcache::cuda::decode_attention_kernel");
      });
    } else if (sized.kernel == DecodeKernel::tensor_cores_per_warp) {
      detail::dispatch_head_bucket(plan.chunk_group, [&](auto g) {
        constexpr int G = decltype(g)::value;
        if constexpr (G <= detail::warp_decode_max_group(std::is_same_v<T, kvcache::half>, D)) {
          detail::decode_attention_warp_kernel<T, D, G>
              <<<grid, kDecodeThreads, sized.smem_bytes, stream>>>(view, args);
          check_launch("kvcache::cuda::decode_attention_warp_kernel");
        }
      });
    } else {  // fp16/bf16 K/V: q.k and p.V on tensor cores
      detail::decode_attention_mma_kernel<T, D>
          <<<grid, kDecodeThreads, sized.smem_bytes, stream>>>(view, args);
      check_launch("kvcache::cuda::decode_attention_mma_kernel");
    }
    if (plan.splits > 1) {
      const dim3 merge_grid(static_cast<unsigned>(view.num_seqs),
                            static_cast<unsigned>(num_q_heads));
      detail::decode_merge_kernel<D><<<merge_grid, std::min(D, 128), 0, stream>>>(
          partial_acc, partial_ml, out, num_q_heads, plan.splits);
      check_launch("kvcache::cuda::decode_merge_kernel");
    }
  });
}

/// Prefill attention: q and out [total][num_q_heads][head_dim] device arrays, the rows of
/// sequence s being q_offsets[s] .. q_offsets[s + 1] - 1 (device array), at that sequence's
/// last positions (append their K/V first). Tensor cores for every format (tf32 for float; fp16
/// for the int8 and fp8 codes, which are fp16 values, their row scales applied to the scores and
/// weights in fp32; a KVFormats<K, V> pair in its unquantized side's type, fp16 when both are
/// quantized, tf32 for two different ones: detail::prefill_operand_t).
/// Inf and NaN as kvcache::attend on the CPU: a query row whose q, or the K or V row of a key it
/// sees, holds an inf or NaN is NaN throughout; an inf or NaN in a key a row cannot see (a later
/// token of the same chunk, a key outside its window) changes none of its bits. q is rounded to
/// the operand type (fp16, bf16, tf32; fp16 for int8 and fp8) for the tensor cores, so a q
/// element beyond fp16's range counts as inf with fp16, int8 or fp8 K/V. cache_relative positions
/// need workspace of prefill_workspace_bytes(view, num_q_heads, max_q_len, opts) bytes (none
/// otherwise).
/// @throws shape_error (head_dim not 64/128/256, or 256 with tf32 tiles; workspace too small; a
///         RoPE for another head_dim), cuda_error.
template <KVFormat T>
void launch_prefill_attention(const DeviceKVView<T>& view, const float* q, float* out,
                              int num_q_heads, const std::int32_t* q_offsets, int max_q_len,
                              const AttentionOptions& opts, cudaStream_t stream,
                              void* workspace = nullptr, std::size_t workspace_bytes = 0) {
  detail::check_heads("CUDA prefill attention", num_q_heads, view.num_kv_heads);
  constexpr bool kFloatTiles = std::is_same_v<detail::prefill_operand_t<T>, float>;
  if (kFloatTiles && view.head_dim > 128) {
    throw shape_error(kvcache::detail::message(
        "CUDA prefill attention: head_dim ", view.head_dim, " with ", detail::format_name<T>(),
        " K/V (tf32 tiles) unsupported; supported: 64, 128"));
  }
  if (max_q_len < 1) return;
  const std::size_t sink_bytes = prefill_workspace_bytes(view, num_q_heads, max_q_len, opts);
  if (workspace_bytes < sink_bytes || (sink_bytes > 0 && workspace == nullptr)) {
    throw shape_error(kvcache::detail::message("CUDA prefill attention: workspace of ",
                                               workspace_bytes, " bytes, needs ", sink_bytes,
                                               " (sink scores of cache_relative positions)"));
  }
  const float scale =
      opts.scale > 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(view.head_dim));
  detail::dispatch_head_dim(view.head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (kFloatTiles && D > 128) {
      return;  // rejected above; not instantiated (its tiles would not fit in shared memory)
    } else {
      constexpr std::size_t smem = detail::PrefillSmem<T, D>::kBytes;
      auto kernel = detail::prefill_attention_kernel<T, D>;
      detail::allow_smem(kernel, smem);
      DeviceMask mask = detail::device_mask(opts);
      detail::launch_sink_scores<T, D>(view, q, q_offsets, max_q_len, num_q_heads, opts, scale,
                                       static_cast<float*>(workspace), mask, stream);
      const dim3 grid(static_cast<unsigned>((max_q_len + kPrefillRows - 1) / kPrefillRows),
                      static_cast<unsigned>(num_q_heads), static_cast<unsigned>(view.num_seqs));
      kernel<<<grid, kPrefillThreads, smem, stream>>>(view, q, out, q_offsets, num_q_heads, mask,
                                                      scale, opts.softcap);
      check_launch("kvcache::cuda::prefill_attention_kernel");
    }
  });
}

}  // namespace kvcache::cuda

namespace kvcache {

/// kvcache::attend for device views: the same call as on the CPU (q and out hold device memory,
/// shaped [tokens][num_q_heads][head_dim]) plus the stream, workspace and, for prefill, the
/// per-sequence query offsets. Decode when args.q_offsets is null (q.num_tokens == num_seqs),
/// prefill otherwise.
/// opts.pool is ignored and opts.query_pos must be unset (queries sit at the last positions).
/// Validate positions on the host first with DeviceCache::check_attention. Non-finite q, K and V:
/// the semantics of the CPU kvcache::attend, in every decode kernel (DecodeKernel), split or not,
/// and in the prefill kernel.
/// @throws shape_error, cuda_error. Asynchronous: nothing is synchronised.
template <KVFormat T>
void attend(TokenBlock<const float> q, const cuda::DeviceKVView<T>& view, TokenBlock<float> out,
            const AttentionOptions& opts, const cuda::DeviceAttendArgs& args) {
  detail::check_options(opts);
  if (opts.query_pos.has_value()) {
    throw shape_error("CUDA attend: query_pos is not supported (queries are the last positions)");
  }
  if (q.head_dim != static_cast<std::size_t>(view.head_dim) || out.head_dim != q.head_dim ||
      out.num_heads != q.num_heads || out.num_tokens != q.num_tokens) {
    throw shape_error(detail::message("CUDA attend: q [", q.num_tokens, "][", q.num_heads, "][",
                                      q.head_dim, "], out [", out.num_tokens, "][", out.num_heads,
                                      "][", out.head_dim, "] and the view's head_dim ",
                                      view.head_dim, " disagree"));
  }
  const int heads = static_cast<int>(q.num_heads);
  if (args.q_offsets == nullptr) {
    if (q.num_tokens != static_cast<std::size_t>(view.num_seqs)) {
      throw shape_error(detail::message("CUDA attend (decode): ", q.num_tokens,
                                        " query tokens for ", view.num_seqs, " sequences"));
    }
    cuda::launch_decode_attention(view, q.data.data(), out.data.data(), heads, opts, args.workspace,
                                  args.workspace_bytes, args.stream, args.decode_setup);
  } else {
    cuda::launch_prefill_attention(view, q.data.data(), out.data.data(), heads, args.q_offsets,
                                   args.max_q_len, opts, args.stream, args.workspace,
                                   args.workspace_bytes);
  }
}

}  // namespace kvcache
