"""The torch CUDA path: GPU backends against the numpy oracle, graph capture, device-side checks.

Skipped cleanly without torch, without a CUDA device, or when no GPU backend is compiled in."""

import threading

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle
from batches import make_batch, random_shape

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

DEVICE_BACKENDS = ("dense", "split", "persistent")
FAST_DOT_BOUND = msaidx.FP8_ACCUMULATION_DOT_BOUND  # a dot within this times sum_d |q_d * k_d|


def admitted(fmt, num_heads):
    return [name for name in msaidx.backends(device=0, dtype=fmt, num_heads=num_heads)
            if name in DEVICE_BACKENDS]


if not admitted("e4m3", 4) and not admitted("bf16", 4):
    pytest.skip("no GPU backend in this build of msaidx", allow_module_level=True)


def test_documented_admission():
    """What README and docs/engines.md promise, so that the tests below cannot skip their way
    past a backend that stopped admitting: dense and split every dtype and H; persistent E4M3
    and BF16 at H 1, 2, 4 on an sm_90 device, refused there only by a build without sm_90a."""
    sm90 = torch.cuda.get_device_capability(0) == (9, 0)
    for fmt in ("e4m3", "bf16"):
        for num_heads in (1, 2, 3, 4, 8, 16):
            verdicts = msaidx.backends(device=0, dtype=fmt, num_heads=num_heads, reasons=True)
            assert verdicts["dense"] is None and verdicts["split"] is None, verdicts
            refusal = verdicts["persistent"]
            if sm90 and num_heads in (1, 2, 4) and refusal is not None:
                assert "no sm_90a code" in refusal, refusal


def on_gpu(batch, float8=True):
    """The batch as CUDA tensors with the same layouts (padded page stride, strided rows)."""
    if batch.fmt == "e4m3":
        dtype = torch.float8_e4m3fn if float8 else torch.uint8
        q = torch.from_numpy(batch.q).cuda().view(dtype)
        base = torch.from_numpy(batch.k_base).cuda().view(dtype)
    else:
        q = torch.from_numpy(batch.q.view(np.int16)).cuda().view(torch.bfloat16)
        base = torch.from_numpy(batch.k_base.view(np.int16)).cuda().view(torch.bfloat16)
    num_pages, page, dim = batch.k_cache.shape
    k_cache = torch.as_strided(base, (num_pages, page, dim), (base.shape[1], dim, 1))
    cols = batch.block_table.shape[1]
    block_table = torch.from_numpy(batch.bt_base).cuda()[:, :cols]
    cu = torch.from_numpy(batch.cu_seqlens_q).cuda()
    seq_lens = torch.from_numpy(batch.seq_lens).cuda()
    return q, k_cache, block_table, cu, seq_lens


def check_against_oracle(batch, scores, written_fill):
    scores = scores.cpu().numpy()
    ref = batch.reference(scores.shape[2])
    written = ~np.isnan(ref)
    error = np.abs(scores[written].astype(np.float64) - ref[written])
    bound = oracle.exact_bound(ref[written], batch.abs_dot_maxima(scores.shape[2])[written])
    assert np.all(error <= bound), error.max()
    assert np.all(scores[~written] == written_fill)
    return scores


