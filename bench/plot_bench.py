#!/usr/bin/env python3
"""Plots of a `msaidx bench --json` result: speedups, effective TFLOP/s and distance to the floor.

usage: python3 bench/plot_bench.py RESULT.json [--out DIR]

Writes three PNGs next to the JSON (or into DIR), named after it:
  <stem>_speedup.png      speedup of each backend over dense (and over vLLM Triton), shapes sorted
  <stem>_tflops.png       effective scoring TFLOP/s against context length, one marker per H
  <stem>_floor.png        (score + top-k) / floor per shape, sorted
Needs matplotlib (pip install matplotlib); not part of the test suite.
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter  # noqa: E402

COLORS = {"dense": "tab:gray", "split": "tab:blue", "persistent": "tab:red", "cpu": "tab:green",
          "vLLM Triton": "tab:purple"}
MARKERS = {1: "o", 2: "s", 4: "^"}


def total_us(result):
    return result["score_us"] + result["topk_us"]


def shape_kv(shape, shapes_file_kv):
    """Longest context of a shape: from the JSON when it has it, else from the shapes file."""
    if "max_kv" in shape:
        return shape["max_kv"]
    return shapes_file_kv.get(shape["name"])


def load_shapes_file_kv(data, json_path):
    """name -> longest kv from the tsv the bench ran on (older JSONs lack max_kv)."""
    candidates = [data.get("shapes_file", ""), os.path.join(os.path.dirname(json_path), "..", "shapes",
                                                            "prefill78.tsv")]
    for path in candidates:
        for base in ("", os.path.join(os.path.dirname(os.path.abspath(json_path)), "..", "..")):
            full = os.path.join(base, path) if base else path
            if path and os.path.isfile(full):
                kv = {}
                with open(full) as f:
                    for line in f:
                        if line.startswith("#") or not line.strip():
                            continue
                        fields = line.split()
                        kv[fields[0]] = max(int(x) for x in fields[3].split(","))
                return kv
    return {}


def ratio_axis(ax, values):
    """Log y axis labelled as plain multipliers (0.5x, 1x, 10x) with a line at 1."""
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    if values:
        low, high = min(values), max(values)
        ax.set_ylim(min(low, 1.0) / 1.5, max(high, 1.0) * 1.5)
    ax.grid(True, which="major", axis="y", alpha=0.4)
    ax.grid(True, which="minor", axis="y", alpha=0.15)


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def plot_speedup(data, backends, out_path):
    series = []  # (label, color, linestyle, sorted ratios)
    if "dense" in backends:
        for b in backends:
            if b == "dense":
                continue
            ratios = sorted(total_us(s["results"]["dense"]) / total_us(s["results"][b])
                            for s in data["shapes"] if "dense" in s["results"] and b in s["results"])
            if ratios:
                series.append((f"{b} over dense", COLORS.get(b), "-", ratios))
    for b in backends:
        ratios = sorted((s["vllm_score_us"] + s["vllm_topk_us"]) / total_us(s["results"][b])
                        for s in data["shapes"] if "vllm_score_us" in s and b in s["results"])
        if ratios:
            series.append((f"{b} over vLLM Triton", COLORS.get(b), "--", ratios))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(11, 6))
    for label, color, style, ratios in series:
        wins = sum(r > 1 for r in ratios)
        ax.plot(range(1, len(ratios) + 1), ratios, style, marker=".", color=color,
                label=f"{label}: geomean {geomean(ratios):.2f}x, faster on {wins}/{len(ratios)}")
    ratio_axis(ax, [r for *_, ratios in series for r in ratios])
    ax.set_xlabel("shapes, each series sorted by its speedup (rank)")
    ax.set_ylabel("speedup of score + top-k time (log scale; > 1x = faster)")
    ax.set_title(f"msaidx speedup per shape (score + top-k), {data.get('dtype', '')}{mode(data)}\n{data.get('device', '')}",
                 fontsize=11)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return True


def plot_tflops(data, backends, kv_of_file, out_path):
    fig, ax = plt.subplots(figsize=(11, 6.5))
    plotted = False
    for b in backends:
        for heads, marker in MARKERS.items():
            points = [(shape_kv(s, kv_of_file), s["results"][b]["score_tflops"]) for s in data["shapes"]
                      if s["heads"] == heads and b in s["results"] and shape_kv(s, kv_of_file)]
            if not points:
                continue
            xs, ys = zip(*points)
            ax.scatter(xs, ys, marker=marker, color=COLORS.get(b), alpha=0.75, s=36, label=f"{b}, H={heads}")
            plotted = True
    if not plotted:
        plt.close(fig)
        return False
    gemm = data.get("ceilings", {}).get("cublaslt_fp8_gemm_8192_tflops", 0)
    if gemm > 0:
        ax.axhline(gemm, color="black", linestyle="--", linewidth=1.2)
        ax.annotate(f"measured cuBLASLt FP8 GEMM 8192^3: {gemm:.0f} TFLOP/s", (0.01, gemm), xycoords=("axes fraction",
                    "data"), textcoords="offset points", xytext=(0, 4), fontsize=9)
    else:
        ax.annotate("(no measured GEMM ceiling in this JSON: bench ran with --no-ceilings)", (0.99, 0.02),
                    xycoords="axes fraction", fontsize=9, ha="right")
    ax.axhline(1979, color="gray", linestyle=":", linewidth=1.0)
    ax.annotate("H200 datasheet FP8 dense: 1979 TFLOP/s", (0.01, 1979), xycoords=("axes fraction", "data"),
                textcoords="offset points", xytext=(0, 4), fontsize=9, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1 << e for e in range(11, 21)])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}K" if x < 1 << 20 else f"{x / (1 << 20):g}M"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("context length: longest kv_len of the shape (tokens, log scale)")
    ax.set_ylabel("effective scoring TFLOP/s (2*128*H*visible pairs / score time, log scale)")
    ax.set_title(f"msaidx scoring throughput vs context length{mode(data)}\n{data.get('device', '')}", fontsize=11)
    ax.grid(True, which="major", alpha=0.4)
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.93), fontsize=8, ncol=len(backends), framealpha=0.9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return True


def plot_floor(data, backends, out_path):
    fig, ax = plt.subplots(figsize=(11, 6))
    values = []
    for b in backends:
        ratios = sorted(total_us(s["results"][b]) / s["floor_us"] for s in data["shapes"] if b in s["results"])
        if not ratios:
            continue
        values += ratios
        ax.plot(range(1, len(ratios) + 1), ratios, "-", marker=".", color=COLORS.get(b),
                label=f"{b}: geomean {geomean(ratios):.2f}x the floor")
    vllm = sorted((s["vllm_score_us"] + s["vllm_topk_us"]) / s["floor_us"] for s in data["shapes"]
                  if "vllm_score_us" in s)
    if vllm:
        values += vllm
        ax.plot(range(1, len(vllm) + 1), vllm, "--", marker=".", color=COLORS["vLLM Triton"],
                label=f"vLLM Triton (reference file): geomean {geomean(vllm):.2f}x the floor")
    if not values:
        plt.close(fig)
        return False
    ratio_axis(ax, values)
    ax.set_xlabel("shapes, each series sorted by its ratio (rank)")
    ax.set_ylabel("(score + top-k time) / floor (log scale; 1x = at the floor)")
    ax.set_title("Distance to the floor = max(FLOP / 1979 TFLOP/s, K bytes / 4.8 TB/s) per shape"
                 f"{mode(data)}\n{data.get('device', '')}", fontsize=11)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return True


def mode(data):
    """Title suffix naming the accumulation mode of a run made with --fast-accumulation."""
    return ", fast accumulation (persistent: FP8 tensor-core sums)" if data.get("fast_accumulation") else ""


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="output of msaidx bench --json")
    parser.add_argument("--out", help="directory for the PNGs (default: next to the JSON)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    backends = [b for b in data.get("backends", []) if any(b in s["results"] for s in data["shapes"])]
    if not backends:
        print(f"{args.json}: no backend results to plot", file=sys.stderr)
        return 1
    out_dir = args.out or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, os.path.splitext(os.path.basename(args.json))[0])
    plots = [(plot_speedup(data, backends, stem + "_speedup.png"), stem + "_speedup.png"),
             (plot_tflops(data, backends, load_shapes_file_kv(data, args.json), stem + "_tflops.png"),
              stem + "_tflops.png"),
             (plot_floor(data, backends, stem + "_floor.png"), stem + "_floor.png")]
    for made, path in plots:
        print(f"wrote {path}" if made else f"skipped {path} (nothing to plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
