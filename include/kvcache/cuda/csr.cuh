// SPDX-License-Identifier: Apache-2.0
// export_csr() of a paged DeviceCache: a batch's block tables as FlashInfer-style CSR arrays in
// device memory, gathered from the device's own block table in one launch per batch of
// sequences, on the caller's stream (manager/csr.hpp has the host form and the layout).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "kvcache/core/error.hpp"
#include "kvcache/cuda/cache.cuh"
#include "kvcache/manager/csr.hpp"

namespace kvcache::cuda {

/// Device arrays export_csr() fills; sizes as kvcache::csr_sizes() gives them.
struct DeviceCsr {
  std::int32_t* indptr = nullptr;         ///< [seqs + 1]
  std::int32_t* indices = nullptr;        ///< [total pages]
  std::int32_t* last_page_len = nullptr;  ///< [seqs]
  std::size_t indptr_size = 0, indices_size = 0, last_page_len_size = 0;
};

namespace detail {

inline constexpr int kMaxCsrSeqsPerLaunch = 1024;
struct CsrBatch {
  int count = 0;
  std::int32_t first = 0;  // index of entry 0 in the whole batch (its indptr slot)
  std::int32_t seq[kMaxCsrSeqsPerLaunch];
  std::int32_t begin[kMaxCsrSeqsPerLaunch];  // indptr of the entry
  std::int32_t pages[kMaxCsrSeqsPerLaunch];
  std::int32_t last[kMaxCsrSeqsPerLaunch];
};
static_assert(sizeof(CsrBatch) <= kMaxParamBatchBytes);

/// One block per sequence: its page ids from the block table, its indptr end and last length.
template <int = 0>  // a template so that several .cu files may include this (cuda.cuh)
__global__ void export_csr_kernel(const block_id* table, int max_blocks, std::int32_t* indptr,
                                  std::int32_t* indices, std::int32_t* last_page_len,
                                  CsrBatch batch) {
  const int i = blockIdx.x;
  const block_id* row = table + static_cast<std::int64_t>(batch.seq[i]) * max_blocks;
  for (int p = threadIdx.x; p < batch.pages[i]; p += blockDim.x) {
    indices[batch.begin[i] + p] = static_cast<std::int32_t>(row[p]);  // < 2^31: checked
  }
  if (threadIdx.x == 0) {
    const int at = batch.first + i;
    if (at == 0) indptr[0] = 0;
    indptr[at + 1] = batch.begin[i] + batch.pages[i];
    last_page_len[at] = batch.last[i];
  }
}

}  // namespace detail

/// kvcache::export_csr() of `layer` of seqs on a paged DeviceCache, into device arrays: page ids
/// of the layer's pool (DeviceCache::view(layer).k, [num_blocks][K, V][num_kv_heads]
/// [block_size][head_dim] for one format; for a KVFormats<K, V> pair view(layer).k and .v are
/// two pools, each [num_blocks][num_kv_heads][block_size][head_dim]). Asynchronous on `stream`,
/// after the cache's earlier operations on it; valid until the next operation that changes a listed
/// sequence. No allocation, no copy from the host (the metadata travels as kernel parameters).
/// Returns the sizes written.
/// @throws shape_error (not paged; arrays shorter than needed), layer_error, batch_error,
///         capacity_error (beyond int32), cuda_error; nothing is launched then.
template <KVFormat T>
CsrSizes export_csr(const DeviceCache<T>& cache, std::size_t layer,
                    std::span<const std::size_t> seqs, const DeviceCsr& out, cudaStream_t stream) {
  const BlockManager<>& m = cache.paged();
  const CsrSizes need = csr_sizes(m, layer, seqs);
  if (out.indptr_size < need.indptr || out.indices_size < need.indices ||
      out.last_page_len_size < need.last_page_len) {
    throw shape_error(kvcache::detail::message(
        "DeviceCache: export_csr of ", seqs.size(), " sequences needs indptr ", need.indptr,
        ", indices ", need.indices, ", last_page_len ", need.last_page_len, " entries, got ",
        out.indptr_size, ", ", out.indices_size, ", ", out.last_page_len_size));
  }
  constexpr auto kMax = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
  if (need.indices > kMax || seqs.size() > kMax) {
    throw capacity_error(kvcache::detail::message("DeviceCache: export_csr of ", need.indices,
                                                  " pages exceeds int32"));
  }
  const DeviceKVView<T> view = cache.view(layer);
  const std::size_t bs = m.block_size();
  detail::CsrBatch batch;
  std::size_t at = 0;
  const auto flush = [&] {
    if (batch.count == 0) return;
    detail::export_csr_kernel<><<<batch.count, 128, 0, stream>>>(
        view.block_table, view.max_blocks, out.indptr, out.indices, out.last_page_len, batch);
    check_launch("kvcache::cuda::export_csr_kernel");
    batch.first += batch.count;
    batch.count = 0;
  };
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    if (batch.count == detail::kMaxCsrSeqsPerLaunch) flush();
    const std::size_t len = m.layer_length(layer, seqs[i]);
    const std::size_t pages = (len + bs - 1) / bs;
    const int k = batch.count++;
    batch.seq[k] = static_cast<std::int32_t>(seqs[i]);
    batch.begin[k] = static_cast<std::int32_t>(at);
    batch.pages[k] = static_cast<std::int32_t>(pages);
    batch.last[k] = static_cast<std::int32_t>(len - (pages == 0 ? 0 : (pages - 1) * bs));
    at += pages;
  }
  flush();
  if (seqs.empty()) {  // indptr = {0}: one element, nothing to gather
    check(cudaMemsetAsync(out.indptr, 0, sizeof(std::int32_t), stream), "cudaMemsetAsync(indptr)");
  }
  return need;
}

}  // namespace kvcache::cuda