def check_fast_against_oracle(batch, scores, written_fill):
    """Within the FP8-accumulation bound 131 * 2**-13 * A + 2e-4 * max(1, |ref|), A the page's largest
    sum_d |q_d * k_d|; unwritten cells untouched."""
    scores = scores.cpu().numpy()
    ref = batch.reference(scores.shape[2])
    abs_dots = batch.abs_dot_maxima(scores.shape[2])
    written = ~np.isnan(ref)
    error = np.abs(scores[written].astype(np.float64) - ref[written])
    bound = FAST_DOT_BOUND * abs_dots[written] + 2e-4 * np.maximum(1.0, np.abs(ref[written]))
    assert np.all(error <= bound), (np.count_nonzero(~(error <= bound)), np.nanmax(error / bound))
    assert np.all(scores[~written] == written_fill)
    return scores


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_backends_match_oracle(rng, entry, fmt, num_heads):
    backends = admitted(fmt, num_heads)
    if not backends:
        pytest.skip(f"no GPU backend admits {fmt} H={num_heads}")
    run = msaidx.prefill_scores if entry == "prefill" else msaidx.decode_scores
    for _ in range(2):
        shape = random_shape(rng, decode=entry == "decode", max_prefix=3000)
        print(entry, fmt, num_heads, shape)
        batch = make_batch(rng, fmt, num_heads, **shape)
        args = on_gpu(batch, float8=bool(rng.integers(0, 2)))
        pitch = batch.largest_nvp() + int(rng.integers(0, 4))
        results = {}
        for backend in ["auto"] + backends:
            out = torch.full((batch.num_tokens, num_heads, pitch), 7.0, device="cuda")
            assert run(*args, backend=backend, pitch=pitch, out=out, check=True,
                       precision="exact") is out
            results[backend] = check_against_oracle(batch, out, 7.0)
        if "dense" in results and "split" in results:  # SPEC: split is bitwise dense
            assert np.array_equal(results["dense"].view(np.uint32),
                                  results["split"].view(np.uint32))
        nvp = msaidx.num_valid_pages(args[3], args[4], batch.page, batch.num_tokens)
        assert np.array_equal(nvp.cpu().numpy(), batch.nvp())
        init_blocks, local_blocks = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        scores = torch.from_numpy(results[backends[0]]).cuda()
        picked = msaidx.topk_select(scores, nvp, 16, init_blocks, local_blocks)
        assert np.array_equal(picked.cpu().numpy(),
                              oracle.topk(results[backends[0]], batch.nvp(), 16, init_blocks,
                                          local_blocks))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_fast_accumulation(rng, entry, num_heads):
    """persistent with fast_accumulation=True within the documented bound of the numpy oracle;
    without it, and on every other backend, still exact."""
    backends = admitted("e4m3", num_heads)
    if "persistent" not in backends:
        pytest.skip(f"persistent not admitted for e4m3 H={num_heads}")
    run = msaidx.prefill_scores if entry == "prefill" else msaidx.decode_scores
    shapes = [random_shape(rng, decode=entry == "decode", max_prefix=3000) for _ in range(2)]
    if entry == "prefill":  # several 256-row tiles and long sums of page chunks
        shapes.append(dict(q_lens=[1, 600], prefixes=[5000, 2000], page_pad_bytes=32))
    for shape in shapes:
        print(entry, num_heads, shape)
        batch = make_batch(rng, "e4m3", num_heads, **shape)
        args = on_gpu(batch, float8=bool(rng.integers(0, 2)))
        pitch = batch.largest_nvp() + int(rng.integers(0, 4))
        for backend in ["auto"] + backends:
            for fast in (True, False):
                out = torch.full((batch.num_tokens, num_heads, pitch), 7.0, device="cuda")
                assert run(*args, backend=backend, pitch=pitch, out=out, check=True,
                           fast_accumulation=fast) is out
                if fast and backend in ("auto", "persistent"):  # auto is persistent here
                    check_fast_against_oracle(batch, out, 7.0)
                else:
                    check_against_oracle(batch, out, 7.0)


def test_default_pitch_and_bounds(rng):
    """pitch=None is 8192 on torch; max_seq_len defaults to min(pitch, table width) * page."""
    batch = make_batch(rng, "e4m3", 4, [1, 20], [700, 5], pad_tokens=2)
    args = on_gpu(batch)
    scores = msaidx.prefill_scores(*args, check=True, precision="exact")
    assert scores.shape == (batch.num_tokens, 4, 8192)
    check_against_oracle(batch, scores, -np.inf)
    narrow = msaidx.prefill_scores(*args, pitch=batch.largest_nvp(), check=True, precision="exact")
    assert torch.equal(narrow, scores[:, :, :batch.largest_nvp()])


