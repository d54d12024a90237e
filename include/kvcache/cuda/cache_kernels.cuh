// SPDX-License-Identifier: Apache-2.0
// The kernels behind DeviceCache's bookkeeping: scatter appended rows, write per-sequence
// metadata and block-table entries, copy blocks (copy-on-write). Their arguments travel as kernel
// parameters in fixed-size batches, so no host-to-device copy or synchronisation is needed.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstdint>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/cuda/kernels_common.cuh"
#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda {

/// Most sequences one append launch covers (its metadata travels as kernel parameters, which
/// CUDA 12.1+ allows up to 32 764 bytes on Volta and later); larger batches take several launches.
inline constexpr int kMaxSeqsPerLaunch = 512;
/// Bytes of kernel parameters a launch may pass (CUDA 12.1+, sm_70+), less room for the others.
inline constexpr std::size_t kMaxParamBatchBytes = 32764 - 512;

namespace detail {

struct AppendBatch {
  int num_seqs = 0;
  std::int32_t seq[kMaxSeqsPerLaunch];
  std::int64_t first_pos[kMaxSeqsPerLaunch];
  std::int32_t
      token_begin[kMaxSeqsPerLaunch + 1];  // tokens of batch entry i: [begin[i], begin[i+1])
};

struct MetaEntry {
  std::int32_t layer, seq;
  std::int64_t length, sink_end, recent_begin;
};
inline constexpr int kMaxMetaPerLaunch = 512;
struct MetaBatch {
  int count = 0;
  MetaEntry entry[kMaxMetaPerLaunch];
};

struct BlockEntry {
  std::int32_t seq, index;
  block_id block;
};
inline constexpr int kMaxBlocksPerLaunch = 1024;  // entries: at most a block of threads
struct BlockBatch {
  int count = 0;
  BlockEntry entry[kMaxBlocksPerLaunch];
};

static_assert(sizeof(AppendBatch) <= kMaxParamBatchBytes);
static_assert(sizeof(MetaBatch) <= kMaxParamBatchBytes);
static_assert(sizeof(BlockBatch) <= kMaxParamBatchBytes);

/// Quantizes one row of d floats into codes and its scale as quantize_row() does on the host, bit
/// for bit, with the threads of one warp (blockDim.x == 32): the largest magnitude reduced over
/// the warp, then each lane encodes every 32nd value.
template <QuantizedElement T>
__device__ __forceinline__ void quantize_row_warp(const float* __restrict__ in, int d, T* out,
                                                  scale_type* scale) {
  const int lane = static_cast<int>(threadIdx.x);
  float amax = 0.0f;
  for (int x = lane; x < d; x += 32) amax = row_amax_step(amax, in[x]);
  amax = warp_max(amax);  // row_amax_step never gives NaN; inf marks a non-finite row
  const scale_type s = row_scale<T>(amax);
  if (lane == 0) *scale = s;
  const auto sf = static_cast<float>(s);
  for (int x = lane; x < d; x += 32) out[x] = encode_in_row<T>(in[x], sf);
}

/// Threads per block of append_kernel over T: a warp where a side is quantized (a row's scale is a
/// warp reduction), 64 otherwise.
template <KVFormat T>
inline constexpr int kAppendThreads =
    scaled_v<key_format_t<T>> || scaled_v<value_format_t<T>> ? 32 : 64;

/// Writes one row of d values from `in` (float, or U = E) as E at `out`: the codes and the scale
/// (at `scale`) of a quantized E, with the block's threads (kAppendThreads).
template <KVElement E, class U>
__device__ __forceinline__ void append_row(const U* __restrict__ in, int d, E* out,
                                           scale_type* scale) {
  if constexpr (scaled_v<E>) {
    static_assert(std::is_same_v<U, float>, "quantized sides take float rows");
    quantize_row_warp(in, d, out, scale);
  } else {
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
      if constexpr (std::is_same_v<U, E>) {
        out[x] = in[x];
      } else {
        out[x] = from_f32<E>(in[x]);
      }
    }
  }
}

