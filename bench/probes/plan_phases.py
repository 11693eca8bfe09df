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


out = []
for line in lines:
    code = line.strip()
    if code.startswith("for (int32_t first = 0; first < max_chunks"):
        out.append(stamp(4))
    if code.startswith("sort_tiles_stably(a, num_tiles);"):
        out.append(stamp(5))
    if code.startswith("write_resolved_tasks(a,"):
        out.append(stamp(6))
    if "const int32_t num_tiles =" in code and "plan_tiles(" in code:
        out.append("    __shared__ long long probe_t[8]; if (threadIdx.x == 0) probe_t[0] = clock64();")
    out.append(line)
    if "const int32_t num_tiles =" in code and "plan_tiles(" in code:
        out.append(stamp(1))
    if code.startswith("count_tiles_above(a,"):
        out.append(stamp(2))
    if code.startswith("count_tasks(a,"):
        out.append(stamp(3))
    if code.startswith("write_resolved_tasks(a,"):
        out.append(stamp(7))
        out.append('    if (threadIdx.x == 0) printf("PLANPROBE tiles %d maxp %d | %lld %lld %lld %lld '
                   '%lld %lld %lld\\n", num_tiles, max_pages, probe_t[1] - probe_t[0], probe_t[2] - '
                   'probe_t[1], probe_t[3] - probe_t[2], probe_t[4] - probe_t[3], probe_t[5] - '
                   'probe_t[4], probe_t[6] - probe_t[5], probe_t[7] - probe_t[6]);')
text = "\n".join(out).replace("#include <cub/block/block_scan.cuh>",
                              "#include <cub/block/block_scan.cuh>\n#include <cstdio>")
if text.count("probe_t[") < 16:
    sys.exit("plan_phases.py: the kernel's phase calls were not found; update the patterns")
open(path, "w").write(text)
