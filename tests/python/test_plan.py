"""msaidx.Plan on the cpu backend (numpy), strided outputs, and the conversions' input handling.

Every Plan result is compared with the module functions, which the other suites check against
the numpy oracle."""

import numpy as np
import pytest

import msaidx
import msaidx.distributed
import msaidx_oracle as oracle
from batches import make_batch, random_shape


def host_plan(batch, pitch, **bounds):
    return msaidx.Plan(batch.num_heads, dtype=batch.fmt, device="cpu",
                       max_batch=len(batch.seq_lens) + 1, max_tokens=batch.num_tokens + 3,
                       pitch=pitch, page_size=batch.page, **bounds)


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_plan_matches_module_functions(rng, fmt):
    for _ in range(3):
        shape = random_shape(rng)
        batch = make_batch(rng, fmt, int(rng.integers(1, 5)), **shape)
        pitch = batch.largest_nvp() + int(rng.integers(0, 3))
        plan = host_plan(batch, pitch, max_seq_len=int(batch.seq_lens.max()))
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  num_tokens=batch.num_tokens)
        assert np.array_equal(plan.nvp, batch.nvp())
        want = msaidx.prefill_scores(*batch.args(), pitch=pitch)
        for layer in range(3):  # layers reuse the plan; the second onward takes the cached path
            got = plan.prefill_scores(batch.q, batch.k_cache)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), layer
            decoded = plan.decode_scores(batch.q, batch.k_cache)
            assert np.array_equal(decoded.view(np.uint32), want.view(np.uint32)), layer
            picked = plan.topk_select(got, 16, 1, 2)
            assert np.array_equal(picked, oracle.topk(want, batch.nvp(), 16, 1, 2))
            scores_out = np.full_like(want, 5.0)
            fused = plan.prefill_topk(batch.q, batch.k_cache, 16, 1, 2, scores_out=scores_out)
            assert np.array_equal(fused, picked)
        plan.check()


def test_step_scored_by_two_plans_selected_once(rng):
    """An engine step as docs/engines.md recommends: the prefill chunk and the decode rows planned
    apart, their scores written into one buffer (decode rows after the chunk's), and one top-k
    of every row by one msaidx.num_valid_pages of the whole step."""
    for num_heads in (1, 4):
        chunk, decode = 37, 5
        batch = make_batch(rng, "e4m3", num_heads, [chunk] + [1] * decode,
                           [300] + [int(x) for x in rng.integers(1, 900, decode)])
        pitch = batch.largest_nvp()
        bounds = dict(device="cpu", pitch=pitch, max_seq_len=int(batch.seq_lens.max()))
        chunk_plan = msaidx.Plan(num_heads, max_batch=1, max_tokens=chunk, **bounds)
        decode_plan = msaidx.Plan(num_heads, max_batch=decode, max_tokens=decode, **bounds)
        chunk_plan.plan(batch.block_table[:1], batch.cu_seqlens_q[:2], batch.seq_lens[:1])
        decode_plan.plan(batch.block_table[1:], batch.cu_seqlens_q[1:] - chunk,
                         batch.seq_lens[1:])
        nvp = msaidx.num_valid_pages(batch.cu_seqlens_q, batch.seq_lens)  # once per forward
        scores = np.full((chunk + decode, num_heads, pitch), -np.inf, np.float32)
        chunk_plan.prefill_scores(batch.q[:chunk], batch.k_cache, out=scores[:chunk])
        decode_plan.decode_scores(batch.q[chunk:], batch.k_cache, out=scores[chunk:])
        # the same as each plan selecting its own rows
        want = np.concatenate([chunk_plan.topk_select(scores[:chunk]),
                               decode_plan.topk_select(scores[chunk:])])
        assert np.array_equal(msaidx.topk_select(scores, nvp), want), num_heads
        assert np.array_equal(nvp, batch.nvp())


