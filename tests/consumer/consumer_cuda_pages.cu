// SPDX-License-Identifier: Apache-2.0
// A second translation unit of the CUDA engine (tests/consumer/cuda), including the CUDA headers
// again: the link proves that several .cu files of one program may include them (each kernel is
// a function template; see kvcache/cuda/cuda.cuh).
#include <cstddef>
#include <kvcache/cuda/cuda.cuh>
#include <kvcache/cuda/snapshot.cuh>
#include <span>

namespace kc = kvcache::cuda;

/// The block tables of `seqs` in layer 0 as FlashInfer-style CSR arrays, for the engine's own
/// attention kernels.
kvcache::CsrSizes export_pages(const kc::DeviceCache<kvcache::half>& cache,
                               std::span<const std::size_t> seqs, const kc::DeviceCsr& out,
                               cudaStream_t stream) {
  return kc::export_csr(cache, 0, seqs, out, stream);
}
