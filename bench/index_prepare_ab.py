"""Same-run A/B of msaidx.index_prepare between library builds (e.g. an older kernel against this
one), on the inputs of bench/index_prepare_torch.py: per shape, every build is timed on the same
tensors right after the device copy of the same bytes, and its q_out and key-cache bytes are
compared with the first build's.

Each build is loaded in turn into this process (the package's contexts and library handle are
dropped before the next one is loaded), so that the builds share one CUDA context and one set of
inputs. Times are graph replays as in bench/index_prepare_torch.py; per build, its rate against
the copy rate in both of that script's countings: the bytes issue 16 counts ("moved") and every
byte the kernel moves ("all": + positions, slots and cos/sin rows, none with theta).

usage: PYTHONPATH=python python3 bench/index_prepare_ab.py old=path/libmsaidx.so new=build/libmsaidx.so
       [--tokens 1024,4096,16384,65536,262144] [--heads 4,1] [--cos-sin fp32,bf16] [--rounds 2]
       [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import index_prepare_torch as bench  # noqa: E402

import msaidx  # noqa: E402
from msaidx import _capi, _prepare  # noqa: E402


def use_library(path):
    """Makes msaidx load `path` on its next call (contexts of the previous build destroyed)."""
    _capi._destroy_contexts()
    _capi._lib = None
    _prepare._entry_points = None
    os.environ["MSAIDX_LIBRARY"] = path
    if _capi.library_path() != path:
        raise SystemExit(f"the package ships its own library ({_capi.library_path()}): "
                         "run from a checkout")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("builds", nargs="+", help="name=path/to/libmsaidx.so, the first is the reference")
    parser.add_argument("--tokens", default="1024,4096,16384,65536,262144")
    parser.add_argument("--heads", default="4,1")
    parser.add_argument("--cos-sin", default="fp32", help="fp32, bf16, theta (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2, help="builds timed in turn, this many times")
    parser.add_argument("--json")
    options = parser.parse_args()
    builds = [b.split("=", 1) for b in options.builds]
    generator = torch.Generator(device="cuda")
    generator.manual_seed(1)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    names = [name for name, _ in builds]
    header = ("| table | T | H | cache | MB moved | MB all | copy (us) | " +
              " | ".join(f"{n} (us) | {n} / copy rate: moved, all" for n in names) +
              " | outputs bitwise equal to " + names[0] + "'s |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rows = []
    shapes = [(table, int(h), cache, int(t)) for table in options.cos_sin.split(",")
              for h in options.heads.split(",") for cache in (torch.float8_e4m3fn, torch.bfloat16)
              for t in options.tokens.split(",")]
    for table, num_heads, cache_dtype, num_tokens in shapes:
        table_dtype = bench.TABLE_DTYPES[table]
        inputs = bench.make_inputs(num_tokens, num_heads, cache_dtype, generator,
                                   table_dtype)
        elem = cache_dtype.itemsize
        moved, all_bytes = bench.bytes_moved(num_tokens, num_heads, cache_dtype,
                                             table_dtype)
        source = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        times = {name: [] for name in names}
        copies = []
        outputs = {}
        for _ in range(options.rounds):
            copies.append(bench.graph_time_us(lambda: target.copy_(source)))
            for name, path in builds:
                use_library(path)
                inputs["q_out"].view(torch.uint8).fill_(0xA5)
                inputs["k_cache"].view(torch.uint8).fill_(0xA5)
                times[name].append(
                    bench.graph_time_us(lambda: msaidx.index_prepare(**inputs)))
                outputs[name] = (inputs["q_out"].view(torch.uint8).clone(),
                                 inputs["k_cache"].view(torch.uint8).clone())
        copy = statistics.median(copies)
        reference = outputs[names[0]]
        differ = [n for n in names if not (torch.equal(outputs[n][0], reference[0]) and
                                           torch.equal(outputs[n][1], reference[1]))]
        row = dict(table=table, tokens=num_tokens, heads=num_heads,
                   cache="e4m3" if elem == 1 else "bf16", bytes_moved=moved,
                   bytes_all=all_bytes, copy_us=copy, copy_gbps=moved / copy / 1e3,
                   outputs_differ=differ)
        cells = []
        for name in names:
            us = statistics.median(times[name])
            row[name] = dict(us=us, gbps=moved / us / 1e3, fraction_of_copy=copy / us,
                             fraction_of_copy_all_bytes=copy / us * all_bytes / moved,
                             rounds_us=times[name])
            cells.append(f"{us:.1f} | {copy / us * 100:.0f} %, "
                         f"{copy / us * all_bytes / moved * 100:.0f} %")
        rows.append(row)
        print(f"| {table} | {num_tokens} | {num_heads} | {row['cache']} | "
              f"{moved / 1e6:.1f} | {all_bytes / 1e6:.1f} | {copy:.1f} | " +
              " | ".join(cells) +
              f" | {'all' if not differ else 'not ' + ', '.join(differ)} |",
              flush=True)
        del inputs, source, target, outputs
        torch.cuda.empty_cache()
    if options.json:
        with open(options.json, "w") as out:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           builds=dict(builds), rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
