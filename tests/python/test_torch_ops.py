"""torch.ops.msaidx on torch CPU tensors (the cpu backend): the custom ops are registered, and
torch.compile(fullgraph=True) of the module functions and of the Plan methods gives the eager
result. Skipped without torch; the CUDA counterparts are in test_torch.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import msaidx  # noqa: E402

msaidx.register_torch_ops()  # another suite may have imported msaidx before torch
from batches import make_batch  # noqa: E402


def on_host(batch):
    q = torch.from_numpy(batch.q.view(np.uint8)).view(torch.float8_e4m3fn)
    base = torch.from_numpy(batch.k_base).view(torch.float8_e4m3fn)
    num_pages, page, dim = batch.k_cache.shape
    k_cache = torch.as_strided(base, (num_pages, page, dim), (base.shape[1], dim, 1))
    return (q, k_cache, torch.from_numpy(batch.block_table.copy()),
            torch.from_numpy(batch.cu_seqlens_q), torch.from_numpy(batch.seq_lens))


def test_ops_registered():
    for name in ("scores", "num_valid_pages", "topk_select", "plan_batch", "plan_scores",
                 "plan_topk"):
        assert hasattr(torch.ops.msaidx, name)


def test_torch_cpu_tensors_match_numpy(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 30], [200, 500])
    args = on_host(batch)
    want = msaidx.prefill_scores(*batch.args(), pitch=8)
    got = msaidx.prefill_scores(*args, pitch=8)
    assert isinstance(got, torch.Tensor)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_compile_fullgraph_module_functions(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 30], [200, 500])
    q, k_cache, block_table, cu, seq_lens = on_host(batch)

    def indexer(q, k_cache, block_table, cu, seq_lens):
        scores = msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=8)
        nvp = msaidx.num_valid_pages(cu, seq_lens, 128, q.shape[0])
        out = torch.full((2, q.shape[0], 16), -5, dtype=torch.int32).transpose(0, 1)
        msaidx.topk_select(scores, nvp, 16, 0, 1, out=out)
        return scores, out + 0

    eager = indexer(q, k_cache, block_table, cu, seq_lens)
    compiled = torch.compile(indexer, fullgraph=True, backend="aot_eager")(
        q, k_cache, block_table, cu, seq_lens)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_compile_fullgraph_plan(rng):
    batch = make_batch(rng, "e4m3", 4, [7, 50], [100, 900])
    q, k_cache, block_table, cu, seq_lens = on_host(batch)
    plan = msaidx.Plan(4, device="cpu", max_batch=2, max_tokens=q.shape[0], pitch=8,
                       max_seq_len=1024)

    def forward(q, k_cache, block_table, cu, seq_lens):
        plan.plan(block_table, cu, seq_lens)
        picks = []
        for _ in range(3):  # layers
            picks.append(plan.prefill_topk(q, k_cache, 16, 1, 1))
        return torch.stack(picks)

    eager = forward(q, k_cache, block_table, cu, seq_lens)
    want = msaidx.topk_select(msaidx.prefill_scores(*batch.args(), pitch=8),
                              batch.nvp().astype(np.int32), 16, 1, 1)
    assert np.array_equal(eager[0].numpy(), want)
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(
        q, k_cache, block_table, cu, seq_lens)
    assert torch.equal(eager, compiled)
