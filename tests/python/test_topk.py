"""topk_select against a full-sort oracle, on scores full of ties, NaN and infinities."""

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle


def tricky_scores(rng, shape):
    """Few distinct values (many ties), NaN, +-inf and huge values."""
    scores = rng.integers(-3, 4, size=shape).astype(np.float32)
    special = rng.random(shape)
    scores[special < 0.05] = np.nan
    scores[(special >= 0.05) & (special < 0.08)] = -np.inf
    scores[(special >= 0.08) & (special < 0.10)] = np.inf
    scores[(special >= 0.10) & (special < 0.12)] = np.float32(3.4e38)
    return scores


@pytest.mark.parametrize("init_blocks", [0, 1, 2])
@pytest.mark.parametrize("local_blocks", [0, 1, 2])
def test_topk16_matches_full_sort(rng, init_blocks, local_blocks):
    num_tokens, num_heads, pitch = 40, int(rng.choice([1, 2, 4])), int(rng.integers(17, 120))
    scores = tricky_scores(rng, (num_tokens, num_heads, pitch))
    nvp = rng.integers(-2, pitch + 1, size=num_tokens).astype(np.int32)
    nvp[:4] = [0, 16, 17, pitch]  # the edges: padding, exactly topk, one over, full row
    print(num_heads, pitch, init_blocks, local_blocks)
    got = msaidx.topk_select(scores, nvp, 16, init_blocks, local_blocks)
    assert got.dtype == np.int32 and got.shape == (num_tokens, num_heads, 16)
    assert np.array_equal(got, oracle.topk(scores, nvp, 16, init_blocks, local_blocks))


@pytest.mark.parametrize("topk", [1, 5, 64])
def test_other_topk(rng, topk):
    init_blocks = int(rng.integers(0, min(2, topk) + 1)) if topk > 1 else 0
    local_blocks = min(1, topk - init_blocks)
    scores = tricky_scores(rng, (25, 2, 150))
    nvp = rng.integers(0, 151, size=25).astype(np.int32)
    print(topk, init_blocks, local_blocks)
    got = msaidx.topk_select(scores, nvp, topk=topk, init_blocks=init_blocks,
                             local_blocks=local_blocks)
    assert np.array_equal(got, oracle.topk(scores, nvp, topk, init_blocks, local_blocks))


def test_short_rows_and_padding():
    scores = np.zeros((4, 1, 20), dtype=np.float32)
    nvp = np.array([0, -3, 5, 16], dtype=np.int32)
    got = msaidx.topk_select(scores, nvp)
    assert np.all(got[0] == -1) and np.all(got[1] == -1)
    assert np.array_equal(got[2, 0], list(range(5)) + [-1] * 11)
    assert np.array_equal(got[3, 0], np.arange(16))


def test_all_ties_take_the_lowest_pages():
    scores = np.ones((1, 1, 100), dtype=np.float32)
    got = msaidx.topk_select(scores, np.array([100], np.int32), 16, 2, 2)
    assert np.array_equal(got[0, 0], list(range(14)) + [98, 99])
    scores[0, 0, 50] = np.nan  # NaN ranks below everything, but ties still go low
    scores[0, 0, 60] = 2.0
    got = msaidx.topk_select(scores, np.array([100], np.int32), 16, 0, 1)
    assert np.array_equal(got[0, 0], list(range(14)) + [60, 99])


def test_out_is_overwritten(rng):
    scores = tricky_scores(rng, (10, 4, 64))
    nvp = rng.integers(0, 65, size=10).astype(np.int32)
    out = np.full((10, 4, 16), 12345, dtype=np.int32)
    assert msaidx.topk_select(scores, nvp, out=out) is out
    assert np.array_equal(out, oracle.topk(scores, nvp, 16, 0, 1))


def test_scores_view_of_a_wider_array(rng):
    # prefill_scores writes into [:, :, :pitch] views; the selection reads them in place. The
    # columns past the view hold scores that would win if they were read.
    num_tokens, num_heads, pitch, wide = 12, int(rng.choice([1, 2, 4])), 40, 64
    wider = np.full((num_tokens, num_heads, wide), np.float32(1e30))
    scores = wider[:, :, :pitch]
    scores[...] = tricky_scores(rng, scores.shape)
    nvp = rng.integers(0, pitch + 1, size=num_tokens).astype(np.int32)
    nvp[0] = pitch
    got = msaidx.topk_select(scores, nvp)
    assert np.array_equal(got, oracle.topk(np.ascontiguousarray(scores), nvp, 16, 0, 1))
    nvp[1] = pitch + 1  # past the view, within the wider row: refused, not read
    with pytest.raises(msaidx.Error, match="nvp"):
        msaidx.topk_select(scores, nvp)
    with pytest.raises(msaidx.Error, match="scores: the last dimension must have unit stride"):
        msaidx.topk_select(wider[:, :, ::2], nvp)
    with pytest.raises(msaidx.Error, match="scores: rows must lie"):
        msaidx.topk_select(np.zeros((3, 4, 64), np.float32).transpose(1, 0, 2), nvp[:4])
