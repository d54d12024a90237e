// SPDX-License-Identifier: Apache-2.0
// Decode attention on the GPU: a batch of sequences, one query token each, GQA (the query heads of
// one KV head share every K/V tile read), split-KV (flash-decoding) with a merge kernel for long
// contexts, fp32 accumulation, window and sink masks, contiguous, ring and paged layouts. This
// header gathers the kernels (decode_cuda_cores.cuh for fp32 K/V, decode_tensor_cores.cuh and
// decode_per_warp.cuh for fp16/bf16, decode_merge.cuh; int8 and fp8 codes go to the CUDA-core
// kernel, which reads them directly) and holds what queries a device for them:
// make_decode_setup and the workspace size on the current device. Planning is decode_plan.hpp.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/decode_common.cuh"
#include "kvcache/cuda/decode_cuda_cores.cuh"
#include "kvcache/cuda/decode_merge.cuh"
#include "kvcache/cuda/decode_per_warp.cuh"
#include "kvcache/cuda/decode_plan.hpp"
#include "kvcache/cuda/decode_tensor_cores.cuh"
#include "kvcache/cuda/kernels_common.cuh"
#include "kvcache/cuda/runtime.cuh"

namespace kvcache::cuda {

namespace detail {

/// Lets `kernel` use `bytes` of dynamic shared memory (beyond the default 48 KiB).
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
}

/// Queries the current device for `kernel` over T K/V and head_dim D (decode_attention_kernel<
/// T, D, G> for f32, int8, fp8 and pairs, decode_attention_mma_kernel<T, D> or
/// decode_attention_warp_kernel<T, D, G>) serving `group` query heads per KV head, raising its
/// shared-memory limit there.
/// @throws cuda_error.
template <KVFormat T, int D>
DecodeSetup query_decode_setup(int group, DecodeKernel kernel) {
  DecodeSetup setup{
      .dtype = dtype_of<key_format_t<T>>, .head_dim = D, .group = group, .kernel = kernel};
  if constexpr (!KVElement<T>) setup.value_dtype = dtype_of<value_format_t<T>>;
  check(cudaGetDevice(&setup.device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&setup.num_sms, cudaDevAttrMultiProcessorCount, setup.device),
        "cudaDeviceGetAttribute(multiProcessorCount)");
  const auto occupancy = [&](auto kernel) {
    allow_smem(kernel, setup.smem_bytes);
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&setup.blocks_per_sm, kernel,
                                                        kDecodeThreads, setup.smem_bytes),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  };
  if constexpr (kCudaCoreDecode<T>) {
    const int chunk_group = decode_chunk_group(group);
    setup.smem_bytes = decode_smem_bytes<T>(D, chunk_group, decode_stages<T, D>());
    dispatch_head_bucket(
        chunk_group, [&](auto g) { occupancy(decode_attention_kernel<T, D, decltype(g)::value>); });
  } else if (kernel == DecodeKernel::tensor_cores_per_warp) {
    constexpr int kMax = warp_decode_max_group(std::is_same_v<T, kvcache::half>, D);
    setup.smem_bytes = DecodeWarpLayout<T, D>::kBytes;
    dispatch_head_bucket(decode_chunk_group(group, kMax), [&](auto g) {
      if constexpr (decltype(g)::value <= kMax) {
        occupancy(decode_attention_warp_kernel<T, D, decltype(g)::value>);
      }
    });
  } else {
    setup.smem_bytes = DecodeMmaSmem<T, D>::kBytes;
    occupancy(decode_attention_mma_kernel<T, D>);
  }
  setup.blocks_per_sm = std::max(setup.blocks_per_sm, 1);
  return setup;
}

}  // namespace detail

/// The DecodeSetup of the current device for decode attention over T K/V with this head_dim and
/// num_q_heads / num_kv_heads query heads per KV head, launching `kernel`. Call it once per device
/// and model, after cudaSetDevice; pass it to every decode launch on that device
/// (DeviceAttendArgs::decode_setup).
/// @throws shape_error (head_dim not 64/128/256, num_q_heads not a multiple of num_kv_heads,
///         a kernel that does not serve T), cuda_error.
template <KVFormat T>
[[nodiscard]] DecodeSetup make_decode_setup(int num_q_heads, int num_kv_heads, int head_dim,
                                            DecodeKernel kernel = default_decode_kernel<T>) {
  detail::check_heads("CUDA decode setup", num_q_heads, num_kv_heads);
  detail::check_kernel<T>(kernel, "CUDA decode setup");
  DecodeSetup setup;
  detail::dispatch_head_dim(head_dim, [&](auto d) {
    setup = detail::query_decode_setup<T, decltype(d)::value>(num_q_heads / num_kv_heads, kernel);
  });
  return setup;
}

/// decode_workspace_bytes for the current device, its setup queried first.
/// @throws shape_error (as launch_decode_attention), cuda_error.
template <KVFormat T>
[[nodiscard]] std::size_t decode_workspace_bytes(int num_seqs, int num_q_heads, int num_kv_heads,
                                                 int head_dim, std::int64_t max_keys) {
  const DecodeSetup setup = make_decode_setup<T>(num_q_heads, num_kv_heads, head_dim);
  return decode_workspace_bytes<T>(setup, num_seqs, num_q_heads, num_kv_heads, head_dim, max_keys);
}

}  // namespace kvcache::cuda
