#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check, for a machine with an NVIDIA GPU: builds the CUDA backend, runs the CUDA tests
# (every kernel against the CPU reference) and the CUDA benchmark (decode bandwidth next to a
# device-to-device copy, prefill TFLOP/s), and runs compute-sanitizer's memcheck and racecheck
# over the fp16 device tests where the driver lets it (it cannot under gVisor: then it says so and
# goes on). A few minutes on an H200.
#
#   scripts/gpu-check.sh [build-dir]            build (default build/cuda), test, benchmark
#   scripts/gpu-check.sh --prebuilt DIR         test and benchmark binaries staged elsewhere
#                                               (scripts/gpu-stage.sh writes them to .gpu/bin)
#
# Building needs nvcc, cmake >= 3.25, ninja, a C++20 host compiler and Catch2 (v2 or v3) that
# find_package finds; without a network, scripts/gpu-stage.sh on another machine copies its
# Catch2 into .gpu/deps, which this script adds to CMAKE_PREFIX_PATH (see scripts/cuda-build.sh;
# CUDA_ARCH overrides the architecture, default 90, Hopper).
#
# No CUDA device fails the tests and the benchmark (KVCACHE_REQUIRE_CUDA_DEVICE=1, so that a
# driver problem on a GPU machine cannot pass as a skip); KVCACHE_REQUIRE_CUDA_DEVICE=0 lets
# them skip instead (CI runs the script that way on a machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
export KVCACHE_REQUIRE_CUDA_DEVICE="${KVCACHE_REQUIRE_CUDA_DEVICE:-1}"
tests_rc=0  # a test failure still lets the benchmark run; the script's status reports it
bench_rc=0
sanitize_rc=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
if [ "${1:-}" = "--prebuilt" ]; then
  bin="${2:?--prebuilt needs the directory of the staged binaries}"
  test_bin="$bin/test.cuda.cuda_kernels_test"
  paged_bin="$bin/test.cuda.device_paged_test"
  bench_bin="$bin/cuda_attention_bench"
  export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # the staged CUDA runtime
  echo "=== [$((SECONDS - start))s] CUDA tests (prebuilt $test_bin, $paged_bin)"
  "$test_bin" || tests_rc=$?
  "$paged_bin" || tests_rc=$?
else
  build="${1:-build/cuda}"
  prefix_path="${CMAKE_PREFIX_PATH:-}"
  [ -d .gpu/deps ] && prefix_path="$PWD/.gpu/deps${prefix_path:+;$prefix_path}"
  bash scripts/cuda-build.sh "$build" -DCMAKE_PREFIX_PATH="$prefix_path"
  echo "=== [$((SECONDS - start))s] CUDA tests"
  ctest --test-dir "$build" -L '^cuda$' --output-on-failure || tests_rc=$?
  test_bin="$build/tests/cuda/test.cuda.cuda_kernels_test"
  paged_bin="$build/tests/cuda/test.cuda.device_paged_test"
  bench_bin="$build/bench/cuda_attention_bench"
fi
echo "=== [$((SECONDS - start))s] CUDA benchmark"
"$bench_bin" || bench_rc=$?

# The fp16 cases launch every kernel (append, decode with and without splits, merge, prefill) at
# every head_dim and layout; the builds carry -lineinfo, so reports name source lines.
sanitized="CUDA append stores exactly what the CPU cache stores - kvcache::half"
sanitized+=",CUDA append of a batch wider than one launch stores every sequence"
sanitized+=",CUDA decode attention equals the CPU reference - kvcache::half"
sanitized+=",CUDA prefill attention equals the CPU reference - kvcache::half"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "${KVCACHE_GPU_SANITIZE:-1}" = 0 ] || [ ! -x "$sanitizer" ]; then
  echo "=== compute-sanitizer not run (KVCACHE_GPU_SANITIZE=0, or not found)"
else
  for tool in memcheck racecheck; do
    echo "=== [$((SECONDS - start))s] compute-sanitizer --tool $tool"
    rc=0
    "$sanitizer" --tool "$tool" --error-exitcode 86 "$test_bin" "$sanitized" || rc=$?
    # the paged cache's copy-on-write and table updates (one binary of its own)
    [ "$rc" = 0 ] && { "$sanitizer" --tool "$tool" --error-exitcode 86 "$paged_bin" || rc=$?; }
    if [ "$rc" = 86 ]; then
      sanitize_rc=86  # hazards or memory errors (racecheck counts its warnings too)
    elif [ "$rc" != 0 ]; then
      # the tool refused the device (gVisor), or the tests failed under it (the run above says)
      echo "=== compute-sanitizer --tool $tool ended with status $rc, not a finding: not counted"
    fi
  done
fi

verdict() { [ "$1" = 0 ] && echo passed || echo "FAILED, status $1"; }
echo "=== [$((SECONDS - start))s] gpu-check done (CUDA tests: $(verdict "$tests_rc");" \
  "benchmark: $(verdict "$bench_rc"); compute-sanitizer: $(verdict "$sanitize_rc"))"
[ "$tests_rc" = 0 ] || exit "$tests_rc"
[ "$bench_rc" = 0 ] || exit "$bench_rc"
exit "$sanitize_rc"
