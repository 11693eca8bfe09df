"""Plan.prefill_topk and Plan.prefill_topk_candidates: bitwise Plan.topk_select of
Plan.prefill_scores on the same plan (numpy on the cpu backend; torch CUDA on every GPU backend
when there is one), with and without scores_out, into strided outputs, with NaN inputs, padding
rows and rows of nvp <= topk."""

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle
from batches import make_batch

E4M3_NAN = 0x7F
BF16_NAN = 0x7FC0


def nan_batch(rng, fmt, num_heads):
    """Short and long requests (rows of nvp <= topk and rows to select from), padding rows, and
    NaN planted in a few query rows."""
    q_lens = [int(rng.integers(1, 40)) for _ in range(3)]
    prefixes = [int(rng.integers(0, 300)), int(rng.integers(1500, 3000)), 0]
    batch = make_batch(rng, fmt, num_heads, q_lens, prefixes, pad_tokens=2)
    for t in rng.choice(int(batch.cu_seqlens_q[-1]), size=3, replace=False):
        batch.q[t, int(rng.integers(num_heads)), int(rng.integers(128))] = (
            E4M3_NAN if fmt == "e4m3" else BF16_NAN)
    return batch


def expected_candidates(scores, nvp, topk):
    pages = oracle.topk(scores, nvp, topk, 0, 0)
    rows = np.take_along_axis(scores, np.maximum(pages, 0), axis=2)
    values = np.where((pages >= 0) & ~np.isnan(rows), rows, -np.inf).astype(np.float32)
    return values, pages


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_prefill_topk_numpy(rng, fmt):
    for round_ in range(3):
        num_heads = [1, 2, 4][round_]
        batch = nan_batch(rng, fmt, num_heads)
        pitch = batch.largest_nvp() + 1
        plan = msaidx.Plan(num_heads, dtype=fmt, device="cpu", max_batch=3,
                           max_tokens=batch.num_tokens, pitch=pitch)
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
        scores = plan.prefill_scores(batch.q, batch.k_cache)
        nvp = batch.nvp()
        for topk, init_blocks, local_blocks in ((16, 0, 1), (4, 1, 2), (64, 0, 0)):
            want = plan.topk_select(scores, topk, init_blocks, local_blocks)
            assert np.array_equal(want, oracle.topk(scores, nvp, topk, init_blocks, local_blocks))
            got = plan.prefill_topk(batch.q, batch.k_cache, topk, init_blocks, local_blocks)
            assert np.array_equal(got, want)
            scores_out = np.full_like(scores, -np.inf)  # cells past nvp stay unwritten
            got = plan.prefill_topk(batch.q, batch.k_cache, topk, init_blocks, local_blocks,
                                    scores_out=scores_out)
            assert np.array_equal(got, want)
            assert np.array_equal(scores_out.view(np.uint32), scores.view(np.uint32))
            transposed = np.full((num_heads, batch.num_tokens, topk), 7, np.int32)
            plan.prefill_topk(batch.q, batch.k_cache, topk, init_blocks, local_blocks,
                              out=transposed.transpose(1, 0, 2))
            assert np.array_equal(transposed.transpose(1, 0, 2), want)
            values, pages = plan.prefill_topk_candidates(batch.q, batch.k_cache, topk)
            want_values, want_pages = expected_candidates(scores, nvp, topk)
            assert np.array_equal(pages, want_pages)
            assert np.array_equal(values, want_values)
        plan.check()


def test_prefill_topk_errors(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    plan = msaidx.Plan(2, device="cpu", max_batch=2, max_tokens=7, pitch=4, max_seq_len=400)
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    with pytest.raises(msaidx.Error, match="^topk"):
        plan.prefill_topk(batch.q, batch.k_cache, topk=0)
    with pytest.raises(msaidx.Error, match="^init_blocks"):
        plan.prefill_topk(batch.q, batch.k_cache, topk=4, init_blocks=3, local_blocks=2)
    with pytest.raises(msaidx.Error, match="^out"):
        plan.prefill_topk(batch.q, batch.k_cache, out=np.zeros((7, 2, 15), np.int32))
    with pytest.raises(msaidx.Error, match="^scores_out"):
        plan.prefill_topk(batch.q, batch.k_cache, scores_out=np.zeros((7, 2, 3), np.float32))
    with pytest.raises(msaidx.Error, match="^q"):
        plan.prefill_topk(batch.q[:5], batch.k_cache)
    with pytest.raises(msaidx.Error, match="^out"):
        plan.prefill_topk_candidates(batch.q, batch.k_cache,
                                     out=(np.zeros((7, 2, 16), np.float32),
                                          np.zeros((7, 2, 16), np.float32)))


def test_prefill_topk_torch_cuda(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for fmt, backend, precision in (("e4m3", "auto", "default"), ("e4m3", "dense", "exact"),
                                    ("bf16", "auto", "exact"), ("bf16", "split", "default")):
        num_heads = 4
        batch = nan_batch(rng, fmt, num_heads)
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.bfloat16
        q = torch.from_numpy(batch.q).cuda().view(dtype)
        k_cache = torch.from_numpy(np.ascontiguousarray(batch.k_cache)).cuda().view(dtype)
        block_table = torch.from_numpy(np.ascontiguousarray(batch.block_table)).cuda()
        cu = torch.from_numpy(batch.cu_seqlens_q).cuda()
        seq_lens = torch.from_numpy(batch.seq_lens).cuda()
        plan = msaidx.Plan(num_heads, dtype=fmt, backend=backend, precision=precision,
                           max_batch=3, max_tokens=batch.num_tokens, pitch=64)
        plan.plan(block_table, cu, seq_lens)
        scores = plan.prefill_scores(q, k_cache)
        want = plan.topk_select(scores, 16, 1, 1)
        assert torch.equal(plan.prefill_topk(q, k_cache, 16, 1, 1), want)
        scores_out = torch.full_like(scores, float("-inf"))
        assert torch.equal(plan.prefill_topk(q, k_cache, 16, 1, 1, scores_out=scores_out), want)
        assert torch.equal(scores_out.view(torch.int32), scores.view(torch.int32))
        values, pages = plan.prefill_topk_candidates(q, k_cache, 16)
        want_values, want_pages = expected_candidates(scores.cpu().numpy(), batch.nvp(), 16)
        assert np.array_equal(pages.cpu().numpy(), want_pages)
        assert np.array_equal(values.cpu().numpy(), want_values)

        def forward(q, k_cache):
            return plan.prefill_topk(q, k_cache, 16, 1, 1), plan.prefill_topk_candidates(
                q, k_cache, 16)[1]

        compiled = torch.compile(forward, fullgraph=True)(q, k_cache)
        assert torch.equal(compiled[0], want)
        assert torch.equal(compiled[1], pages)
        plan.check()
