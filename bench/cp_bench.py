"""Context parallel on 2+ GPUs of one host (issue 17's done-means): correctness, then timing.

    torchrun --nproc-per-node 2 bench/cp_bench.py [--out bench/results/DATE_h200x2_cp.md]
    python3 bench/cp_bench.py --one-gpu 2      (all but the collective, on one GPU)

Needs torch with NCCL and at least 2 CUDA devices; with fewer (or without torchrun) it says so
and exits 0 (skipped). MSAIDX_LIBRARY / PYTHONPATH=python as for the Python tests.

1. Correctness: random ragged batches (prefill chunks and decode rows, H 1/2/4, E4M3 and BF16,
   both layouts): each rank scores its pages (a context-parallel msaidx.Plan), and
   msaidx.distributed.prefill_topk (one all_gather_into_tensor over NCCL, then the device merge)
   must equal, bitwise, the unsharded Plan.prefill_topk of the whole cache that every rank also
   computes on its own GPU.
2. Timing (CUDA events around a CUDA graph of 10 back-to-back calls, per call, as an engine runs
   its layers; --eager times the Python calls, host overhead included; median of --iters after
   --warmup): for each shape, one
   GPU's Plan.prefill_topk over the whole cache against the W-GPU pipeline split into score (the
   rank's candidates: score + its top-k), all_gather and merge. Shapes: q2k_kv1024k_h4 (one request of
   2048 new tokens at a 1M context), decode16_kv1024k_h4 (16 requests of one token at 1M each),
   q128_kv1024k_h1. Rank 0 prints a markdown table (and writes it to --out).
"""

import argparse
import os
import statistics
import sys

import numpy as np

PAGE = 128
SHAPES = (("q2k_kv1024k_h4", 4, [2048], [1048576 - 2048]),
          ("decode16_kv1024k_h4", 4, [1] * 16, [1048576 - 1] * 16),
          ("q128_kv1024k_h1", 1, [128], [1048576 - 128]))


def skip(reason):
    print(f"cp_bench: skipped: {reason}")
    sys.exit(0)


