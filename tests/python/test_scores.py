"""prefill_scores / decode_scores / num_valid_pages on the cpu backend against the numpy oracle."""

import threading

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle
from batches import make_batch, random_shape

POISON = np.uint32(0x7FBADBAD)  # a NaN payload no scorer produces


def poisoned(shape):
    return np.full(shape, POISON, dtype=np.uint32).view(np.float32)


def random_batch(rng, fmt):
    """A random ragged batch with a random head count (printed, so a failure can be replayed)."""
    shape = random_shape(rng)
    num_heads = int(rng.choice([1, 2, 4]))
    print(fmt, num_heads, shape)
    return make_batch(rng, fmt, num_heads, **shape), num_heads


def check_scores(batch, scores, untouched):
    """Written cells within tolerance of FP64, unwritten ones bitwise equal to `untouched`."""
    ref = batch.reference(scores.shape[2])
    written = ~np.isnan(ref)
    got = scores[written].astype(np.float64)
    want = ref[written]
    error = np.abs(got - want)
    bound = oracle.exact_bound(want, batch.abs_dot_maxima(scores.shape[2])[written])
    assert np.all(error <= bound), (
        f"{np.count_nonzero(error > bound)} cells off, worst {error.max()} "
        f"(got {got[np.argmax(error - bound)]}, want {want[np.argmax(error - bound)]})")
    fill = np.broadcast_to(np.asarray(untouched, dtype=np.float32), scores.shape)
    assert np.array_equal(scores.view(np.uint32)[~written], fill.view(np.uint32)[~written]), \
        "a cell with p >= nvp was written"
    return ref


def check_topk(scores, nvp, rng):
    init_blocks, local_blocks = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    got = msaidx.topk_select(scores, nvp.astype(np.int32), 16, init_blocks, local_blocks)
    want = oracle.topk(scores, nvp, 16, init_blocks, local_blocks)
    assert np.array_equal(got, want), f"init {init_blocks} local {local_blocks}"


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_prefill_random_batches(rng, fmt, num_heads):
    for _ in range(2):
        shape = random_shape(rng)
        print(fmt, num_heads, shape)
        batch = make_batch(rng, fmt, num_heads, **shape)
        scores = msaidx.prefill_scores(*batch.args())
        assert scores.dtype == np.float32
        assert scores.shape == (batch.num_tokens, num_heads, batch.largest_nvp())
        check_scores(batch, scores, -np.inf)
        check_topk(scores, batch.nvp(), rng)


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_explicit_pitch_into_poisoned_out(rng, fmt):
    batch, num_heads = random_batch(rng, fmt)
    pitch = batch.largest_nvp() + int(rng.integers(0, 6))
    out = poisoned((batch.num_tokens, num_heads, pitch))
    result = msaidx.prefill_scores(*batch.args(), pitch=pitch, out=out)
    assert result is out
    check_scores(batch, out, POISON.view(np.float32))
    # pitch=None with out given takes the pitch from out
    again = poisoned(out.shape)
    msaidx.prefill_scores(*batch.args(), out=again)
    assert np.array_equal(again.view(np.uint32), out.view(np.uint32))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_decode_scores(rng, fmt, num_heads):
    shape = random_shape(rng, decode=True, max_prefix=2500)
    print(fmt, num_heads, shape)
    batch = make_batch(rng, fmt, num_heads, **shape)
    pitch = batch.largest_nvp() + int(rng.integers(0, 3))
    out = poisoned((batch.num_tokens, num_heads, pitch))
    assert msaidx.decode_scores(*batch.args(), pitch=pitch, out=out) is out
    check_scores(batch, out, POISON.view(np.float32))
    prefill = msaidx.prefill_scores(*batch.args(), pitch=pitch, out=poisoned(out.shape))
    assert np.array_equal(prefill.view(np.uint32), out.view(np.uint32))
    check_topk(out, batch.nvp(), rng)


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_fast_accumulation_is_exact_on_cpu(rng, fmt):
    """numpy runs on the cpu backend, which ignores fast_accumulation: bitwise the exact result."""
    batch, num_heads = random_batch(rng, fmt)
    for run in (msaidx.prefill_scores, msaidx.decode_scores):
        exact = run(*batch.args())
        fast = run(*batch.args(), fast_accumulation=True)
        assert np.array_equal(fast.view(np.uint32), exact.view(np.uint32))
        check_scores(batch, fast, -np.inf)
        assert np.array_equal(run(*batch.args(), fast_accumulation=False).view(np.uint32),
                              exact.view(np.uint32))


