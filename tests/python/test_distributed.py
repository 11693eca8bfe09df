"""msaidx.distributed (context parallel, SPEC.md section 12) on the cpu backend: W ranks simulated in
one process (context-parallel Plans, then merge_candidates), and 2 processes over
torch.distributed's gloo backend (skipped without torch); both bitwise against the unsharded
Plan.prefill_topk. Then the same on torch CUDA tensors (every CUDA backend, the device merge),
and prefill_topk over NCCL with a world of 1 (skipped without a GPU). Two GPUs over NCCL are
checked by `torchrun --nproc-per-node 2 bench/cp_bench.py` (bitwise against the unsharded call
before it times anything); tests/gpu_multi_device.c runs the C cases on a second device."""

import os
import socket

import numpy as np
import pytest

import msaidx
import msaidx.distributed as cp
from batches import make_batch

E4M3_NAN = 0x7F


def ragged_batch(rng, num_heads, fmt="e4m3"):
    """Decode rows, prefill chunks, a long request (rows with nvp > topk), padding rows and NaN."""
    q_lens = [1, 3, int(rng.integers(5, 40)), int(rng.integers(1, 20))]
    prefixes = [int(rng.integers(0, 3000)), int(rng.integers(1500, 4000)),
                int(rng.integers(0, 300)), 0]
    batch = make_batch(rng, fmt, num_heads, q_lens, prefixes, pad_tokens=2)
    for t in rng.choice(int(batch.cu_seqlens_q[-1]), size=2, replace=False):
        batch.q[t, int(rng.integers(num_heads)), int(rng.integers(128))] = E4M3_NAN
    return batch


