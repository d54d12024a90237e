#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The AArch64 build, on an x86-64 Debian machine: the public headers under the strict warning set,
# a consumer program, and the attention tests that run every CPU kernel (portable and NEON)
# against the reference, cross-compiled with g++-aarch64-linux-gnu and run under qemu-aarch64.
# Needs: apt-get install g++-aarch64-linux-gnu qemu-user catch2 (Catch2 v2's single header).
# Usage: scripts/aarch64-check.sh [build-dir]   (default build/aarch64)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/aarch64}"
mkdir -p "$out/include"

strict=(-Wall -Wextra -Wpedantic -Wconversion -Wsign-conversion -Wshadow -Wdouble-promotion
        -Wold-style-cast -Werror)
cxx=(aarch64-linux-gnu-g++ -std=c++20 -Iinclude)
run=(qemu-aarch64 -L /usr/aarch64-linux-gnu)

# The kernel tests need Catch2 v2's header only; the host's /usr/include cannot be on a cross
# compiler's path (its glibc headers are x86-64's), so only catch2/ is linked in.
if [ ! -f /usr/include/catch2/catch.hpp ]; then
  echo "aarch64-check: /usr/include/catch2/catch.hpp not found (apt-get install catch2)" >&2
  exit 1
fi
ln -sfn /usr/include/catch2 "$out/include/catch2"
printf '#define CATCH_CONFIG_MAIN\n#include <catch2/catch.hpp>\n' > "$out/catch_main.cpp"
test_cxx=("${cxx[@]}" -O2 -Itests -I"$out/include" -DKVCACHE_CATCH2_MAJOR=2 -Wall -Wextra -Werror)
# The kernels are compiled once (src/kernels.cpp, as the native build's kvcache_kernels) and
# linked into every test, which is compiled with KVCACHE_EXTERN_KERNELS. Beside that compile (the
# longest), on the other core: the headers under the strict warnings, the consumer (which runs),
# and Catch2's main.
"${test_cxx[@]}" -c src/kernels.cpp -o "$out/kernels.o" &
kernels=$!
"${cxx[@]}" "${strict[@]}" -c tests/consumer/strict_warnings.cpp -o "$out/strict_warnings.o"
"${cxx[@]}" "${strict[@]}" -O2 tests/consumer/consumer_main.cpp -o "$out/consumer" -pthread
"${run[@]}" "$out/consumer"
[ -f "$out/catch_main.o" ] || "${test_cxx[@]}" -c "$out/catch_main.cpp" -o "$out/catch_main.o"
wait "$kernels"
tests=(attention_test quantized_attention_test mixed_format_test nonfinite_test
       batch_invariance_test)
# Two compilers at a time: each test is one translation unit.
printf '%s\n' "${tests[@]}" | xargs -P 2 -I{} \
  "${test_cxx[@]}" -DKVCACHE_EXTERN_KERNELS tests/attention/{}.cpp "$out/kernels.o" \
  "$out/catch_main.o" -o "$out/{}" -pthread

# Runs test $1 under qemu with Catch2 arguments $2..; prints its summary, or its log on failure.
run_test() {
  local t=$1
  shift
  local name="$t${*:+ $*}"  # the test and its Catch2 arguments, if any
  if "${run[@]}" "$out/$t" "$@" > "$out/$t.log" 2>&1; then
    echo "--- $name (qemu-aarch64): $(grep -E '^(All tests passed|test cases)' "$out/$t.log")"
  else
    echo "--- $name (qemu-aarch64) FAILED:"
    cat "$out/$t.log"
    return 1
  fi
}
# Two runs side by side: attention_test's NEON cases (its portable and x86 cases run natively in
# the test preset, and its reference in double is slow under emulation), and the others whole
# (each runs every kernel the build has: portable and NEON; mixed_format_test each K/V pair).
run_test attention_test '[neon]' &
first=$!
rest=0
for t in quantized_attention_test mixed_format_test nonfinite_test batch_invariance_test; do
  run_test "$t" || rest=1
done
wait "$first"
exit "$rest"
