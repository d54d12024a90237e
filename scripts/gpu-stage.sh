#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Stages a GPU check for a machine with a GPU but without the test dependencies or a network (a
# lent, bare GPU machine): builds the CUDA test and benchmark here into .gpu/bin (libstdc++ and
# libgcc linked statically, the CUDA runtime copied beside them), and copies this machine's Catch2
# into .gpu/deps so that gpu-check.sh can also build from source there. Needs nvcc, cmake, ninja
# and Catch2 here.
#
#   scripts/gpu-stage.sh                        (here; writes .gpu/, which git ignores)
#   scripts/gpu-check.sh --prebuilt .gpu/bin    (there: runs the staged binaries)
#   scripts/gpu-check.sh                        (there: builds with .gpu/deps, then runs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/gpu-stage

bash scripts/cuda-build.sh "$build" -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc"

rm -rf .gpu
mkdir -p .gpu/bin .gpu/deps/include .gpu/deps/lib/cmake
cp "$build/tests/cuda/test.cuda.cuda_kernels_test" "$build/tests/cuda/test.cuda.device_paged_test" \
  "$build/bench/cuda_attention_bench" .gpu/bin/
cudart=$(ldd .gpu/bin/cuda_attention_bench | awk '/libcudart/ {print $3}')
[ -n "$cudart" ] && cp -L "$cudart" .gpu/bin/

# Catch2 as an install prefix (v2 from Debian: header, CMake package, Catch2WithMain).
catch2_config=$(find /usr/lib /usr/local/lib /usr/share -name Catch2Config.cmake -print -quit 2>/dev/null)
if [ -z "$catch2_config" ]; then
  echo "gpu-stage: no installed Catch2 found (apt-get install catch2); .gpu/deps not staged" >&2
  exit 1
fi
catch2_dir=$(dirname "$catch2_config")
prefix=$(cd "$catch2_dir/../../.." && pwd)
cp -r "$catch2_dir" .gpu/deps/lib/cmake/
cp -r "$prefix/include/catch2" .gpu/deps/include/
cp "$prefix"/lib/libCatch2*.a .gpu/deps/lib/ 2>/dev/null || true

echo "staged:"
du -sh .gpu/bin/* .gpu/deps
