// SPDX-License-Identifier: Apache-2.0
// Device views: one layer of a batch of sequences in device memory, described by plain structs the
// kernels address directly — contiguous (StaticCache layout), ring (SlidingWindowCache layout, with
// sinks) and paged (block tables). They mirror the CPU views: absolute positions, the present set
// [0, sink_end) and [recent_begin, length) per sequence.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/runtime.cuh"

namespace kvcache::cuda {

/// How a view maps (sequence, KV head, absolute position) to memory.
enum class Layout : int {
  contiguous = 0,  ///< [seq][head][slot][head_dim], slot = position
  ring = 1,   ///< as contiguous, slot = p < num_sinks ? p : num_sinks + (p - num_sinks) % ring_len
  paged = 2,  ///< block_table[seq][p / block_size] names a block; slot p % block_size within it
};

/// One layer of a batch of sequences in device memory. Built by DeviceCache::view(), or by hand
/// for K/V an engine keeps in its own buffers. All pointers are device pointers except where noted.
template <Element T>
struct DeviceKVView {
  const T* k = nullptr;  ///< K base of the layer
  const T* v = nullptr;  ///< V base of the layer
  int num_seqs = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  Layout layout = Layout::contiguous;
  std::int64_t seq_stride = 0;   ///< contiguous/ring: elements from one sequence to the next
  std::int64_t head_stride = 0;  ///< elements from one KV head to the next (in a sequence/block)
  int num_sinks = 0;             ///< ring only
  int ring_len = 1;              ///< ring only
  const std::int32_t* block_table = nullptr;   ///< paged: [num_seqs][max_blocks] block ids
  int max_blocks = 0;                          ///< paged: row length of block_table
  int block_size = 1;                          ///< paged: tokens per block
  std::int64_t block_stride = 0;               ///< paged: elements from one block to the next
  const std::int64_t* length = nullptr;        ///< [num_seqs]: positions appended
  const std::int64_t* sink_end = nullptr;      ///< [num_seqs] or null (= 0)
  const std::int64_t* recent_begin = nullptr;  ///< [num_seqs] or null (= 0)
  /// Host-side: the most keys any sequence's view holds, sink_end + length - recent_begin (sizes
  /// grids, splits and workspace; not read by kernels: an undercount costs speed, not results).
  std::int64_t max_keys = 0;

  /// Element offset of the head_dim-long row of (seq, head, pos) from k (or v). Paged views
  /// hold positions below 2^31 (DeviceCache checks max_seq_len), so the block index takes a
  /// 32-bit division; so does the ring slot until 2^32 tokens have passed through the ring.
  __device__ __forceinline__ std::int64_t row_offset(int seq, int head, std::int64_t pos) const {
    if (layout == Layout::paged) {
      const auto p = static_cast<std::uint32_t>(pos);
      const auto bs = static_cast<std::uint32_t>(block_size);
      const std::uint32_t index = p / bs;
      const std::int32_t block = block_table[static_cast<std::int64_t>(seq) * max_blocks + index];
      return block * block_stride + head * head_stride +
             static_cast<std::int64_t>(p - index * bs) * head_dim;
    }
    std::int64_t slot = pos;
    if (layout == Layout::ring && pos >= num_sinks) {
      const std::int64_t r = pos - num_sinks;
      slot = num_sinks + (r <= 0xffffffffLL
                              ? static_cast<std::int64_t>(static_cast<std::uint32_t>(r) %
                                                          static_cast<std::uint32_t>(ring_len))
                              : r % ring_len);
    }
    return seq * seq_stride + head * head_stride + slot * head_dim;
  }
};

/// The mask of an attention call, resolved for device code (see kvcache::detail::Mask).
struct DeviceMask {
  bool causal = true;
  std::int64_t window = 0;  ///< 0 = unlimited
  std::int64_t sinks = 0;
  /// PositionMode::cache_relative: the scores of the sink keys (q turned back by the window's
  /// shift, times the softmax scale), computed by sink_score_kernel before the attention kernel,
  /// which takes them instead of its own q.k for keys at positions below `sinks`. Indexed
  /// ((seq * sink_rows + row) * sink_heads + head) * sinks + pos for query row `row` of its
  /// sequence. Null for absolute positions.
  const float* sink_scores = nullptr;
  std::int64_t sink_rows = 1;  ///< query rows per sequence in sink_scores (max_q_len)
  int sink_heads = 0;          ///< query heads
  __host__ __device__ __forceinline__ bool visible(std::int64_t qpos, std::int64_t pos) const {
    return !causal || (pos <= qpos && (window == 0 || pos > qpos - window || pos < sinks));
  }
  /// The score of key `pos` for query head `head` of row `row` of sequence `seq`: `computed`
  /// (the kernel's own q.k, scaled), or the precomputed one of a sink under cache_relative.
  __device__ __forceinline__ float score(float computed, int seq, std::int64_t row, int head,
                                         std::int64_t pos) const {
    if (sink_scores == nullptr || pos < 0 || pos >= sinks) return computed;
    return sink_scores[((seq * sink_rows + row) * sink_heads + head) * sinks + pos];
  }
};

namespace detail {

/// Element <-> float on the device (to_f32 / from_f32), bit-exact with the CPU conversions (round
/// to nearest even).
template <Element T>
__device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, kvcache::half>) {
    return __half2float(__ushort_as_half(x.bits));
  } else {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
  }
}
template <Element T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T out;
    if constexpr (std::is_same_v<T, kvcache::half>) {
      out.bits = __half_as_ushort(__float2half_rn(x));
    } else {
      out.bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    return out;
  }
}

/// The key positions a sequence's view holds, as one logical list: [0, sink_end) then
/// [recent_begin, length). Logical index i maps to position pos(i).
struct KeyRange {
  std::int64_t sink_end = 0;
  std::int64_t recent_begin = 0;
  std::int64_t length = 0;
  __host__ __device__ __forceinline__ std::int64_t count() const {
    return sink_end + (length - recent_begin);
  }
  __host__ __device__ __forceinline__ std::int64_t pos(std::int64_t i) const {
    return i < sink_end ? i : recent_begin + (i - sink_end);
  }
};

template <Element T>
__device__ __forceinline__ KeyRange key_range(const DeviceKVView<T>& v, int seq) {
  KeyRange r;
  r.length = v.length[seq];
  r.sink_end = v.sink_end != nullptr ? v.sink_end[seq] : 0;
  r.recent_begin = v.recent_begin != nullptr ? v.recent_begin[seq] : 0;
  return r;
}

}  // namespace detail
}  // namespace kvcache::cuda
