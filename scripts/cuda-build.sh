#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Configures and builds what the GPU check runs (the CUDA test and cuda_attention_bench) with the
# dependencies find_package finds (no fetching: GPU machines may have no network). Shared by
# gpu-check.sh and gpu-stage.sh. CUDA_ARCH overrides the architecture (default 90, Hopper).
# -lineinfo (source lines for compute-sanitizer's reports; the same machine code) is the default
# CMAKE_CUDA_FLAGS; a -DCMAKE_CUDA_FLAGS=... argument replaces it.
#
#   scripts/cuda-build.sh BUILD_DIR [extra cmake -D arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:?usage: cuda-build.sh BUILD_DIR [cmake arguments]}"
shift
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVCACHE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
  -DKVCACHE_FETCH_DEPENDENCIES=OFF -DKVCACHE_BUILD_TESTS=ON -DKVCACHE_BUILD_BENCH=ON \
  -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_CHECK_HEADERS=OFF -DCMAKE_CUDA_FLAGS=-lineinfo "$@"
cmake --build "$build" --target test.cuda.cuda_kernels_test test.cuda.device_paged_test \
  cuda_attention_bench