def test_decode_graph_capture_and_replay(rng):
    """Plan + decode captured once, replayed after the metadata is rewritten in place."""
    num_heads = 4
    backends = admitted("e4m3", num_heads)
    batch = make_batch(rng, "e4m3", num_heads, [1, 2, 1, 8], [900, 40, 2000, 129],
                       extra_pages=20, bt_extra_cols=4)
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = block_table.shape[1]
    out = torch.full((batch.num_tokens, num_heads, pitch), -1.0, device="cuda")
    for backend in ["auto"] + backends:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside capture (context creation)
            msaidx.decode_scores(q, k_cache, block_table, cu, seq_lens, backend, pitch, out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            msaidx.decode_scores(q, k_cache, block_table, cu, seq_lens, backend, pitch, out)
        for _ in range(3):
            shorter = np.array([int(rng.integers(n, s + 1)) for n, s in
                                zip(np.diff(batch.cu_seqlens_q), batch.seq_lens)], np.int32)
            batch.seq_lens[:] = shorter
            seq_lens.copy_(torch.from_numpy(shorter))
            out.fill_(-1.0)
            graph.replay()
            torch.cuda.synchronize()
            check_against_oracle(batch, out, -1.0)


def test_bad_device_metadata_is_reported(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = batch.largest_nvp()
    table = block_table.clone()
    table[1, 0] = k_cache.shape[0] + 5
    out = torch.zeros((batch.num_tokens, 2, pitch), device="cuda")
    msaidx.prefill_scores(q, k_cache, table, cu, seq_lens, pitch=pitch, out=out)  # no check
    torch.cuda.synchronize()
    with pytest.raises(msaidx.Error, match="block_table") as caught:
        msaidx.prefill_scores(q, k_cache, table, cu, seq_lens, pitch=pitch, out=out, check=True)
    assert caught.value.status == "MSAIDX_ERROR_BAD_METADATA"
    too_long = seq_lens.clone()
    too_long[0] = pitch * batch.page + 1  # beyond max_seq_len = pitch * page
    with pytest.raises(msaidx.Error, match="seq_lens"):
        msaidx.prefill_scores(q, k_cache, block_table, cu, too_long, pitch=pitch, check=True)


def test_torch_argument_errors(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    with pytest.raises(msaidx.Error, match="^backend"):
        msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, backend="cpu")
    with pytest.raises(msaidx.Error, match="^seq_lens"):
        msaidx.prefill_scores(q, k_cache, block_table, cu, batch.seq_lens)
    with pytest.raises(msaidx.Error, match="^cu_seqlens_q"):
        msaidx.prefill_scores(q, k_cache, block_table, cu.cpu(), seq_lens)
    with pytest.raises(msaidx.Error, match="^k_cache"):
        msaidx.prefill_scores(q, k_cache.to(torch.bfloat16), block_table, cu, seq_lens)
    with pytest.raises(msaidx.Error, match="^block_table"):
        msaidx.prefill_scores(q, k_cache, block_table.long(), cu, seq_lens)
    with pytest.raises(msaidx.Error, match="^block_table"):  # table narrower than max_seq_len
        msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, max_seq_len=10**6)
    with pytest.raises(msaidx.Error, match="^pitch"):
        msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=1,
                              max_seq_len=2 * batch.page)
    with pytest.raises(msaidx.Error, match="^out"):
        msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=4,
                              out=torch.zeros((batch.num_tokens, 2, 4)))


def test_plan_matches_module_functions_and_strided_topk(rng):
    num_heads = 4
    batch = make_batch(rng, "e4m3", num_heads, [7, 300, 2], [900, 40, 2000], bt_extra_cols=2)
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = block_table.shape[1]
    for precision in ("exact", "default"):
        plan = msaidx.Plan(num_heads, precision=precision, max_batch=3,
                           max_tokens=batch.num_tokens, pitch=pitch)
        plan.plan(block_table, cu, seq_lens)
        want = msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=pitch,
                                     precision=precision, check=True)
        buffer = torch.full((num_heads, batch.num_tokens, 16), -7, dtype=torch.int32,
                            device="cuda")
        for _ in range(3):
            scores = plan.prefill_scores(q, k_cache)
            assert torch.equal(scores, want)
            plan.topk_select(scores, out=buffer.transpose(0, 1))
        plan.check()
        assert torch.equal(plan.nvp.cpu(), torch.from_numpy(batch.nvp().astype(np.int32)))
        assert torch.equal(buffer.transpose(0, 1), msaidx.topk_select(want, plan.nvp))