def rank_block_table(batch, world, rank, layout):
    """The engine convention: row b lists the physical pages of the rank's own logical pages."""
    pages = -(-batch.seq_lens.astype(np.int64) // batch.page)
    cols = max(1, -(-int(pages.max()) // world))
    table = np.full((len(pages), cols), -3, np.int32)
    for b, count in enumerate(pages):
        mine = cp.owned_pages(int(count), world, rank, layout)
        table[b, :len(mine)] = batch.block_table[b, mine]
    return table


def unsharded_selection(batch, topk, init_blocks, local_blocks):
    plan = msaidx.Plan(batch.num_heads, device="cpu", max_batch=len(batch.seq_lens),
                       max_tokens=batch.num_tokens, pitch=batch.largest_nvp())
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    return plan.prefill_topk(batch.q, batch.k_cache, topk, init_blocks, local_blocks)


def rank_plan(batch, world, rank, layout, wide=False):
    """`wide`: the pitch 40 pages past the rank's, and the forward bounded by its longest request
    (as engines plan): candidates without scores_out then score rows of the bound's pages."""
    plan = msaidx.Plan(batch.num_heads, device="cpu", max_batch=len(batch.seq_lens),
                       max_tokens=batch.num_tokens,
                       pitch=-(-batch.largest_nvp() // world) + (40 if wide else 0),
                       cp_world=world, cp_rank=rank, cp_layout=layout)
    plan.plan(rank_block_table(batch, world, rank, layout), batch.cu_seqlens_q, batch.seq_lens,
              max_seq_len=int(batch.seq_lens.max()) if wide else None)
    return plan


@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
def test_simulated_ranks(rng, layout):
    for num_heads in (1, 2, 4):
        batch = ragged_batch(rng, num_heads)
        for topk, init_blocks, local_blocks in ((16, 0, 1), (4, 1, 2), (64, 0, 0)):
            want = unsharded_selection(batch, topk, init_blocks, local_blocks)
            for world in (1, 2, 3, 4):
                wide = world % 2 == 0
                plans = [rank_plan(batch, world, rank, layout, wide) for rank in range(world)]
                gathered = [plan.prefill_topk_candidates(batch.q, batch.k_cache, topk)
                            for plan in plans]
                scores = np.stack([g[0] for g in gathered])
                pages = np.stack([g[1] for g in gathered])
                got = cp.merge_candidates(scores, pages, plans[0].nvp, topk, init_blocks,
                                          local_blocks)
                assert np.array_equal(got, want), (num_heads, topk, world)
                if wide:  # with scores_out: the same candidates
                    pitch = plans[0].pitch
                    for plan, (scores_free, pages_free) in zip(plans, gathered):
                        kept = np.empty((batch.num_tokens, num_heads, pitch), np.float32)
                        with_scores = plan.prefill_topk_candidates(batch.q, batch.k_cache, topk,
                                                                   scores_out=kept)
                        assert np.array_equal(with_scores[1], pages_free)
                        assert np.array_equal(with_scores[0].view(np.uint32),
                                              scores_free.view(np.uint32))


def test_owned_pages_and_errors(rng):
    assert cp.owned_pages(7, 3, 1).tolist() == [1, 4]
    assert cp.owned_pages(7, 3, 2, "contiguous").tolist() == [6]
    assert cp.owned_pages(2, 4, 3, "contiguous").tolist() == []
    with pytest.raises(msaidx.Error, match="^layout"):
        cp.owned_pages(4, 2, 0, "striped")
    with pytest.raises(msaidx.Error, match="^cp_rank"):
        msaidx.Plan(1, device="cpu", max_batch=1, max_tokens=1, cp_world=2, cp_rank=2)
    with pytest.raises(msaidx.Error, match="^cp_layout"):
        msaidx.Plan(1, device="cpu", max_batch=1, max_tokens=1, cp_world=2, cp_layout="x")
    batch = ragged_batch(rng, 2)
    plan = rank_plan(batch, 2, 0, "interleaved")
    with pytest.raises(msaidx.Error, match="msaidx_merge_candidates"):
        plan.prefill_topk(batch.q, batch.k_cache)
    with pytest.raises(msaidx.Error, match="^topk_select: a context-parallel plan"):
        plan.topk_select(plan.prefill_scores(batch.q, batch.k_cache))
    scores, pages = plan.prefill_topk_candidates(batch.q, batch.k_cache)
    with pytest.raises(msaidx.Error, match="^candidate_scores"):
        cp.merge_candidates(scores, pages, plan.nvp)
    with pytest.raises(msaidx.Error, match="^candidate_scores: rows"):
        cp.merge_candidates(scores[None], pages[None], plan.nvp, topk=8)
    with pytest.raises(msaidx.Error, match="^out: overlaps candidate_scores"):
        cp.merge_candidates(scores[None], pages[None], plan.nvp, topk=16,
                            out=scores.view(np.int32))
    for name, forced in (("init_blocks", dict(init_blocks=float("nan"))),
                         ("local_blocks", dict(local_blocks=1.0)),
                         ("init_blocks \\+ local_blocks", dict(init_blocks=9, local_blocks=8))):
        with pytest.raises(msaidx.Error, match=f"^{name}"):
            cp.merge_candidates(scores[None], pages[None], plan.nvp, topk=16, **forced)


def test_merge_in_place_over_a_packed_gather(rng):
    """The docs' packed gather ([W, 2, T, H, k]: each rank's scores, then its pages) merges in
    place over rank 0's pages, equal to the merge into a separate out; out over another rank's
    rows, an empty gather and ranks closer than their rows are refused, naming the argument."""
    batch = ragged_batch(rng, 2)
    world = 3
    gathered = np.zeros((world, 2) + (batch.num_tokens, batch.num_heads, 16), np.float32)
    for rank in range(world):
        plan = rank_plan(batch, world, rank, "interleaved")
        gathered[rank, 0], gathered[rank, 1].view(np.int32)[...] = \
            plan.prefill_topk_candidates(batch.q, batch.k_cache)
    scores, pages = gathered[:, 0], gathered[:, 1].view(np.int32)
    nvp = rank_plan(batch, world, 0, "interleaved").nvp
    want = cp.merge_candidates(scores, pages, nvp)
    np.testing.assert_array_equal(cp.merge_candidates(scores, pages, nvp, out=pages[0]), want)
    np.testing.assert_array_equal(pages[0], want)
    with pytest.raises(msaidx.Error, match="^out: overlaps candidate_scores"):
        cp.merge_candidates(scores, pages, nvp, out=scores[1].view(np.int32))
    with pytest.raises(msaidx.Error, match="^out: overlaps candidate_pages"):
        cp.merge_candidates(scores, pages, nvp, out=pages[2])
    with pytest.raises(msaidx.Error, match="^candidate_scores, candidate_pages: no rank"):
        cp.merge_candidates(scores[:0], pages[:0], nvp)
    with pytest.raises(msaidx.Error, match="^candidate_scores: rank stride"):
        cp.merge_candidates(np.broadcast_to(scores[0], scores.shape),
                            np.broadcast_to(pages[0], pages.shape), nvp)


def test_merge_into_strided_out(rng):
    """The merge writes into any view with unit stride on its last dimension, as the one-device
    selection does: here the transpose of vLLM's [H, T, k] top-k buffer."""
    batch = ragged_batch(rng, 2)
    plans = [rank_plan(batch, 2, rank, "interleaved") for rank in range(2)]
    gathered = [plan.prefill_topk_candidates(batch.q, batch.k_cache, 8) for plan in plans]
    scores, pages = np.stack([g[0] for g in gathered]), np.stack([g[1] for g in gathered])
    want = cp.merge_candidates(scores, pages, plans[0].nvp, 8)
    buffer = np.full((2, want.shape[0], 8), -7, np.int32)
    got = cp.merge_candidates(scores, pages, plans[0].nvp, 8, out=buffer.transpose(1, 0, 2))
    assert np.array_equal(buffer.transpose(1, 0, 2), want) and np.shares_memory(got, buffer)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, world, port, seed, layout, result_dir):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = ragged_batch(np.random.default_rng(seed), 4)
        plan = rank_plan(batch, world, rank, layout)
        got = cp.prefill_topk(plan, batch.q, batch.k_cache, topk=16, init_blocks=1,
                              local_blocks=1)
        np.save(os.path.join(result_dir, f"rank{rank}.npy"), np.asarray(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
def test_gloo_two_processes(rng, tmp_path, layout):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    import torch.multiprocessing as mp
    seed = int(rng.integers(2**62))
    mp.spawn(_gloo_rank, args=(2, _free_port(), seed, layout, str(tmp_path)), nprocs=2)
    want = unsharded_selection(ragged_batch(np.random.default_rng(seed), 4), 16, 1, 1)
    for rank in range(2):
        assert np.array_equal(np.load(tmp_path / f"rank{rank}.npy"), want)


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _to_cuda(torch, batch, table=None):
    dtype = torch.float8_e4m3fn if batch.fmt == "e4m3" else torch.bfloat16
    q = torch.from_numpy(batch.q).cuda().view(dtype)
    k_cache = torch.from_numpy(np.ascontiguousarray(batch.k_cache)).cuda().view(dtype)
    table = batch.block_table if table is None else table
    metadata = [torch.from_numpy(np.ascontiguousarray(a)).cuda()
                for a in (table, batch.cu_seqlens_q, batch.seq_lens)]
    return q, k_cache, metadata


@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
def test_simulated_ranks_cuda(rng, layout):
    torch = _cuda_torch()
    for num_heads, fmt, backend, precision in ((1, "e4m3", "auto", "default"),
                                               (2, "bf16", "auto", "exact"),
                                               (4, "e4m3", "dense", "exact"),
                                               (4, "e4m3", "split", "default")):
        batch = ragged_batch(rng, num_heads, fmt)
        B, T = len(batch.seq_lens), batch.num_tokens
        q, k_cache, metadata = _to_cuda(torch, batch)
        whole = msaidx.Plan(num_heads, dtype=fmt, backend=backend, precision=precision,
                            max_batch=B, max_tokens=T, pitch=batch.largest_nvp())
        whole.plan(*metadata)
        for topk, init_blocks, local_blocks in ((16, 0, 1), (4, 1, 2)):
            want = whole.prefill_topk(q, k_cache, topk, init_blocks, local_blocks)
            for world in (1, 2, 3):
                gathered = []
                for rank in range(world):
                    plan = msaidx.Plan(num_heads, dtype=fmt, backend=backend,
                                       precision=precision, max_batch=B, max_tokens=T,
                                       pitch=-(-batch.largest_nvp() // world), cp_world=world,
                                       cp_rank=rank, cp_layout=layout)
                    table = rank_block_table(batch, world, rank, layout)
                    plan.plan(*_to_cuda(torch, batch, table)[2])
                    gathered.append(plan.prefill_topk_candidates(q, k_cache, topk))
                    plan.check()
                scores = torch.stack([g[0] for g in gathered])
                pages = torch.stack([g[1] for g in gathered])
                got = cp.merge_candidates(scores, pages, plan.nvp, topk, init_blocks,
                                          local_blocks)
                assert got.is_cuda
                assert torch.equal(got, want), (num_heads, fmt, backend, topk, world)


def test_nccl_world_one(rng):
    torch = _cuda_torch()
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed without NCCL")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        batch = ragged_batch(rng, 4)
        q, k_cache, metadata = _to_cuda(torch, batch)
        B, T = len(batch.seq_lens), batch.num_tokens
        plan = msaidx.Plan(4, max_batch=B, max_tokens=T, pitch=batch.largest_nvp(),
                           cp_world=1, cp_rank=0)
        plan.plan(*metadata)
        got = cp.prefill_topk(plan, q, k_cache, topk=16, init_blocks=1, local_blocks=1)
        assert torch.equal(got, plan.prefill_topk(q, k_cache, 16, 1, 1))
    finally:
        dist.destroy_process_group()
