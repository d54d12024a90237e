// SPDX-License-Identifier: Apache-2.0
// How a decode attention launch is planned, in plain C++ (no CUDA needed, tested by plain Catch2):
// the decode kernels' block shape, the DecodeSetup a device is described by, head chunks and
// split-KV counts (DecodePlan), and the workspace a launch needs. The kernels are in
// decode_*.cuh, the device query (make_decode_setup) in decode.cuh.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/format.hpp"

namespace kvcache::cuda {

inline constexpr int kDecodeThreads = 128;  ///< 4 warps per (sequence, KV head, head chunk, split)
inline constexpr int kDecodeTile = 64;      ///< keys per shared-memory tile
/// Query heads one decode block serves; a KV head with more (MQA, wide GQA) is split into
/// ceil(group / kMaxGroup) equal chunks, one block each (its K/V are read once per chunk).
inline constexpr int kMaxGroup = 16;
inline constexpr int kMinKeysPerSplit = 256;
/// Shared memory a Hopper block may opt into (sm_90: 227 KiB); every kernel instantiation is
/// checked against it at compile time.
inline constexpr std::size_t kMaxSmemBytes = 227 * 1024;

namespace detail {

/// @throws shape_error unless num_q_heads is a positive multiple of num_kv_heads.
inline void check_heads(const char* what, int num_q_heads, int num_kv_heads) {
  if (num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % num_kv_heads != 0) {
    throw shape_error(kvcache::detail::message(what, ": num_q_heads ", num_q_heads,
                                               " is not a positive multiple of num_kv_heads ",
                                               num_kv_heads));
  }
}

/// Query heads one block of decode_attention_warp_kernel serves at most, for fp16 (one pair of
/// part rows per head) or bf16 (two pairs) and head_dim D: its output accumulators live in
/// registers, (m-tiles) x D / 2 floats per lane, which must stay within 128, and its q fragments,
/// (m-tiles) x D / 4: at most 2 m-tiles (bf16 at head_dim 64 with 16 heads, 4 m-tiles, spilled).
KVCACHE_HOST_DEVICE constexpr int warp_decode_max_group(bool fp16, int head_dim) {
  const int pairs = fp16 ? 1 : 2;
  int g = kMaxGroup;
  for (;;) {
    const int m_tiles = g * pairs / 8 > 1 ? g * pairs / 8 : 1;
    if (g == 4 || (m_tiles * head_dim <= 256 && m_tiles <= 2)) return g;
    g /= 2;
  }
}

/// How one decode launch covers a batch: grid (splits, num_kv_heads x num_chunks, num_seqs).
struct DecodePlan {
  int chunk_group = 1;              ///< query heads per block
  int num_chunks = 1;               ///< blocks per KV head (ceil(group / max heads per block))
  int splits = 1;                   ///< blocks along each sequence's keys
  std::int64_t keys_per_split = 0;  ///< a multiple of kDecodeTile; splits x it >= max_keys