def owned_table(torch, block_table, seq_lens, world, rank, layout):
    """Row b: the physical pages of the rank's own logical pages of request b, in order."""
    import msaidx.distributed as cp
    pages = [-(-int(s) // PAGE) for s in seq_lens.tolist()]
    cols = max(1, -(-max(pages) // world))
    table = torch.full((len(pages), cols), -1, dtype=torch.int32, device=block_table.device)
    for b, count in enumerate(pages):
        mine = torch.from_numpy(cp.owned_pages(count, world, rank, layout).astype(np.int64))
        table[b, :len(mine)] = block_table[b, mine.to(block_table.device)]
    return table


def make_batch(torch, seed, fmt, heads, q_lens, prefixes, device):
    """Random E4M3 / BF16 queries and keys (a random page permutation) on `device`, the same on
    every rank for one seed."""
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    q_lens = torch.tensor(q_lens, dtype=torch.int64)
    seq_lens = torch.tensor(prefixes, dtype=torch.int64) + q_lens
    pages = (seq_lens + PAGE - 1) // PAGE
    num_pages = int(pages.sum())
    physical = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros((len(pages), int(pages.max())), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages.tolist()):
        table[b, :count] = physical[used:used + count]
        used += count
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.bfloat16
    num_tokens = int(q_lens.sum())
    q = torch.randn((num_tokens, heads, 128), generator=device_gen, device=device).to(dtype)
    k_cache = torch.empty((num_pages, PAGE, 128), dtype=dtype, device=device)
    for first in range(0, num_pages, 1024):  # in slices: 1M-token caches are large
        last = min(num_pages, first + 1024)
        k_cache[first:last] = torch.randn((last - first, PAGE, 128), generator=device_gen,
                                          device=device).to(dtype)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q_lens, 0)])
    return (q, k_cache, table.to(device), cu.to(torch.int32).to(device),
            seq_lens.to(torch.int32).to(device))


def rank_plan(torch, msaidx, fmt, heads, batch, world, rank, layout):
    q, k_cache, table, cu, seq_lens = batch
    mine = owned_table(torch, table, seq_lens.cpu(), world, rank, layout)
    plan = msaidx.Plan(heads, dtype=fmt, max_batch=len(seq_lens), max_tokens=q.shape[0],
                       pitch=mine.shape[1], max_seq_len=int(seq_lens.max()), cp_world=world,
                       cp_rank=rank, cp_layout=layout)
    plan.plan(mine, cu, seq_lens)
    return plan


def check_correctness(torch, msaidx, cp, world, rank, device, seed):
    rng = np.random.default_rng(seed)
    failures = 0
    for case in range(12):
        heads = (1, 2, 4)[case % 3]
        fmt = "bf16" if case % 4 == 3 else "e4m3"
        layout = ("interleaved", "contiguous")[case % 2]
        q_lens = [1, 2, int(rng.integers(5, 300)), int(rng.integers(1, 700))]
        prefixes = [int(rng.integers(0, 9000)), int(rng.integers(100, 20000)),
                    int(rng.integers(0, 3000)), int(rng.integers(0, 500))]
        batch = make_batch(torch, seed + case, fmt, heads, q_lens, prefixes, device)
        q, k_cache, table, cu, seq_lens = batch
        whole = msaidx.Plan(heads, dtype=fmt, max_batch=4, max_tokens=q.shape[0],
                            pitch=table.shape[1])
        whole.plan(table, cu, seq_lens)
        want = whole.prefill_topk(q, k_cache, 16, 0, 1)
        plan = rank_plan(torch, msaidx, fmt, heads, batch, world, rank, layout)
        got = cp.prefill_topk(plan, q, k_cache, topk=16, init_blocks=0, local_blocks=1)
        plan.check()
        if not torch.equal(got, want):
            failures += 1
            differ = int((got != want).sum())
            print(f"rank {rank}: case {case} ({fmt}, H {heads}, {layout}): {differ} ids differ")
    return failures


def time_ms(torch, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_of(torch, fn, reps):
    """reps calls of fn captured in one CUDA graph (as an engine runs its layers), or None when
    capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except RuntimeError as error:
        print(f"graph capture failed ({error}); timing eager calls")
        return None
    return graph.replay


def time_graph_ms(torch, fn, warmup, iters, reps=10):
    """Device time of one fn: a graph of `reps` back-to-back calls, timed per call, so neither
    Python nor the graph launch (each several us) sits between the events; eager calls when
    capture fails (the table then says so)."""
    replay = graph_of(torch, fn, reps)
    if replay is None:
        return time_ms(torch, fn, warmup, iters)
    return time_ms(torch, replay, warmup, iters) / reps


def one_gpu_selection(torch, msaidx, batch, heads, device, timer, args):
    """One GPU over the whole cache: its plan, its selection and the time of Plan.prefill_topk."""
    q, k_cache, table, cu, seq_lens = batch
    T = q.shape[0]
    whole = msaidx.Plan(heads, max_batch=len(seq_lens), max_tokens=T, pitch=table.shape[1])
    whole.plan(table, cu, seq_lens)
    out = torch.empty((T, heads, 16), dtype=torch.int32, device=device)
    elapsed = timer(torch, lambda: whole.prefill_topk(q, k_cache, 16, 0, 1, out=out),
                    args.warmup, args.iters)
    return whole, out, elapsed


def bench_shape(torch, msaidx, dist, heads, q_lens, prefixes, world, rank, device, args):
    batch = make_batch(torch, 1234, "e4m3", heads, q_lens, prefixes, device)
    q, k_cache = batch[:2]
    T = q.shape[0]
    timer = time_ms if args.eager else time_graph_ms
    whole, _, one_gpu = one_gpu_selection(torch, msaidx, batch, heads, device, timer, args)
    # W GPUs: this rank's pages only (its own cache slice would hold just those; reading them
    # from the whole cache moves the same bytes).
    plan = rank_plan(torch, msaidx, "e4m3", heads, batch, world, rank, args.layout)
    local = torch.empty((2, T, heads, 16), dtype=torch.float32, device=device)
    gathered = torch.empty((world * 2, T, heads, 16), dtype=torch.float32, device=device)
    merged = torch.empty((T, heads, 16), dtype=torch.int32, device=device)
    nvp = whole.nvp
    import msaidx.distributed as cp

    def score():
        plan.prefill_topk_candidates(q, k_cache, 16, out=(local[0], local[1].view(torch.int32)))

    def gather():
        dist.all_gather_into_tensor(gathered, local)

    def merge():
        view = gathered.view(world, 2, T, heads, 16)
        cp.merge_candidates(view[:, 0], view[:, 1].view(torch.int32), nvp, 16, 0, 1, out=merged)

    def pipeline():
        score()
        gather()
        merge()

    dist.barrier()
    parts = {}
    for part, fn in (("score", score), ("all_gather", gather), ("merge", merge),
                     ("total", pipeline)):
        dist.barrier()
        torch.cuda.synchronize()
        parts[part] = timer(torch, fn, args.warmup, args.iters)
    # The slowest rank sets the pace.
    summary = torch.tensor([one_gpu] + [parts[k] for k in ("score", "all_gather", "merge",
                                                           "total")], device=device)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    return [float(x) for x in summary.tolist()]


def one_gpu(world, args):
    """Everything of the W-GPU pipeline but the collective, on one GPU (no torchrun): per shape,
    the whole cache's Plan.prefill_topk; each rank's candidates from its sharded plan (the ranks
    run one after another, each into its slice of one stacked buffer, as the all-gather would
    leave them); the device merge of that buffer, checked bitwise against the whole cache's
    selection. Without the all-gather the W-GPU time is the slowest rank's candidates plus the
    merge."""
    import torch
    import msaidx
    import msaidx.distributed as cp
    device = torch.device("cuda", 0)
    timer = time_ms if args.eager else time_graph_ms
    rows, failures = [], 0
    for name, heads, q_lens, prefixes in SHAPES:
        batch = make_batch(torch, 1234, "e4m3", heads, q_lens, prefixes, device)
        q, k_cache = batch[:2]
        T = q.shape[0]
        whole, want, one = one_gpu_selection(torch, msaidx, batch, heads, device, timer, args)
        gathered = torch.empty((world, 2, T, heads, 16), dtype=torch.float32, device=device)
        scores = []
        for rank in range(world):
            plan = rank_plan(torch, msaidx, "e4m3", heads, batch, world, rank, args.layout)
            rank_out = (gathered[rank, 0], gathered[rank, 1].view(torch.int32))
            scores.append(timer(torch, lambda plan=plan, rank_out=rank_out:
                                plan.prefill_topk_candidates(q, k_cache, 16, out=rank_out),
                                args.warmup, args.iters))
        merged = torch.empty((T, heads, 16), dtype=torch.int32, device=device)
        nvp = whole.nvp

        def merge():
            cp.merge_candidates(gathered[:, 0], gathered[:, 1].view(torch.int32), nvp, 16, 0, 1,
                                out=merged)

        merge_ms = timer(torch, merge, args.warmup, args.iters)
        same = torch.equal(merged, want)
        failures += not same
        rows.append(f"| {name} | {T * heads} | {one * 1e3:.1f} | {max(scores) * 1e3:.1f} | "
                    f"{merge_ms * 1e3:.1f} | {(max(scores) + merge_ms) * 1e3:.1f} | "
                    f"{'yes' if same else 'NO'} |")
        torch.cuda.empty_cache()
    table = "\n".join(
        [f"W = {world} ranks run one after another on one GPU, layout {args.layout}, E4M3 default "
         f"precision, top-16, median of {args.iters} "
         f"{'eager calls' if args.eager else 'graph replays'} (us)", "",
         "| shape | rows | 1 GPU | slowest rank's candidates | merge | W-GPU time without the "
         "all-gather | merged = 1 GPU's selection |", "| --- | --- | --- | --- | --- | --- | --- |"] +
        rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Context parallel on one GPU, W = {world}\n\n`bench/cp_bench.py --one-gpu "
                    f"{world}`\n\n{table}\n")
    sys.exit(1 if failures else 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="markdown file for the timing table (rank 0)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layout", default="interleaved", choices=["interleaved", "contiguous"])
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--eager", action="store_true",
                        help="time eager Python calls (host overhead included) instead of CUDA "
                             "graph replays")
    parser.add_argument("--min-gpus", type=int, default=2,
                        help="below this many devices, skip (1: a smoke run of world 1)")
    parser.add_argument("--one-gpu", type=int, metavar="W",
                        help="everything but the collective on one GPU (no torchrun): the W "
                             "ranks' candidates one after another, and their merge")
    args = parser.parse_args()
    if args.one_gpu:
        try:
            import torch
        except ImportError:
            skip("no torch")
        if not torch.cuda.is_available():
            skip("no CUDA device")
        one_gpu(args.one_gpu, args)
    if "WORLD_SIZE" not in os.environ:
        skip("run under torchrun --nproc-per-node 2 (WORLD_SIZE is not set)")
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        skip("no torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.min_gpus:
        skip(f"needs {args.min_gpus} CUDA devices, found {torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        skip("torch.distributed without NCCL")
    import msaidx
    import msaidx.distributed as cp
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        if not args.skip_check:
            failures = torch.tensor([check_correctness(torch, msaidx, cp, world, rank, device,
                                                       seed=20261201)], device=device)
            dist.all_reduce(failures)
            if rank == 0:
                print(f"correctness: {'PASS' if int(failures) == 0 else 'FAIL'} "
                      f"({int(failures)} failed cases over {world} ranks)")
        rows = []
        for name, heads, q_lens, prefixes in SHAPES:
            one, score, gather, merge, total = bench_shape(torch, msaidx, dist, heads, q_lens,
                                                           prefixes, world, rank, device, args)
            rows.append(f"| {name} | {one * 1e3:.1f} | {score * 1e3:.1f} | {gather * 1e3:.1f} | "
                        f"{merge * 1e3:.1f} | {total * 1e3:.1f} | {one / total:.2f}x |")
            torch.cuda.empty_cache()
        if rank == 0:
            table = "\n".join(
                [f"W = {world} GPUs, layout {args.layout}, E4M3 default precision, top-16, "
                 f"median of {args.iters} {'eager calls' if args.eager else 'graph replays'} "
                 "(us; each column the slowest rank's)", "",
                 "| shape | 1 GPU | score | all_gather | merge | W-GPU total | speedup |",
                 "| --- | --- | --- | --- | --- | --- | --- |"] + rows)
            print(table)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(f"# Context parallel, {world} GPUs\n\n`torchrun --nproc-per-node "
                            f"{world} bench/cp_bench.py`\n\n{table}\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
