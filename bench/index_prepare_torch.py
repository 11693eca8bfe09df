"""Index Q/K preparation on the GPU: msaidx.index_prepare against the device copy rate and against
the same steps written as torch eager ops (SPEC.md section 11), measured in one run.

Each timed call is repeated inside one CUDA graph (so launch overhead is not counted) and the
median over replays is reported per call; "eager" rows time back-to-back calls from Python, host
overhead included. Two countings of the bytes, each against the copy rate: "moved" = BF16 q_in
and k_in read + q_out and the key-cache rows written (issue 16's measure); "all" adds what the
kernel also reads: positions and slot_mapping (8 bytes each a token) and the token's cos/sin row
(64 entries of the table's dtype; none with theta, where the kernel computes them). The copy rate is torch's device-to-device copy of the "moved"
bytes (read + write).

usage: PYTHONPATH=python MSAIDX_LIBRARY=build/libmsaidx.so python3 bench/index_prepare_torch.py
       [--tokens 1024,4096,16384,65536,262144] [--heads 4,1] [--cos-sin fp32] [--no-torch]
       [--json out.json]
--cos-sin: where the angles come from, comma-separated: fp32 or bf16 (a table of that dtype),
theta (no table: rope_theta = 5e6; the torch steps read an FP32 table).
--no-torch times msaidx and the copy only (an A/B of two library builds needs no more).
"""

import argparse
import json
import statistics

import torch

import msaidx

DIM = 128
PAGE = 128
MAX_POSITION = 131072
CALLS_PER_GRAPH = 20
REPLAYS = 15


def graph_time_us(fn):
    """Median per-call device time of `fn` captured CALLS_PER_GRAPH times in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return statistics.median(times)


def eager_time_us(fn):
    """Median per-call time of CALLS_PER_GRAPH back-to-back calls from Python."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        for _ in range(CALLS_PER_GRAPH):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return statistics.median(times)


TABLE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "theta": None}  # None: no table
ROPE_THETA = 5e6  # MiniMax-M3


def bytes_moved(num_tokens, num_heads, cache_dtype, table_dtype):
    """(moved, all): issue 16's counting and every byte the kernel moves (module docstring)."""
    vectors = num_tokens * (num_heads + 1)
    moved = vectors * DIM * (2 + cache_dtype.itemsize)
    table_row = 0 if table_dtype is None else 64 * table_dtype.itemsize
    return moved, moved + num_tokens * (8 + 8 + table_row)


def cos_sin_table(dtype):
    """[MAX_POSITION, 64] of MiniMax-M3's angles, computed in FP64."""
    inv_freq = ROPE_THETA ** (-torch.arange(32, device="cuda", dtype=torch.float64) * 2 / 64)
    angles = torch.arange(MAX_POSITION, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype).contiguous()