@pytest.mark.parametrize("dim,page", [(64, 32), (32, 16), (256, 64), (16, 512)])
def test_generic_head_dim_and_page(rng, dim, page):
    """The cpu backend takes any D and page that are multiples of 16."""
    fmt = str(rng.choice(["e4m3", "bf16"]))
    shape = random_shape(rng, max_prefill=100, max_prefix=3 * page, page=page)
    print(fmt, dim, page, shape)
    batch = make_batch(rng, fmt, 2, dim=dim, **shape)
    check_scores(batch, msaidx.prefill_scores(*batch.args()), -np.inf)


def test_distinct_page_scores_are_exact(rng):
    """SPEC section 9: q = 1 and page p filled with a distinct E4M3 constant c_p: every score is
    exactly D * c_p = 128 * c_p (every key of a page is the same), and top-k is exact."""
    constants = np.concatenate([np.arange(1, 17), np.arange(18, 33, 2), np.arange(36, 65, 4),
                                np.arange(72, 129, 8)]).astype(np.float32)
    order = rng.permutation(len(constants))
    pages = len(constants)
    q_len = 200
    seq_len = pages * 128 - int(rng.integers(0, 100))
    k_cache = np.zeros((pages, 128, 128), dtype=np.uint8)
    for p in range(pages):
        k_cache[p] = oracle.e4m3_encode(constants[order[p]])
    q = np.full((q_len, 4, 128), oracle.e4m3_encode(1.0), dtype=np.uint8)
    block_table = np.arange(pages, dtype=np.int32)[None, :]
    cu = np.array([0, q_len], dtype=np.int32)
    seq_lens = np.array([seq_len], dtype=np.int32)
    scores = msaidx.prefill_scores(q, k_cache, block_table, cu, seq_lens)
    nvp = oracle.visible_pages(cu, seq_lens, 128, q_len)
    for i in range(q_len):
        pos = seq_len - q_len + i
        assert nvp[i] == pos // 128 + 1
        want = 128 * constants[order[:nvp[i]]]
        assert np.array_equal(scores[i, :, :nvp[i]], np.broadcast_to(want, (4, nvp[i])))
    assert np.array_equal(msaidx.topk_select(scores, nvp.astype(np.int32)),
                          oracle.topk(scores, nvp, 16, 0, 1))


def test_page_boundaries(rng):
    """SPEC section 9: q_lens [127, 128, 129, 1, 1, 256] after prefixes [0, 1, 127, 128, 255,
    384], E4M3, H = 4, scattered pages."""
    batch = make_batch(rng, "e4m3", 4, [127, 128, 129, 1, 1, 256], [0, 1, 127, 128, 255, 384],
                       page_pad_bytes=32, extra_pages=3)
    check_scores(batch, msaidx.prefill_scores(*batch.args()), -np.inf)