def test_plan_compile_fullgraph(rng):
    num_heads = 4
    batch = make_batch(rng, "e4m3", num_heads, [7, 300, 2], [900, 40, 2000])
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = 32
    plan = msaidx.Plan(num_heads, max_batch=3, max_tokens=batch.num_tokens, pitch=pitch)

    longest = int(batch.seq_lens.max())  # the forward's own bound (16 pages) under 32

    def forward(q, k_cache, block_table, cu, seq_lens):
        plan.plan(block_table, cu, seq_lens, max_seq_len=longest)
        picks = [plan.prefill_topk(q, k_cache) for _ in range(3)]
        scores = msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens, pitch=pitch)
        nvp = msaidx.num_valid_pages(cu, seq_lens, 128, q.shape[0])
        out = torch.empty((num_heads, q.shape[0], 16), dtype=torch.int32,
                          device=q.device).transpose(0, 1)
        msaidx.topk_select(scores, nvp, out=out)
        return torch.stack(picks), out.contiguous()

    eager = forward(q, k_cache, block_table, cu, seq_lens)
    compiled = torch.compile(forward, fullgraph=True)(q, k_cache, block_table, cu, seq_lens)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_plan_graph_capture(rng):
    """plan() + 4 layers of prefill_topk captured once, replayed after metadata rewrites."""
    num_heads = 4
    batch = make_batch(rng, "e4m3", num_heads, [1, 2, 1, 8], [900, 40, 2000, 129],
                       extra_pages=20, bt_extra_cols=4)
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = block_table.shape[1]
    plan = msaidx.Plan(num_heads, precision="exact", max_batch=4,
                       max_tokens=batch.num_tokens, pitch=pitch)
    scores = torch.full((batch.num_tokens, num_heads, pitch), -1.0, device="cuda")
    picks = torch.empty((4, batch.num_tokens, num_heads, 16), dtype=torch.int32, device="cuda")

    def forward():
        plan.plan(block_table, cu, seq_lens)
        for layer in range(4):
            plan.prefill_topk(q, k_cache, scores_out=scores, out=picks[layer])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm up outside capture: contexts, plans, validation caches
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        shorter = np.array([int(rng.integers(n, s + 1)) for n, s in
                            zip(np.diff(batch.cu_seqlens_q), batch.seq_lens)], np.int32)
        batch.seq_lens[:] = shorter
        seq_lens.copy_(torch.from_numpy(shorter))
        scores.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        got = check_against_oracle(batch, scores, -1.0)
        want = oracle.topk(got, batch.nvp(), 16, 0, 1)
        for layer in range(4):
            assert np.array_equal(picks[layer].cpu().numpy(), want)


def test_plan_drops_geometries_used_on_side_streams(rng):
    """Geometries planned and run on a side stream, left unsynchronised, then dropped by later
    ones: every forward's selection is still bitwise the top-k of its scores, and its scores the
    oracle's (the dropped workspaces wait for the side stream's work before torch reuses them)."""
    num_heads, pitch = 2, 64
    plan = msaidx.Plan(num_heads, precision="exact", max_batch=4, max_tokens=32, pitch=pitch,
                       max_seq_len=8192)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    forwards = []
    with torch.cuda.stream(side):
        for i in range(plan._geometries.MAX_EAGER + 8):
            size = 1 + i % 4
            batch = make_batch(rng, "e4m3", num_heads, [1 + i % 7] * size,
                               [900 * (1 + i % 8)] * size)
            q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
            plan.plan(block_table, cu, seq_lens, num_tokens=q.shape[0])
            picks = plan.prefill_topk(q, k_cache)  # the geometry's own score area
            scores = plan.prefill_scores(q, k_cache)
            forwards.append((batch, picks, scores, plan.topk_select(scores)))
    assert sum(not bound.captured for bound in plan._geometries.values()) \
        <= plan._geometries.MAX_EAGER
    side.synchronize()
    for batch, picks, scores, selected in forwards:
        check_against_oracle(batch, scores, float("-inf"))
        assert torch.equal(picks, selected)