def make_inputs(num_tokens, num_heads, cache_dtype, generator, table_dtype=torch.float32):
    width = num_heads * DIM + DIM + DIM  # [q heads | k | one more head], as a fused projection
    projection = torch.randn(num_tokens, width, device="cuda", generator=generator).bfloat16()
    q_in = projection[:, :num_heads * DIM].view(num_tokens, num_heads, DIM)
    k_in = projection[:, num_heads * DIM:num_heads * DIM + DIM]
    q_weight = (0.5 * torch.randn(DIM, device="cuda", generator=generator)).bfloat16()
    k_weight = (0.5 * torch.randn(DIM, device="cuda", generator=generator)).bfloat16()
    positions = (torch.arange(num_tokens, device="cuda") + 1000) % MAX_POSITION
    num_pages = (num_tokens + PAGE - 1) // PAGE + 16
    pages = torch.randperm(num_pages, device="cuda", generator=generator)
    token = torch.arange(num_tokens, device="cuda")
    slots = pages[token // PAGE] * PAGE + token % PAGE  # whole pages, scattered
    k_cache = torch.zeros(num_pages, PAGE, DIM, device="cuda", dtype=cache_dtype)
    q_out = torch.empty(num_tokens, num_heads, DIM, device="cuda", dtype=cache_dtype)
    rotation = (dict(cos_sin_cache=None, rope_theta=ROPE_THETA) if table_dtype is None
                else dict(cos_sin_cache=cos_sin_table(table_dtype)))
    return dict(q_in=q_in, k_in=k_in, positions=positions.long(), q_norm_weight=q_weight,
                k_norm_weight=k_weight, slot_mapping=slots.long(), k_cache=k_cache, q_out=q_out,
                **rotation)


def torch_prepare(inputs, table, eps=1e-6):
    """SPEC section 11 as torch eager ops: FP32 norm and RoPE, saturating cast, scatter."""
    cs = table[inputs["positions"]]
    cos, sin = cs[:, :32].float(), cs[:, 32:].float()

    def norm_rope(x, weight, cos, sin):
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
        first, second = y[..., :32], y[..., 32:64]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, y[..., 64:]],
                         dim=-1)

    def cast(x, dtype):
        return x.clamp(-448.0, 448.0).to(dtype) if dtype == torch.float8_e4m3fn else x.to(dtype)

    cache = inputs["k_cache"]
    q = norm_rope(inputs["q_in"], inputs["q_norm_weight"], cos[:, None], sin[:, None])
    inputs["q_out"].copy_(cast(q, cache.dtype))
    k = norm_rope(inputs["k_in"], inputs["k_norm_weight"], cos, sin)
    # as bytes: index_copy_ has no float8 kernels
    row_bytes = DIM * cache.dtype.itemsize
    cache.view(torch.uint8).view(-1, row_bytes).index_copy_(
        0, inputs["slot_mapping"], cast(k, cache.dtype).view(torch.uint8).view(-1, row_bytes))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1024,4096,16384,65536,262144")
    parser.add_argument("--heads", default="4,1")
    parser.add_argument("--cos-sin", default="fp32", help="fp32, bf16, theta (comma-separated)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch steps")
    parser.add_argument("--json")
    options = parser.parse_args()
    generator = torch.Generator(device="cuda")
    generator.manual_seed(1)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"library {msaidx._capi.library_path()}")
    rows = []
    header = ("| table | T | H | cache | MB moved | MB all | msaidx graph (us) | GB/s moved "
              "| copy (us) | copy GB/s | msaidx / copy rate, moved | msaidx / copy rate, all "
              "| msaidx eager (us) | torch eager (us) | torch graph (us) "
              "| torch eager / msaidx graph | torch graph / msaidx graph | q_out equal to torch |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    shapes = [(table, int(h), cache, int(t)) for table in options.cos_sin.split(",")
              for h in options.heads.split(",") for cache in (torch.float8_e4m3fn, torch.bfloat16)
              for t in options.tokens.split(",")]
    for table, num_heads, cache_dtype, num_tokens in shapes:
        inputs = make_inputs(num_tokens, num_heads, cache_dtype, generator, TABLE_DTYPES[table])
        elem = cache_dtype.itemsize
        moved, all_bytes = bytes_moved(num_tokens, num_heads, cache_dtype, TABLE_DTYPES[table])
        ours = graph_time_us(lambda: msaidx.index_prepare(**inputs))
        ours_eager = eager_time_us(lambda: msaidx.index_prepare(**inputs))
        ours_q = inputs["q_out"].view(torch.uint8 if elem == 1 else torch.int16).clone()
        ours_cache = inputs["k_cache"].clone()
        source = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        copy = graph_time_us(lambda: target.copy_(source))
        theirs_eager = theirs = agree = cache_agree = float("nan")
        if not options.no_torch:
            their_table = inputs["cos_sin_cache"]
            if their_table is None:
                their_table = cos_sin_table(torch.float32)
            theirs_eager = eager_time_us(lambda: torch_prepare(inputs, their_table))
            theirs = graph_time_us(lambda: torch_prepare(inputs, their_table))
            their_q = inputs["q_out"].view(torch.uint8 if elem == 1 else torch.int16)
            agree = (ours_q == their_q).float().mean().item()
            cache_agree = (ours_cache.view(torch.uint8) ==
                           inputs["k_cache"].view(torch.uint8)).float().mean().item()
        copy_gbps = moved / copy / 1e3
        row = dict(table=table, tokens=num_tokens, heads=num_heads,
                   cache="e4m3" if elem == 1 else "bf16", bytes_moved=moved, bytes_all=all_bytes,
                   msaidx_graph_us=ours, msaidx_gbps=moved / ours / 1e3,
                   msaidx_all_gbps=all_bytes / ours / 1e3, copy_us=copy, copy_gbps=copy_gbps,
                   fraction_of_copy=copy / ours,
                   fraction_of_copy_all_bytes=all_bytes / ours / 1e3 / copy_gbps,
                   msaidx_eager_us=ours_eager, torch_eager_us=theirs_eager,
                   torch_graph_us=theirs, speedup_vs_torch_eager=theirs_eager / ours,
                   speedup_vs_torch_graph=theirs / ours, q_out_equal_to_torch=agree,
                   k_cache_bytes_equal_to_torch=cache_agree)
        rows.append(row)
        print(f"| {table} | {num_tokens} | {num_heads} | {row['cache']} | {moved / 1e6:.1f} | "
              f"{all_bytes / 1e6:.1f} | {ours:.1f} | {row['msaidx_gbps']:.0f} | {copy:.1f} | "
              f"{copy_gbps:.0f} | {row['fraction_of_copy'] * 100:.0f} % | "
              f"{row['fraction_of_copy_all_bytes'] * 100:.0f} % | "
              f"{ours_eager:.1f} | {theirs_eager:.1f} | {theirs:.1f} | "
              f"{row['speedup_vs_torch_eager']:.1f}x | "
              f"{row['speedup_vs_torch_graph']:.1f}x | {agree * 100:.3f} % |", flush=True)
        del inputs, source, target
        torch.cuda.empty_cache()
    if options.json:
        with open(options.json, "w") as out:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
                      out, indent=1)


if __name__ == "__main__":
    main()
