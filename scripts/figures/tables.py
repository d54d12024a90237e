# SPDX-License-Identifier: Apache-2.0
# Turns the benchmarks' JSON (Google Benchmark --benchmark_out, and memory_curve's) into the data
# tables and variables the gnuplot scripts next to this file draw. Called by scripts/figures.sh.
#
#   python3 tables.py JSON_DIR OUT_DIR
import json
import re
import sys
from pathlib import Path


def runs(path):
    """The iteration runs of one Google Benchmark JSON file (no aggregates, no errors)."""
    data = json.loads(Path(path).read_text())
    return [b for b in data["benchmarks"]
            if b.get("run_type", "iteration") == "iteration" and not b.get("error_occurred")]


def ms(run):
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[run["time_unit"]]
    return run["real_time"] * scale


def gp_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def decode(json_dir, out_dir):
    """One block per (kernel, threads): context, attention GB/s, memory-read GB/s, ratio."""
    name = re.compile(r"^BM_DecodeAttention<(?:kvcache::)?(\w+)>/context:(\d+)/threads:(\d+)/simd:(\d+)")
    series = {}
    for run in runs(json_dir / "decode.json"):
        m = name.match(run["name"])
        if not m:
            continue
        dtype, context, threads, simd = m[1], int(m[2]), int(m[3]), int(m[4])
        series.setdefault((simd, threads, dtype), []).append(
            (context, run["bytes_per_second"] / 1e9, run["read_GBps"], run["ratio"]))
    if not series:
        sys.exit("tables.py: no BM_DecodeAttention runs in decode.json")
    blocks, titles = [], []
    for (simd, threads, dtype), rows in sorted(series.items()):
        kernel = "avx512" if simd == 512 else "avx2"
        titles.append(f"{kernel}, {threads} thread{'s' if threads > 1 else ''}")
        lines = [f"# {titles[-1]}: context attention_GBps read_GBps ratio"]
        lines += [f"{c} {a:.3f} {r:.3f} {q:.4f}" for c, a, r, q in sorted(rows)]
        blocks.append("\n".join(lines))
    (out_dir / "decode.dat").write_text("\n\n\n".join(blocks) + "\n")
    return {"decode_titles": titles}


def ttft(json_dir, out_dir):
    """prefix, uncached ms, cached ms, speedup, and the suffix alone (the floor), all ms."""
    rows, mismatches = {}, []
    for path in sorted(json_dir.glob("ttft_*.json")):
        for run in runs(path):
            kind = run["name"].split("/")[1]
            if m := re.fullmatch(r"uncached_(\d+)", kind):
                rows.setdefault(path.name, {})["uncached"] = ms(run)
            elif m := re.fullmatch(r"cached_(\d+)\+(\d+)", kind):
                rows.setdefault(path.name, {}).update(prefix=int(m[1]), suffix=int(m[2]),
                                                      cached=ms(run))
                if run.get("logits_match", 1) != 1:
                    mismatches.append(int(m[1]))
            elif kind.startswith("empty_cache_"):
                rows.setdefault(path.name, {})["empty"] = ms(run)
    table = sorted((r["prefix"], r["uncached"], r["cached"], r.get("empty", -1))
                   for r in rows.values() if {"prefix", "uncached", "cached"} <= r.keys())
    if not table:
        sys.exit("tables.py: no TTFT/cached_* and TTFT/uncached_* runs in ttft_*.json")
    if mismatches:
        sys.exit(f"tables.py: cached logits differ from uncached at prefix {mismatches}")
    lines = ["# prefix uncached_ms cached_ms speedup suffix_alone_ms (-1: not measured)"]
    lines += [f"{p} {u:.3f} {c:.3f} {u / c:.2f} {e:.3f}" for p, u, c, e in table]
    (out_dir / "ttft.dat").write_text("\n".join(lines) + "\n")
    return {"ttft_suffix": next(r["suffix"] for r in rows.values() if "suffix" in r)}


def memory(json_dir, out_dir):
    """One block per policy: tokens per sequence, GiB."""
    data = json.loads((json_dir / "memory.json").read_text())
    blocks = []
    for curve in data["curves"]:
        lines = [f"# {curve['policy']}: tokens_per_sequence GiB"]
        lines += [f"{t} {b / 2**30:.6f}" for t, b in curve["points"]]
        blocks.append("\n".join(lines))
    (out_dir / "memory.dat").write_text("\n\n\n".join(blocks) + "\n")
    s = data["shape"]
    return {"mem_titles": [c["label"] for c in data["curves"]], "mem_pool_gib": s["paged_pool_bytes"] / 2**30,
            "mem_shape": f"{s['sequences']} sequences sharing a {s['shared_prompt']}-token prompt; "
                         f"{s['num_layers']} layers, {s['num_kv_heads']} KV heads, head_dim "
                         f"{s['head_dim']}, fp16: Llama-3-8B's shape"}


def main():
    json_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    variables = decode(json_dir, out_dir)
    variables.update(ttft(json_dir, out_dir))
    variables.update(memory(json_dir, out_dir))
    lines = []
    for k, v in variables.items():
        if isinstance(v, list):  # a gnuplot array: |k| is its length
            lines.append(f"array {k}[{len(v)}] = [{', '.join(gp_string(x) for x in v)}]")
        else:
            lines.append(f"{k} = {gp_string(v) if isinstance(v, str) else v}")
    (out_dir / "vars.gp").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
