#!/usr/bin/env python3
"""Probe: makes src/cuda/plan_persistent_sm90.cu print the cycles (clock64) of each phase of the
persistent plan kernel, one line per plan from thread 0:

    PLANPROBE tiles T maxp P | plan_tiles count_tiles_above count_tasks pick rows sort resolved

Usage (on a scratch copy of the tree, never committed):
    python3 bench/probes/plan_phases.py src/cuda/plan_persistent_sm90.cu
    cmake --build build --target msaidx_cli
    ./build/msaidx e2e --backends persistent --tp 4 --prefill 512 --context 8192 --max-replays 1 | grep PLANPROBE
Each stamp follows a __syncthreads(), so the probe adds a few hundred cycles to the total."""
import sys

path = sys.argv[1]
lines = open(path).read().split("\n")


def stamp(i):
    return f"    __syncthreads(); if (threadIdx.x == 0) probe_t[{i}] = clock64();"


# (the start of a phase call, stamp taken before it, stamp taken after it)
PHASES = [
    ("const int32_t num_tiles = plan_tiles(", None, 1),
    ("count_tiles_above(a,", None, 2),
    ("count_tasks(a,", None, 3),
    ("for (int32_t first = 0; first < max_chunks", 4, None),
    ("sort_tiles_stably(a, num_tiles);", 5, None),
    ("write_resolved_tasks(a,", 6, 7),
]
REPORT = ('    if (threadIdx.x == 0) printf("PLANPROBE tiles %d maxp %d | %lld %lld %lld %lld %lld %lld '
          '%lld\\n", num_tiles, max_pages, ' +
          ", ".join(f"probe_t[{i + 1}] - probe_t[{i}]" for i in range(7)) + ");")

out = []
for line in lines:
    phase = next((p for p in PHASES if line.strip().startswith(p[0])), None)
    if phase and phase[2] == 1:
        out.append("    __shared__ long long probe_t[8]; if (threadIdx.x == 0) probe_t[0] = clock64();")
    if phase and phase[1] is not None:
        out.append(stamp(phase[1]))
    out.append(line)
    if phase and phase[2] is not None:
        out.append(stamp(phase[2]))
    if phase and phase[2] == 7:
        out.append(REPORT)
text = "\n".join(out).replace("#include <cub/block/block_scan.cuh>",
                              "#include <cub/block/block_scan.cuh>\n#include <cstdio>")
if text.count("probe_t[") < 16:
    sys.exit("plan_phases.py: the kernel's phase calls were not found; update the patterns")
open(path, "w").write(text)