def test_plan_replans_per_forward(rng):
    """One Plan, several forwards of different batches (same bounds): each plan() rebinds."""
    plan = msaidx.Plan(2, device="cpu", max_batch=4, max_tokens=700, pitch=8, max_seq_len=1024)
    for _ in range(4):
        batch = make_batch(rng, "e4m3", 2, **random_shape(rng, max_prefix=500))
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  num_tokens=batch.num_tokens)
        want = msaidx.prefill_scores(*batch.args(), pitch=8)
        got = plan.prefill_scores(batch.q, batch.k_cache)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(plan.topk_select(got), msaidx.topk_select(want, batch.nvp().astype(np.int32)))


def test_plan_forward_max_seq_len(rng):
    """plan(max_seq_len=) bounds one forward under a wide pitch (as engines size it): the same
    scores and selection; bounds rounded up to a power of two pages share one geometry; a bound
    above the Plan's, or a request above the (rounded) bound, is refused by name."""
    pitch = 64
    plan = msaidx.Plan(2, device="cpu", max_batch=4, max_tokens=700, pitch=pitch)
    for _ in range(3):
        batch = make_batch(rng, "e4m3", 2, **random_shape(rng, max_prefix=500))
        longest = int(batch.seq_lens.max())
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  num_tokens=batch.num_tokens, max_seq_len=longest)
        want = msaidx.prefill_scores(*batch.args(), pitch=pitch)
        got = plan.prefill_scores(batch.q, batch.k_cache)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        picked = plan.topk_select(got, 16, 1, 2)
        assert np.array_equal(picked, oracle.topk(want, batch.nvp(), 16, 1, 2))
        assert np.array_equal(plan.prefill_topk(batch.q, batch.k_cache, 16, 1, 2), picked)
        plan.check()
    assert plan._max_seq_len_arg(300) == plan._max_seq_len_arg(512) == 512
    assert plan._max_seq_len_arg(513) == 1024 and plan._max_seq_len_arg(0) == 128
    with pytest.raises(msaidx.Error, match="^max_seq_len"):
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  max_seq_len=pitch * 128 + 1)
    batch = make_batch(rng, "e4m3", 2, [3, 4], [700, 10])
    # 512 after rounding, below 703. On the cpu, plan() refuses it where a layer ran on this
    # geometry before (a random batch above may have left one), else the first layer call.
    with pytest.raises(msaidx.Error, match="max_seq_len"):
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  num_tokens=batch.num_tokens, max_seq_len=300)
        plan.prefill_scores(batch.q, batch.k_cache)


