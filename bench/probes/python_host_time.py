"""Host time per layer call from Python: a 57-layer eager loop of scores + top-k on torch CUDA
tensors, as an engine's prefill runs the indexer outside CUDA graphs.

  before: the module functions (each call re-plans: context lookup, plan create, workspace)
  after:  msaidx.Plan (planned once per forward; per layer the cached call path)

Host time = wall time of the loop with the GPU kept busy ahead of it (so launches never wait),
per layer call (scores and top-k are two calls). Prints a markdown table."""

import sys
import time

import numpy as np
import torch

import msaidx

LAYERS = 57


def setup(prefill_tokens, context, heads=4, page=128, dim=128):
    rng = np.random.default_rng(0)
    seq_len = context
    pages = -(-seq_len // page)
    k_cache = torch.from_numpy(rng.integers(0, 126, (pages, page, dim), dtype=np.uint8)).cuda()
    k_cache = k_cache.view(torch.float8_e4m3fn)
    q = torch.from_numpy(rng.integers(0, 126, (prefill_tokens, heads, dim), dtype=np.uint8))
    q = q.cuda().view(torch.float8_e4m3fn)
    block_table = torch.arange(pages, dtype=torch.int32, device="cuda")[None, :]
    cu = torch.tensor([0, prefill_tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    return q, k_cache, block_table, cu, seq_lens, pages


def busy_gpu():
    """Queues enough GPU work that the loop's launches never wait for the device."""
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(40):
        a = a @ a
        a /= a.norm()


def timed(loop, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        busy_gpu()
        start = time.perf_counter()
        loop()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best


def main():
    rows = []
    for prefill_tokens, context in ((512, 32768), (2048, 131072)):
        q, k_cache, block_table, cu, seq_lens, pages = setup(prefill_tokens, context)
        pitch = pages
        scores = torch.full((prefill_tokens, 4, pitch), float("-inf"), device="cuda")
        picks = torch.empty((prefill_tokens, 4, 16), dtype=torch.int32, device="cuda")
        nvp = msaidx.num_valid_pages(cu, seq_lens, 128, prefill_tokens)

        def before():
            for _ in range(LAYERS):
                msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=pitch,
                                      out=scores, precision="default")
                msaidx.topk_select(scores, nvp, out=picks)

        plan = msaidx.Plan(4, max_batch=1, max_tokens=prefill_tokens, pitch=pitch)

        def after():
            plan.plan(block_table, cu, seq_lens)
            for _ in range(LAYERS):
                plan.prefill_scores(q, k_cache, out=scores)
                plan.topk_select(scores, out=picks)

        def after_allocating():
            plan.plan(block_table, cu, seq_lens)
            for _ in range(LAYERS):
                plan.topk_select(plan.prefill_scores(q, k_cache))

        before(), after(), after_allocating()  # warm up: contexts, plans, caches
        torch.cuda.synchronize()
        want = scores.clone()
        before()
        torch.cuda.synchronize()
        assert torch.equal(scores, want)
        calls = 2 * LAYERS
        for name, loop in (("module functions (before)", before), ("Plan, out= given (after)", after),
                           ("Plan, outputs allocated", after_allocating)):
            seconds = timed(loop)
            rows.append((f"P={prefill_tokens} C={context // 1024}K", name,
                         seconds * 1e3, seconds / calls * 1e6))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    print()
    print("| shape | path | 57-layer loop host ms | host us per layer call |")
    print("|---|---|---|---|")
    for shape, name, ms, us in rows:
        print(f"| {shape} | {name} | {ms:.3f} | {us:.2f} |")


if __name__ == "__main__":
    main()