def test_plan_graph_survives_eager_geometries(rng):
    """Continuous batching between replays: eager forwards of many other batch shapes on the same
    Plan (a new geometry each) drop old geometries, never one a captured graph replays."""
    num_heads, pitch = 2, 32
    batch = make_batch(rng, "e4m3", num_heads, [3, 5], [700, 1500])
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    plan = msaidx.Plan(num_heads, precision="exact", max_batch=8, max_tokens=64, pitch=pitch,
                       max_seq_len=4096)
    picks = torch.empty((batch.num_tokens, num_heads, 16), dtype=torch.int32, device="cuda")

    def forward():
        plan.plan(block_table, cu, seq_lens, num_tokens=batch.num_tokens)
        plan.prefill_topk(q, k_cache, out=picks)  # no score buffer: the geometry's own area

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    captured = [bound for bound in plan._geometries.values() if bound.captured]
    assert captured
    for i in range(3 * plan._geometries.MAX_EAGER):
        size = 1 + i % 6
        other = on_gpu(make_batch(rng, "e4m3", num_heads, [1 + i % 5] * size,
                                  [300 * (1 + i % 4)] * size))
        plan.plan(*other[2:], num_tokens=other[0].shape[0])
        plan.prefill_topk(other[0], other[1])
    assert sum(not bound.captured for bound in plan._geometries.values()) \
        <= plan._geometries.MAX_EAGER
    assert all(any(bound is kept for kept in plan._geometries.values()) for bound in captured)
    picks.fill_(-5)
    graph.replay()
    torch.cuda.synchronize()
    replayed = picks.clone()
    plan.plan(block_table, cu, seq_lens, num_tokens=batch.num_tokens)
    scores = torch.full((batch.num_tokens, num_heads, pitch), -1.0, device="cuda")
    assert torch.equal(replayed, plan.prefill_topk(q, k_cache, scores_out=scores))
    want = oracle.topk(check_against_oracle(batch, scores, -1.0), batch.nvp(), 16, 0, 1)
    assert np.array_equal(replayed.cpu().numpy(), want)


def test_plans_on_threads_and_streams(rng):
    """docs/engines.md: one Plan per thread, each thread on a CUDA stream of its own, and the
    module functions from any thread: every layer bitwise what the same call gives alone."""
    num_heads, workers, rounds = 4, 3, 4
    batch = make_batch(rng, "e4m3", num_heads, [7, 300, 2], [900, 40, 2000])
    q, k_cache, block_table, cu, seq_lens = on_gpu(batch)
    pitch = block_table.shape[1]
    signs = torch.from_numpy(rng.integers(0, 2, (workers,) + tuple(q.shape), dtype=np.uint8))
    layers = [(q.view(torch.uint8) ^ (signs[i].cuda() << 7)).view(q.dtype) for i in range(workers)]

    def picks_alone(layer):
        plan = msaidx.Plan(num_heads, max_batch=3, max_tokens=batch.num_tokens, pitch=pitch)
        plan.plan(block_table, cu, seq_lens)
        scores = msaidx.prefill_scores(layer, k_cache, block_table, cu, seq_lens, pitch=pitch)
        return plan.prefill_topk(layer, k_cache), scores

    want = [picks_alone(layer) for layer in layers]
    torch.cuda.synchronize()
    got, errors = [[None] * rounds for _ in range(workers)], []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                plan = msaidx.Plan(num_heads, max_batch=3, max_tokens=batch.num_tokens,
                                   pitch=pitch)
                plan.plan(block_table, cu, seq_lens)
                for r in range(rounds):
                    layer = layers[(i + r) % workers]
                    got[i][r] = (plan.prefill_topk(layer, k_cache),
                                 msaidx.prefill_scores(layer, k_cache, block_table, cu, seq_lens,
                                                       pitch=pitch))
            stream.synchronize()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in range(workers):
        for r in range(rounds):
            picks, scores = got[i][r]
            want_picks, want_scores = want[(i + r) % workers]
            assert torch.equal(picks, want_picks)
            assert torch.equal(scores.view(torch.int32), want_scores.view(torch.int32))
    assert not torch.equal(want[0][1], want[1][1])  # the layers differ, so a mix-up would show