def test_plan_errors(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    with pytest.raises(msaidx.Error, match="^precision"):
        msaidx.Plan(2, device="cpu", max_batch=2, max_tokens=7, precision="fast")
    with pytest.raises(msaidx.Error, match="^backend"):
        msaidx.Plan(2, device="cpu", max_batch=2, max_tokens=7, backend="persistent")
    with pytest.raises(msaidx.Error, match="^max_batch"):
        msaidx.Plan(2, device="cpu", max_tokens=7)
    plan = msaidx.Plan(2, device="cpu", max_batch=2, max_tokens=7, pitch=4, max_seq_len=400)
    with pytest.raises(msaidx.Error, match="^plan"):
        plan.prefill_scores(batch.q, batch.k_cache)
    with pytest.raises(msaidx.Error, match="^cu_seqlens_q"):
        plan.plan(batch.block_table, np.zeros(5, np.int32), batch.seq_lens)
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    with pytest.raises(msaidx.Error, match="^q"):
        plan.prefill_scores(batch.q[:5], batch.k_cache)
    with pytest.raises(msaidx.Error, match="^out"):
        plan.prefill_scores(batch.q, batch.k_cache, out=np.zeros((7, 2, 3), np.float32))
    bad = batch.block_table.copy()
    bad[1, 0] = batch.k_cache.shape[0] + 3
    plan.plan(bad, batch.cu_seqlens_q, batch.seq_lens)
    with pytest.raises(msaidx.Error, match="block_table"):  # planned at the first layer
        plan.prefill_scores(batch.q, batch.k_cache)
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    plan.prefill_scores(batch.q, batch.k_cache)
    with pytest.raises(msaidx.Error, match="block_table"):  # the cache geometry is known now
        plan.plan(bad, batch.cu_seqlens_q, batch.seq_lens)
    # A block table too narrow for a request: the message says where the bound came from.
    plan.plan(batch.block_table[:, :1], batch.cu_seqlens_q, batch.seq_lens)
    with pytest.raises(msaidx.Error, match="seq_lens.*the 1 columns of block_table hold"):
        plan.prefill_scores(batch.q, batch.k_cache)

    # A layer refused for a k_cache that the planned block table does not fit leaves nothing
    # behind: later forwards plan and run as before (tests/python/fuzz_api.py found plan()
    # failing on every forward after one such call).
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    want = plan.prefill_scores(batch.q, batch.k_cache)
    with pytest.raises(msaidx.Error, match="block_table"):
        plan.prefill_scores(batch.q, batch.k_cache[:-1])
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens)
    np.testing.assert_array_equal(plan.prefill_scores(batch.q, batch.k_cache), want)
    # Top-k parameters of any type: msaidx.Error naming them (they key the layer cache).
    for name, call in (("topk", lambda: plan.topk_select(want, [4])),
                       ("init_blocks", lambda: plan.prefill_topk(batch.q, batch.k_cache, 4, 0.5)),
                       ("local_blocks", lambda: plan.prefill_topk(batch.q, batch.k_cache, 4, 0,
                                                                  {}))):
        with pytest.raises(msaidx.Error, match=f"^{name}"):
            call()

    # Arguments that are not arrays: msaidx.Error naming them, from every Plan method.
    out = np.full((7, 2, 4), -np.inf, np.float32)
    picks = np.zeros((7, 2, 4), np.int32)
    for name, call in (
            ("k_cache", lambda: plan.prefill_scores(batch.q, batch.k_cache.tolist())),
            ("q", lambda: plan.prefill_scores(batch.q.tolist(), batch.k_cache, out=out)),
            ("out", lambda: plan.decode_scores(batch.q, batch.k_cache, out=out.tolist())),
            ("scores", lambda: plan.topk_select(out.tolist(), 4, out=picks)),
            ("scores_out", lambda: plan.prefill_topk(batch.q, batch.k_cache, 4, scores_out=[0.0])),
            ("out", lambda: plan.prefill_topk_candidates(batch.q, batch.k_cache, 4, out=picks))):
        with pytest.raises(msaidx.Error, match=f"^{name}"):
            call()


