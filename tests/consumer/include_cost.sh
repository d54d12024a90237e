#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What `#include <kvcache/kvcache.hpp>` costs a translation unit, as a ratio to the front-end time
# of <memory> + <string> + <vector> measured in the same run (the compiler's CPU time, user +
# system, with -fsyntax-only: the least of RUNS alternated runs each, so that tests running
# beside it on other cores change little): once as a program that compiles the kernels once
# (KVCACHE_EXTERN_KERNELS: no kernel bodies, no intrinsic headers) and once self-contained (the
# default: every kernel and the intrinsic headers parsed). Fails when the first ratio exceeds
# MAX_EXTERN_RATIO, so that a heavy include creeping into the common headers shows up here.
# Usage: include_cost.sh CXX INCLUDE_DIR MAX_EXTERN_RATIO [RUNS]
set -euo pipefail
cxx=$1 include_dir=$2 max_ratio=$3 runs=${4:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#include <memory>\n#include <string>\n#include <vector>\n' >"$work/baseline.cpp"
printf '#include <kvcache/kvcache.hpp>\n' >"$work/kvcache.cpp"

# Microseconds of CPU time (user + system) one -fsyntax-only compile of the given arguments takes.
elapsed_us() {
  local TIMEFORMAT='%3U %3S' cpu
  cpu=$({ time "$cxx" -std=c++20 -fsyntax-only -I"$include_dir" "$@"; } 2>&1) || {
    printf '%s\n' "$cpu" >&2
    return 1
  }
  awk '{ printf "%d\n", ($(NF - 1) + $NF) * 1e6 }' <<<"$cpu"
}

base=0 extern=0 full=0
for ((i = 0; i < runs; ++i)); do
  b=$(elapsed_us "$work/baseline.cpp")
  e=$(elapsed_us -DKVCACHE_EXTERN_KERNELS "$work/kvcache.cpp")
  f=$(elapsed_us "$work/kvcache.cpp")
  if ((i == 0 || b < base)); then base=$b; fi
  if ((i == 0 || e < extern)); then extern=$e; fi
  if ((i == 0 || f < full)); then full=$f; fi
done
awk -v b="$base" -v e="$extern" -v f="$full" -v max="$max_ratio" 'BEGIN {
  printf "kvcache.hpp front-end CPU time over <memory>+<string>+<vector> (%.2f s, least of runs):\n", b / 1e6
  printf "  with KVCACHE_EXTERN_KERNELS %.2fx (fails above %.2fx)\n", e / b, max
  printf "  self-contained (every kernel) %.2fx\n", f / b
  if (e / b > max) { print "include cost above the bound"; exit 1 }
}'