/// Grid (tokens of the batch, KV heads), kAppendThreads<T> threads: converts and writes one K row
/// into k_out and one V row into v_out at the same element offset (a quantized side: codes, and
/// the scales into ks_out / vs_out, indexed by row offset / head_dim; unused otherwise).
template <KVFormat T, class U>
__global__ void append_kernel(DeviceKVView<T> view, key_format_t<T>* k_out,
                              value_format_t<T>* v_out, scale_type* ks_out, scale_type* vs_out,
                              const U* __restrict__ k, const U* __restrict__ v, AppendBatch batch) {
  const int token = blockIdx.x, head = blockIdx.y;
  int entry = 0, hi = batch.num_seqs - 1;  // the last entry whose tokens begin at or before token
  while (entry < hi) {
    const int mid = (entry + hi + 1) / 2;
    if (batch.token_begin[mid] <= token) {
      entry = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int seq = batch.seq[entry];
  const std::int64_t pos = batch.first_pos[entry] + (token - batch.token_begin[entry]);
  const std::int64_t dst = view.row_offset(seq, head, pos);
  const std::int64_t src =
      (static_cast<std::int64_t>(token) * view.num_kv_heads + head) * view.head_dim;
  const std::int64_t row = dst / view.head_dim;
  append_row(k + src, view.head_dim, k_out + dst, ks_out != nullptr ? ks_out + row : nullptr);
  append_row(v + src, view.head_dim, v_out + dst, vs_out != nullptr ? vs_out + row : nullptr);
}

/// The threads of a launch of update_meta_kernel or update_blocks_kernel: one per entry, in whole
/// warps (one block of at most 1024).
inline unsigned entry_threads(int count) noexcept {
  return static_cast<unsigned>((count + 31) / 32 * 32);
}

/// Writes (length, sink_end, recent_begin) entries into the device metadata [layer][3][batch].
template <int = 0>  // a template so that several .cu files may include this (cuda.cuh)
__global__ void update_meta_kernel(std::int64_t* meta, int max_batch, MetaBatch batch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.count) return;
  const MetaEntry e = batch.entry[i];
  std::int64_t* m = meta + static_cast<std::int64_t>(e.layer) * 3 * max_batch;
  m[e.seq] = e.length;
  m[max_batch + e.seq] = e.sink_end;
  m[2 * max_batch + e.seq] = e.recent_begin;
}

template <int = 0>  // a template so that several .cu files may include this (cuda.cuh)
__global__ void update_blocks_kernel(block_id* table, int max_blocks, BlockBatch batch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.count) return;
  const BlockEntry e = batch.entry[i];
  table[static_cast<std::int64_t>(e.seq) * max_blocks + e.index] = e.block;
}

}  // namespace detail

namespace detail {

struct CopyEntry {
  std::int32_t from, to;
};
inline constexpr int kMaxCopiesPerLaunch = 2048;
struct CopyBatch {
  int count = 0;
  CopyEntry entry[kMaxCopiesPerLaunch];
};
static_assert(sizeof(CopyBatch) <= kMaxParamBatchBytes);

/// Grid (copies, layers): block batch.entry[x].from of layer y into block .to, whole: the
/// `block_bytes` bytes one block holds in an array of the storage (rows of K and V, or a side's
/// rows, or their scales: KVRows::for_each_array), 16 bytes at a time where the block allows it.
template <int = 0>  // a template so that several .cu files may include this (cuda.cuh)
__global__ void copy_blocks_kernel(unsigned char* array, std::int64_t layer_bytes,
                                   std::int64_t block_bytes, CopyBatch batch) {
  const CopyEntry e = batch.entry[blockIdx.x];
  const std::int64_t layer = blockIdx.y;
  const unsigned char* src = array + layer * layer_bytes + e.from * block_bytes;
  unsigned char* dst = array + layer * layer_bytes + e.to * block_bytes;
  if (block_bytes % 16 == 0) {  // the arrays are 256-byte aligned, so are their blocks then
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (std::int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace detail
}  // namespace kvcache::cuda