def test_plan_outputs_over_inputs_are_refused(rng):
    """A Plan layer call refuses an output laid over its q or k_cache, naming it, as the module
    functions do; the inputs stay as they were (the call ran and overwrote q before)."""
    batch = make_batch(rng, "e4m3", 1, [3], [300])
    pitch = batch.largest_nvp()
    num_tokens, num_heads = batch.num_tokens, batch.num_heads
    plan = host_plan(batch, pitch)
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens, num_tokens=num_tokens)
    want = plan.prefill_scores(batch.q, batch.k_cache)
    # q inside a float32 buffer whose first cells an out view covers.
    words = np.zeros(batch.q.size // 4 + num_tokens * num_heads * pitch, np.float32)
    q = words.view(np.uint8)[:batch.q.size].reshape(batch.q.shape)
    q[...] = batch.q
    over_q = words[:num_tokens * num_heads * pitch].reshape(num_tokens, num_heads, pitch)
    cache_words = batch.k_cache.copy().view(np.float32).reshape(-1)
    k_cache = cache_words.view(np.uint8).reshape(batch.k_cache.shape)
    over_k = cache_words[:num_tokens * num_heads * pitch].reshape(num_tokens, num_heads, pitch)
    picks_over_q = words.view(np.int32)[:num_tokens * num_heads * 4].reshape(
        num_tokens, num_heads, 4)
    for name, call in (
            ("out", lambda: plan.prefill_scores(q, batch.k_cache, out=over_q)),
            ("out", lambda: plan.decode_scores(batch.q, k_cache, out=over_k)),
            ("scores_out", lambda: plan.prefill_topk(q, batch.k_cache, 4, scores_out=over_q)),
            ("out", lambda: plan.prefill_topk(q, batch.k_cache, 4, out=picks_over_q)),
            ("out", lambda: plan.prefill_topk_candidates(q, batch.k_cache, 4,
                                                        out=(np.zeros_like(picks_over_q,
                                                                           np.float32),
                                                             picks_over_q)))):
        with pytest.raises(msaidx.Error, match=f"^{name}(\\[1\\])?: overlaps"):
            call()
        assert np.array_equal(q, batch.q) and np.array_equal(k_cache, batch.k_cache)
    np.testing.assert_array_equal(plan.prefill_scores(q, k_cache), want)


def test_plan_score_free_workspace_follows_the_forward(rng):
    """prefill_topk without a score buffer keeps T x H x (pages of the forward's max_seq_len)
    floats, not T x H x pitch (engines size the pitch for their longest context), and selects as
    topk_select of prefill_scores under the wide pitch."""
    num_heads, pitch = 2, 512
    plan = msaidx.Plan(num_heads, device="cpu", max_batch=4, max_tokens=300, pitch=pitch)
    for longest in (700, 5000):
        batch = make_batch(rng, "e4m3", num_heads, [40, 3, 9], [longest - 40, 200, 11])
        plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                  num_tokens=batch.num_tokens, max_seq_len=longest)
        scores = plan.prefill_scores(batch.q, batch.k_cache)
        assert scores.shape[2] == pitch
        picks = plan.prefill_topk(batch.q, batch.k_cache, 8, 1, 1)
        assert np.array_equal(picks, plan.topk_select(scores, 8, 1, 1))
        row_pages = 1 << (-(-longest // 128) - 1).bit_length()  # the bound, rounded up
        workspaces = [bound.topk_workspace[2] for bound in plan._geometries.values()
                      if bound.topk_workspace is not None]
        assert max(workspaces) <= batch.num_tokens * num_heads * row_pages * 4 + 256, workspaces


def test_plan_memory_is_bounded_under_continuous_batching(rng):
    """A new (B, T) almost every forward, as continuous batching plans: the Plan keeps a bounded
    number of geometries (each with a workspace and, after prefill_topk without a score buffer,
    T x H x row pages floats), and still gives the module functions' results."""
    import tracemalloc
    plan = msaidx.Plan(2, device="cpu", max_batch=8, max_tokens=64, pitch=16, max_seq_len=2048)
    batches = [make_batch(rng, "e4m3", 2, [1 + (i % 7)] * (1 + i % 8), [1900] * (1 + i % 8))
               for i in range(56)]
    tracemalloc.start()
    try:
        for i, batch in enumerate(batches):
            num_tokens = batch.q.shape[0]
            plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                      num_tokens=num_tokens)
            picks = plan.prefill_topk(batch.q, batch.k_cache, 4)
            if i == 20:
                held = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - held
    finally:
        tracemalloc.stop()
    scores = msaidx.prefill_scores(batch.q, batch.k_cache, batch.block_table, batch.cu_seqlens_q,
                                   batch.seq_lens, pitch=16)
    assert np.array_equal(picks, msaidx.topk_select(scores, batch.nvp().astype(np.int32), 4))
    # 35 more geometries than at forward 20 held ~190 KB when none was dropped; a bounded Plan
    # holds as much as at forward 20 (~8 KB of other Python objects)
    assert grown < 32 * 1024, grown


@pytest.mark.parametrize("num_heads", [1, 3])
def test_topk_out_strided(rng, num_heads):
    """out as the transpose of an [H, T, k] buffer, and a column slice of a wider one."""
    batch = make_batch(rng, "e4m3", num_heads, [5, 40], [300, 1000])
    scores = msaidx.prefill_scores(*batch.args())
    nvp = batch.nvp().astype(np.int32)
    want = msaidx.topk_select(scores, nvp, 8, 1, 1)
    buffer = np.full((num_heads, batch.num_tokens, 8), -7, np.int32)
    assert msaidx.topk_select(scores, nvp, 8, 1, 1, out=buffer.transpose(1, 0, 2)) \
        is not None
    assert np.array_equal(buffer.transpose(1, 0, 2), want)
    wide = np.full((batch.num_tokens, num_heads, 11), -7, np.int32)
    msaidx.topk_select(scores, nvp, 8, 1, 1, out=wide[:, :, 2:10])
    assert np.array_equal(wide[:, :, 2:10], want)
    assert np.all(wide[:, :, :2] == -7) and np.all(wide[:, :, 10:] == -7)
    plan = host_plan(batch, scores.shape[2])
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens, num_tokens=batch.num_tokens)
    buffer[:] = -7
    plan.topk_select(plan.prefill_scores(batch.q, batch.k_cache), 8, 1, 1,
                     out=buffer.transpose(1, 0, 2))
    assert np.array_equal(buffer.transpose(1, 0, 2), want)
    with pytest.raises(msaidx.Error, match="^out"):  # last dimension not unit stride
        msaidx.topk_select(scores, nvp, 8, 1, 1,
                           out=np.zeros((batch.num_tokens, num_heads, 16), np.int32)[:, :, ::2])
    if num_heads > 1:
        with pytest.raises(msaidx.Error, match="out_stride"):  # rows overlap
            overlapping = np.lib.stride_tricks.as_strided(
                np.zeros(1000, np.int32), (batch.num_tokens, num_heads, 8), (16, 4, 4))
            msaidx.topk_select(scores, nvp, 8, 1, 1, out=overlapping)


