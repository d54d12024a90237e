#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check, for a machine with an NVIDIA GPU and nvcc: builds the CUDA backend, runs the CUDA
# tests (every kernel against the CPU reference) and the CUDA benchmark (decode bandwidth next to
# a device-to-device copy, prefill TFLOP/s). Finishes in a few minutes on an H200.
#
#   scripts/gpu-check.sh [build-dir]          (default build/cuda)
#
# Needs cmake >= 3.25, ninja, a C++20 host compiler and Catch2 (v2 or v3) findable by
# find_package: on a machine without network, point CMAKE_PREFIX_PATH at a copy of an installed
# Catch2 (e.g. Debian's /usr/include/catch2, /usr/lib/libCatch2WithMain.a, /usr/lib/cmake/Catch2).
# CUDA_ARCH overrides the architecture (default 90, Hopper).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build/cuda}"
start=$SECONDS

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVCACHE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
  -DKVCACHE_FETCH_DEPENDENCIES=OFF -DKVCACHE_BUILD_TESTS=ON -DKVCACHE_BUILD_BENCH=ON \
  -DKVCACHE_BUILD_EXAMPLES=OFF
cmake --build "$build" --target test.cuda.cuda_kernels_test cuda_attention_bench
echo "=== [$((SECONDS - start))s] CUDA tests"
ctest --test-dir "$build" -L cuda --output-on-failure
echo "=== [$((SECONDS - start))s] CUDA benchmark"
"$build/bench/cuda_attention_bench"
echo "=== [$((SECONDS - start))s] gpu-check done"
