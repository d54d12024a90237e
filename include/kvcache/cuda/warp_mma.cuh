// SPDX-License-Identifier: Apache-2.0
// Warp-level tensor-core primitives with documented register layouts (PTX ISA, "Matrix Fragments
// for mma.m16n8k16" and "ldmatrix"), for kernels that keep fragments in registers across steps,
// which wmma's opaque fragments do not allow. With g = lane / 4 and t = lane % 4:
// - A (16 x 16, row-major): a[0] = rows g, cols 2t, 2t+1; a[1] = row g+8, same cols; a[2], a[3]
//   = the same rows, cols + 8.
// - B (16 x 8, k x n): b[0] = rows (k) 2t, 2t+1 of col (n) g; b[1] = rows + 8.
// - C (16 x 8, fp32): c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8, same cols.
// A 32-bit register holds two 16-bit elements, the lower column (or row) in its low half.
// The test build replaces this header (tests/cuda_emu/include/kvcache/cuda/warp_mma.cuh) with an
// emulation of the same layouts.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kvcache/cuda/runtime.cuh"  // nvcc only

namespace kvcache::cuda::detail {

/// Shared-memory address of p for the instructions that take one.
__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// ldmatrix.x4: four 8 x 8 matrices of 16-bit elements, matrix i's row r (16 bytes) at the address
/// lane 8i + r passes; r[i] receives row lane / 4, elements 2 (lane % 4) and + 1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

/// ldmatrix.x4.trans: as ldmatrix_x4, transposed: r[i] receives rows 2 (lane % 4) and + 1,
/// element lane / 4, of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

/// c += a b, 16 x 8 x 16, S = __half or __nv_bfloat16 operands, fp32 accumulators.
template <class S>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<S, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<S, __nv_bfloat16>);
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

}  // namespace kvcache::cuda::detail