def test_scores_out_column_view(rng):
    """A scores out that is the first `pitch` columns of a wider array: cells past nvp and the
    columns past pitch are never written."""
    batch = make_batch(rng, "bf16", 2, [3, 9], [130, 700])
    pitch = batch.largest_nvp()
    want = msaidx.prefill_scores(*batch.args(), pitch=pitch)
    wide = np.full((batch.num_tokens, 2, pitch + 5), 3.0, np.float32)
    msaidx.prefill_scores(*batch.args(), pitch=pitch, out=wide[:, :, :pitch])
    written = ~np.isneginf(want)
    assert np.array_equal(wide[:, :, :pitch][written], want[written])
    assert np.all(wide[:, :, :pitch][~written] == 3.0) and np.all(wide[:, :, pitch:] == 3.0)
    with pytest.raises(msaidx.Error, match="^out"):
        msaidx.prefill_scores(*batch.args(), pitch=pitch,
                              out=np.zeros((2, batch.num_tokens, pitch), np.float32)
                              .transpose(1, 0, 2))


def test_precision_keyword(rng):
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    exact = msaidx.prefill_scores(*batch.args(), precision="exact")
    default = msaidx.prefill_scores(*batch.args(), precision="default")  # cpu: exact either way
    assert np.array_equal(exact.view(np.uint32), default.view(np.uint32))
    with pytest.raises(msaidx.Error, match="^precision"):
        msaidx.prefill_scores(*batch.args(), precision="fast")
    with pytest.raises(msaidx.Error, match="^fast_accumulation"):
        msaidx.prefill_scores(*batch.args(), precision="exact", fast_accumulation=True)


