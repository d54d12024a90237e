#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's figures: short runs of the benchmarks, written as JSON (Google Benchmark's
# --benchmark_out, and memory_curve's), turned into tables (scripts/figures/tables.py) and drawn
# by gnuplot (scripts/figures/*.gp) as the SVGs in docs/figures/. A few minutes on 2 cores.
#
#   cmake --workflow --preset figures     build the benchmarks (build/release), then this script
#   scripts/figures.sh [BENCH_DIR]        run the benchmarks in BENCH_DIR (default
#                                         build/release/bench), then draw
#   scripts/figures.sh --replot [BENCH_DIR]   draw again from the last run's JSON (BENCH_DIR/figures)
#
# Each figure names the machine (CPU model from /proc/cpuinfo, cores) and the commit it was
# measured on. Needs gnuplot (5.4 or later) and python3 (standard library only).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

replot=0
if [ "${1:-}" = "--replot" ]; then
  replot=1
  shift
fi
bench_dir="${1:-build/release/bench}"
json_dir="$bench_dir/figures"
out_dir=docs/figures

missing=()
bins_missing=0
command -v gnuplot > /dev/null || missing+=("gnuplot (Debian/Ubuntu: apt-get install -y gnuplot-nox; macOS: brew install gnuplot)")
command -v python3 > /dev/null || missing+=("python3 (Debian/Ubuntu: apt-get install -y python3)")
if [ "$replot" = 0 ]; then
  for bin in attention_bench ttft_bench memory_curve; do
    [ -x "$bench_dir/$bin" ] || { missing+=("$bench_dir/$bin"); bins_missing=1; }
  done
elif [ ! -f "$json_dir/meta.gp" ]; then
  missing+=("$json_dir/meta.gp and the JSON next to it (run scripts/figures.sh without --replot first)")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  {
    echo "figures.sh: missing:"
    printf '  %s\n' "${missing[@]}"
    [ "$bins_missing" = 0 ] && exit 1
    echo "The benchmarks are built by 'cmake --workflow --preset figures' (which then runs this"
    echo "script), or by: cmake --preset release && cmake --build --preset release --target" \
      "attention_bench ttft_bench memory_curve"
    echo "(they need Google Benchmark: apt-get install -y libbenchmark-dev, or let CMake fetch it)."
  } >&2
  exit 1
fi
if ! gnuplot -e 'set terminal' 2>&1 | grep -qw svg; then
  echo "figures.sh: this gnuplot has no svg terminal (Debian: apt-get install -y gnuplot-nox)" >&2
  exit 1
fi

if [ "$replot" = 0 ]; then
  mkdir -p "$json_dir"
  rm -f "$json_dir"/*.json
  # The machine and the commit, for the figures' footnotes.
  cpu=$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo 2> /dev/null | head -n 1)
  cores=$(lscpu -p=core 2> /dev/null | grep -v '^#' | sort -u | wc -l || true)
  threads=$(nproc)
  [ "${cores:-0}" -gt 0 ] || cores=$threads
  machine="${cpu:-unknown CPU}, $cores cores"
  [ "$threads" = "$cores" ] || machine="$machine ($threads threads)"
  commit=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
  if ! git diff --quiet HEAD -- include bench examples CMakeLists.txt 2> /dev/null; then
    commit="$commit + uncommitted changes"
  fi
  {
    echo "machine = \"$machine\""
    echo "commit = \"$commit\""
    echo "measured = \"$(date -u +%Y-%m-%d)\""
  } > "$json_dir/meta.gp"

  gb_out() { echo "--benchmark_out=$json_dir/$1 --benchmark_out_format=json"; }

  # 1. Decode bandwidth (fp16 K/V) against context, each kernel and thread count, next to the
  #    memory-read baseline measured alternately in the same run.
  echo "== decode attention bandwidth (attention_bench)"
  # shellcheck disable=SC2046
  "$bench_dir/attention_bench" $(gb_out decode.json) --benchmark_min_time=0.3 \
    '--benchmark_filter=^BM_DecodeAttention<kvcache::half>/context:(1024|4096|16384|32768)/'

  # 2. TTFT of a 64-token request over a cached prefix of each length, the same request
  #    uncached, and the 64 tokens alone into an empty cache (the floor), each in one run.
  for prefix in 256 512 1024 2048; do
    echo "== TTFT, $prefix-token prefix (ttft_bench)"
    # shellcheck disable=SC2046
    "$bench_dir/ttft_bench" --synthetic=8L-1024d-16h-4kv --prefix="$prefix" \
      $(gb_out "ttft_$prefix.json") --benchmark_min_time=0.5
  done

  # 3. memory_bytes() against tokens for each policy (deterministic).
  echo "== memory_bytes() per policy (memory_curve)"
  "$bench_dir/memory_curve" > "$json_dir/memory.json"
fi

python3 scripts/figures/tables.py "$json_dir" "$json_dir/tables"
mkdir -p "$out_dir"
for fig in decode_bandwidth ttft_prefix memory_policies; do
  gnuplot -e "tables='$json_dir/tables'; out='$out_dir/$fig.svg'" \
    -e "load '$json_dir/meta.gp'; load '$json_dir/tables/vars.gp'" "scripts/figures/$fig.gp"
done
for svg in "$out_dir"/*.svg; do
  echo "figures.sh: wrote $svg ($(($(wc -c < "$svg") / 1024)) KiB)"
done
echo "figures.sh: done in $((SECONDS - start)) s"