  /// Partials of every split (0 for one split: the kernel writes the output directly).
  [[nodiscard]] std::size_t workspace_bytes(int num_seqs, int num_q_heads, int head_dim) const {
    if (splits == 1) return 0;
    return static_cast<std::size_t>(num_seqs) * static_cast<std::size_t>(num_q_heads) *
           static_cast<std::size_t>(splits) * static_cast<std::size_t>(head_dim + 2) *
           sizeof(float);
  }
};

/// Splits per sequence for `units` blocks per split when `slots` blocks run at once: the fewest
/// (each split >= kMinKeysPerSplit keys of max_keys) whose blocks fill their waves to >= 90%,
/// else the count with the fullest waves. A partly filled last wave leaves multiprocessors idle
/// and, with them, memory bandwidth (512 blocks on 396 slots run at ~65% of the device).
/// Non-decreasing in max_keys. O(max_keys / kMinKeysPerSplit).
inline int choose_splits(std::int64_t max_keys, std::int64_t units, std::int64_t slots) {
  units = std::max<std::int64_t>(units, 1);
  slots = std::max<std::int64_t>(slots, 1);
  const std::int64_t most =
      std::max<std::int64_t>(1, (max_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  std::int64_t best = 1;
  double best_fill = 0.0;
  for (std::int64_t s = 1; s <= most; ++s) {
    const std::int64_t blocks = units * s;
    const std::int64_t waves = (blocks + slots - 1) / slots;
    const double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (fill >= 0.9) return static_cast<int>(s);
    if (fill > best_fill) {
      best = s;
      best_fill = fill;
    }
  }
  return static_cast<int>(best);
}

/// Query heads per decode block: a group split into ceil(group / max_group) equal chunks.
inline int decode_chunk_group(int group, int max_group = kMaxGroup) {
  const int chunks = (group + max_group - 1) / max_group;
  return (group + chunks - 1) / chunks;
}

/// The device-independent part of a plan: head chunks, splits and keys per split, for
/// `slots` resident blocks (multiprocessors x blocks per multiprocessor) serving at most
/// `max_group` query heads each.
inline DecodePlan plan_decode_grid(int num_seqs, int group, int num_kv_heads, std::int64_t max_keys,
                                   std::int64_t slots, int max_group = kMaxGroup) {
  DecodePlan p;
  p.chunk_group = decode_chunk_group(group, max_group);
  p.num_chunks = (group + p.chunk_group - 1) / p.chunk_group;  // as decode_attention_kernel does
  const std::int64_t units =
      static_cast<std::int64_t>(num_seqs) * num_kv_heads * static_cast<std::int64_t>(p.num_chunks);
  p.splits = choose_splits(max_keys, units, slots);
  const std::int64_t per = (max_keys + p.splits - 1) / p.splits;
  p.keys_per_split =
      std::max<std::int64_t>(kDecodeTile, (per + kDecodeTile - 1) / kDecodeTile * kDecodeTile);
  return p;
}

/// Keys a decode query may visit: a sliding window bounds them by window + sinks.
inline std::int64_t decode_keys(std::int64_t max_keys, const AttentionOptions& opts) {
  if (!opts.causal || opts.window == 0) return max_keys;
  return std::min<std::int64_t>(max_keys,
                                static_cast<std::int64_t>(opts.window + opts.num_sink_tokens));
}

}  // namespace detail

/// The decode kernels. fp32 K/V take cuda_cores; fp16/bf16 K/V take either tensor-core kernel,
/// tensor_cores unless a DecodeSetup names the other.
enum class DecodeKernel : int {
  cuda_cores = 0,  ///< fp32 K/V on CUDA cores (decode_attention_kernel)
  /// fp16/bf16: block-wide 64-key tiles, wmma, scores and output in shared memory
  /// (decode_attention_mma_kernel)
  tensor_cores = 1,
  /// fp16/bf16: each warp its own 16-key tiles and pipeline, mma.sync with q, scores and output in
  /// registers, one merge per block (decode_attention_warp_kernel); fewer heads per block for bf16
  /// or head_dim 256 (warp_decode_max_group)
  tensor_cores_per_warp = 2,
};

/// The enumerator's name, as written above.
[[nodiscard]] constexpr const char* decode_kernel_name(DecodeKernel kernel) noexcept {
  switch (kernel) {
    case DecodeKernel::cuda_cores:
      return "cuda_cores";
    case DecodeKernel::tensor_cores:
      return "tensor_cores";
    case DecodeKernel::tensor_cores_per_warp:
      return "tensor_cores_per_warp";
  }
  return "unknown";
}

/// True for the K/V formats decode attention reads on CUDA cores only (DecodeKernel::cuda_cores):
/// f32, the int8 and fp8 codes (read directly, their row scales applied per key), and every
/// KVFormats<K, V> pair (each side read in its own format). fp16 and bf16 K/V take the
/// tensor-core kernels.
template <KVFormat T>
inline constexpr bool kCudaCoreDecode =
    std::is_same_v<T, float> || QuantizedElement<T> || !KVElement<T>;

/// The kernel a DecodeSetup for T K/V takes when none is named.
template <KVFormat T>
inline constexpr DecodeKernel default_decode_kernel =
    kCudaCoreDecode<T> ? DecodeKernel::cuda_cores : DecodeKernel::tensor_cores;

/// What a decode launch is sized by on one device, queried once (make_decode_setup) rather than
/// on every launch: the decode kernel's dynamic shared memory for this dtype, head_dim and GQA
/// group (its limit raised past 48 KiB on that device), its resident blocks per multiprocessor
/// at that size, and the multiprocessor count. A decode step of an engine launches once per
/// layer; without a setup each launch first makes four CUDA calls (device, SM count, shared
/// memory limit, occupancy), host time that a short kernel (small batch or context) does not
/// hide. Plain data: copy it, keep one per (device, model).
struct DecodeSetup {
  int device = -1;           ///< the CUDA device it was queried on
  DType dtype = DType::f32;  ///< storage format of the K/V it serves (of K for a KVFormats pair)
  /// A KVFormats pair's V format (unset: V in dtype too).
  std::optional<DType> value_dtype = std::nullopt;
  int head_dim = 0;            ///< 64, 128 or 256
  int group = 0;               ///< query heads per KV head
  std::size_t smem_bytes = 0;  ///< dynamic shared memory per decode block
  int blocks_per_sm = 0;       ///< resident decode blocks per multiprocessor (>= 1)
  int num_sms = 0;             ///< multiprocessors of the device
  DecodeKernel kernel = DecodeKernel::cuda_cores;  ///< the kernel it sizes and launches
};

namespace detail {

/// kvcache::format_name of T's K and V formats: "f16", or "K f16 + V int8" for a pair.
template <KVFormat T>
std::string format_name() {
  return kvcache::format_name(dtype_of<key_format_t<T>>, dtype_of<value_format_t<T>>);
}

/// @throws shape_error unless `kernel` serves T K/V (cuda_cores: float, int8, fp8, pairs; the
///         others fp16/bf16).
template <KVFormat T>
void check_kernel(DecodeKernel kernel, const char* what) {
  const bool cores = kCudaCoreDecode<T>;
  const bool ok = kernel == DecodeKernel::cuda_cores
                      ? cores
                      : !cores && (kernel == DecodeKernel::tensor_cores ||
                                   kernel == DecodeKernel::tensor_cores_per_warp);
  if (!ok) {
    throw shape_error(kvcache::detail::message(what, ": decode kernel ", decode_kernel_name(kernel),
                                               " (", static_cast<int>(kernel), ") does not serve ",
                                               format_name<T>(), " K/V"));
  }
}

/// Query heads one block of `setup`'s kernel serves at most.
inline int decode_max_group(const DecodeSetup& setup) {
  return setup.kernel == DecodeKernel::tensor_cores_per_warp
             ? warp_decode_max_group(setup.dtype == DType::f16, setup.head_dim)
             : kMaxGroup;
}

/// @throws shape_error unless `setup` was made for T, head_dim and group (on any device) and
///         names a kernel for T.
template <KVFormat T>
void check_setup(const DecodeSetup& setup, int head_dim, int group, const char* what) {
  const DType value_dtype = setup.value_dtype.value_or(setup.dtype);
  if (setup.dtype != dtype_of<key_format_t<T>> || value_dtype != dtype_of<value_format_t<T>> ||
      setup.head_dim != head_dim || setup.group != group || setup.blocks_per_sm < 1 ||
      setup.num_sms < 1) {
    throw shape_error(kvcache::detail::message(
        what, ": DecodeSetup for ", kvcache::format_name(setup.dtype, value_dtype), ", head_dim ",
        setup.head_dim, ", group ", setup.group, " (", setup.num_sms, " SMs x ",
        setup.blocks_per_sm, " blocks) used for ", format_name<T>(), ", head_dim ", head_dim,
        ", group ", group));
  }
  check_kernel<T>(setup.kernel, what);
}

/// The plan of one launch from a setup (which also gives its shared memory): host arithmetic
/// only, no CUDA call.
inline DecodePlan plan_decode(const DecodeSetup& setup, int num_seqs, int num_kv_heads,
                              std::int64_t max_keys) {
  const std::int64_t slots = static_cast<std::int64_t>(setup.num_sms) * setup.blocks_per_sm;
  return plan_decode_grid(num_seqs, setup.group, num_kv_heads, max_keys, slots,
                          decode_max_group(setup));
}

}  // namespace detail

/// Bytes of workspace launch_decode_attention needs, with `setup`, for a batch of num_seqs
/// sequences whose views hold at most `max_keys` keys (DeviceKVView::max_keys): the partials of
/// every split, 0 when one split suffices. Non-decreasing in max_keys: query it once for the
/// longest context served, allocate, and reuse the buffer for every launch. No CUDA call.
/// @throws shape_error (setup made for another format, head_dim or group).
template <KVFormat T>
[[nodiscard]] std::size_t decode_workspace_bytes(const DecodeSetup& setup, int num_seqs,
                                                 int num_q_heads, int num_kv_heads, int head_dim,
                                                 std::int64_t max_keys) {
  detail::check_heads("CUDA decode attention", num_q_heads, num_kv_heads);
  detail::check_setup<T>(setup, head_dim, num_q_heads / num_kv_heads, "CUDA decode attention");
  return detail::plan_decode(setup, num_seqs, num_kv_heads, max_keys)
      .workspace_bytes(num_seqs, num_q_heads, head_dim);
}

}  // namespace kvcache::cuda