def test_misaligned_inputs_are_copied(rng):
    """Contiguous arrays at odd addresses convert like aligned ones."""
    values = rng.standard_normal(33).astype(np.float32)
    raw = np.zeros(33 * 4 + 1, np.uint8)
    shifted = raw[1:].view(np.float32)
    shifted[:] = values
    assert shifted.ctypes.data % 4 and shifted.flags.c_contiguous
    assert np.array_equal(msaidx.e4m3_from_float(shifted), msaidx.e4m3_from_float(values))
    assert np.array_equal(msaidx.bf16_from_float(shifted), msaidx.bf16_from_float(values))
    bits = msaidx.bf16_from_float(values)
    raw16 = np.zeros(33 * 2 + 1, np.uint8)
    shifted16 = raw16[1:].view(np.uint16)
    shifted16[:] = bits
    assert np.array_equal(msaidx.bf16_to_float(shifted16), msaidx.bf16_to_float(bits))


def test_num_valid_pages_checks_before_allocating():
    """An INT32_MAX tail would size an 8 GiB output: it is rejected first, naming the entry."""
    cu = np.array([0, 3, 2**31 - 1], np.int32)
    with pytest.raises(msaidx.Error, match=r"^seq_lens\[1\]"):
        msaidx.num_valid_pages(cu, np.array([10, 20], np.int32))
    with pytest.raises(msaidx.Error, match=r"^cu_seqlens_q\[2\]"):
        msaidx.num_valid_pages(np.array([0, 5, 4], np.int32), np.array([10, 20], np.int32))
    with pytest.raises(msaidx.Error, match=r"^cu_seqlens_q\[0\]"):
        msaidx.num_valid_pages(np.array([1, 5], np.int32), np.array([10], np.int32))


def test_plan_checks_before_writing_or_allocating(rng):
    """A Plan's cached validation still refuses a read-only out of the same layout; arguments
    are checked before an output is allocated beside them; nvp needs plan() first."""
    batch = make_batch(rng, "e4m3", 2, [3, 4], [200, 10])
    plan = host_plan(batch, 4, max_seq_len=400)
    with pytest.raises(msaidx.Error, match="^plan"):
        plan.nvp
    plan.plan(batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
              num_tokens=batch.num_tokens)
    out = np.zeros((batch.num_tokens, batch.num_heads, 4), np.float32)
    plan.prefill_scores(batch.q, batch.k_cache, out=out)
    frozen = np.full_like(out, 7.0)
    frozen.flags.writeable = False
    with pytest.raises(msaidx.Error, match="^out.*read-only"):
        plan.prefill_scores(batch.q, batch.k_cache, out=frozen)
    assert (frozen == 7.0).all()
    picks = np.zeros((batch.num_tokens, batch.num_heads, 16), np.int32)
    plan.topk_select(out, out=picks)
    picks.flags.writeable = False
    with pytest.raises(msaidx.Error, match="^out.*read-only"):
        plan.topk_select(out, out=picks)
    with pytest.raises(msaidx.Error, match="^topk"):
        plan.topk_select(out, topk=10**12)
    with pytest.raises(msaidx.Error, match="^topk"):
        plan.prefill_topk(batch.q, batch.k_cache, topk=10**12)
    with pytest.raises(msaidx.Error, match="^topk"):
        plan.prefill_topk_candidates(batch.q, batch.k_cache, topk=10**12)
    with pytest.raises(msaidx.Error, match="^q"):
        plan.prefill_scores([[0]], batch.k_cache)
    with pytest.raises(msaidx.Error, match="^scores"):
        plan.topk_select([[0.0]])


def test_empty_arrays_of_any_strides(rng):
    """numpy 2 gives empty arrays zero strides: an empty batch and an empty merge still run."""
    q = np.zeros((0, 1, 128), np.uint8)
    k_cache = np.zeros((2, 128, 128), np.uint8)
    scores = msaidx.prefill_scores(q, k_cache, np.zeros((0, 4), np.int32), np.zeros(1, np.int32),
                                   np.zeros(0, np.int32))
    assert scores.shape[:2] == (0, 1)
    merged = msaidx.distributed.merge_candidates(np.zeros((2, 0, 1, 4), np.float32),
                                                 np.zeros((2, 0, 1, 4), np.int32),
                                                 np.zeros(0, np.int32), 4)
    assert merged.shape == (0, 1, 4)