def test_all_padding_and_empty_batches(rng):
    """B = 0 with padding tokens; requests without tokens; T = 0."""
    k_cache = np.zeros((1, 128, 128), dtype=np.uint8)
    q = np.zeros((3, 2, 128), dtype=np.uint8)
    none = np.zeros((0,), dtype=np.int32)
    block_table = np.zeros((0, 1), dtype=np.int32)
    scores = msaidx.prefill_scores(q, k_cache, block_table, np.zeros(1, np.int32), none)
    assert scores.shape == (3, 2, 1) and np.all(scores == -np.inf)
    nvp = msaidx.num_valid_pages(np.zeros(1, np.int32), none, num_tokens=3)
    assert np.array_equal(nvp, [0, 0, 0])
    assert np.all(msaidx.topk_select(scores, nvp) == -1)

    batch = make_batch(rng, "bf16", 1, [0, 5, 0], [300, 7, 0], pad_tokens=2)
    check_scores(batch, msaidx.prefill_scores(*batch.args()), -np.inf)

    empty = msaidx.prefill_scores(np.zeros((0, 4, 128), np.uint8), k_cache, block_table,
                                  np.zeros(1, np.int32), none)
    assert empty.shape == (0, 4, 1)


@pytest.mark.parametrize("page", [16, 128])
def test_num_valid_pages(rng, page):
    shape = random_shape(rng, page=page)
    print(page, shape)
    q_lens = np.asarray(shape["q_lens"])
    seq_lens = (np.asarray(shape["prefixes"]) + q_lens).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    got = msaidx.num_valid_pages(cu, seq_lens, page_size=page)
    assert got.dtype == np.int32
    assert np.array_equal(got, oracle.visible_pages(cu, seq_lens, page, int(cu[-1])))
    padded = np.full(int(cu[-1]) + 3, -5, dtype=np.int32)
    assert msaidx.num_valid_pages(cu, seq_lens, page, len(padded), out=padded) is padded
    assert np.array_equal(padded, oracle.visible_pages(cu, seq_lens, page, len(padded)))


def test_repeatable_and_thread_safe(rng):
    """Bitwise equal results run to run and from concurrent threads (shared cached contexts)."""
    batch = make_batch(rng, "e4m3", 4, [3, 40, 1], [500, 70, 129], pad_tokens=1)
    first = msaidx.prefill_scores(*batch.args())
    results, errors = [None] * 4, []

    def work(i):
        try:
            results[i] = msaidx.prefill_scores(*batch.args())
            if i % 2:  # an error on one thread must not leak into another's message
                try:
                    msaidx.topk_select(first, np.zeros(2, np.int32))
                except msaidx.Error as error:
                    assert str(error).startswith("nvp")
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for result in results:
        assert np.array_equal(result.view(np.uint32), first.view(np.uint32))


def test_spec_mixed_prefixes_and_decode_first(rng):
    """SPEC section 9: q_lens [300, 1, 700, 2049] after prefixes [0, 1000, 130, 5000] (H = 1),
    and the decode-first mix seq_lens [2305, 2561, 2624, 2720] with q_lens [1, 1, 64, 96]
    (H = 4), both with padded pages and scattered tables."""
    batch = make_batch(rng, "e4m3", 1, [300, 1, 700, 2049], [0, 1000, 130, 5000],
                       page_pad_bytes=64, bt_row_pad=2, extra_pages=5)
    check_scores(batch, msaidx.prefill_scores(*batch.args()), -np.inf)
    q_lens = [1, 1, 64, 96]
    prefixes = [s - n for s, n in zip([2305, 2561, 2624, 2720], q_lens)]
    batch = make_batch(rng, "bf16", 4, q_lens, prefixes, pad_tokens=3, extra_rows=2)
    scores = msaidx.decode_scores(*batch.args(), pitch=40)
    check_scores(batch, scores, -np.inf)
    check_topk(scores, batch.nvp(), rng)


def test_ml_dtypes_arrays_are_read_as_their_bits(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for fmt, dtype in (("e4m3", ml_dtypes.float8_e4m3fn), ("bf16", ml_dtypes.bfloat16)):
        batch = make_batch(rng, fmt, 2, [5, 1], [140, 3])
        args = list(batch.args())
        bits = msaidx.prefill_scores(*args)
        args[0], args[1] = batch.q.view(dtype), batch.k_cache.view(dtype)
        assert np.array_equal(msaidx.prefill_scores(*args).view(np.uint32), bits.view(np.uint32))
