// SPDX-License-Identifier: Apache-2.0
// Umbrella header of the CUDA backend (compile with nvcc; target kvcache::cuda).
//
// Any number of a program's .cu files may include these headers: every kernel in them is a
// function template (nvcc ignores `inline` on a __global__ function, so a non-template kernel
// defined in a header would be defined again in each translation unit and fail to link).
// tests/consumer/cuda links two such translation units.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include "kvcache/cuda/attend.cuh"
#include "kvcache/cuda/cache.cuh"
#include "kvcache/cuda/context_shift.cuh"
#include "kvcache/cuda/csr.cuh"
#include "kvcache/cuda/decode.cuh"
#include "kvcache/cuda/prefill.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"
