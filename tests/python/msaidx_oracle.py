"""An independent numpy model of SPEC.md, for the tests: never calls the library.

E4M3 is decoded from its bit fields and encoded by nearest-value search over the decoded code
table; scores are FP64 on the exact decoded values; top-k is a full sort.
"""

import numpy as np

E4M3_NAN = 0x7F
E4M3_MAX_CODE = 0x7E  # 448


def e4m3_decode(codes):
    """uint8 codes -> float64, from sign / 4-bit exponent (bias 7) / 3-bit mantissa."""
    c = np.asarray(codes).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    magnitude = np.where(exponent == 0, mantissa * 2.0**-9,
                         (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    magnitude = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, magnitude)
    return sign * magnitude


# Non-negative values of codes 0x00..0x7E, plus 480 as the would-be code 0x7F so that the tie
# at 464 resolves to the even code 0x7E like any other tie.
_E4M3_LADDER = np.append(e4m3_decode(np.arange(0x7F)), 480.0)


def e4m3_encode(x):
    """float32 values -> uint8 codes: nearest value, ties to the even code, saturating."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    a = np.abs(x)
    finite = np.where(np.isnan(a), 0.0, np.minimum(a, 1e30))
    upper = np.clip(np.searchsorted(_E4M3_LADDER, finite), 0, 0x7F)
    lower = np.clip(upper - 1, 0, 0x7F)
    below = finite - _E4M3_LADDER[lower]
    above = _E4M3_LADDER[upper] - finite
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = np.where(take_upper, upper, lower)
    code = np.where(a >= 464.0, E4M3_MAX_CODE, code)  # includes +-inf
    code = code | np.where(np.signbit(x), 0x80, 0)
    code = np.where(np.isnan(x), E4M3_NAN, code)
    return code.astype(np.uint8)


def bf16_decode(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_encode(x):
    """float32 -> BF16 bits: the nearer of the two truncations, ties to the even code."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    down = (u >> 16).astype(np.int64)
    up = down + 1

    def value(code):
        sign = np.where(code & 0x8000, -1.0, 1.0)
        magnitude_code = code & 0x7FFF
        # past the largest finite value the next step is 2^128, which float64 holds
        v = np.abs(bf16_decode(np.minimum(magnitude_code, 0x7F7F)))
        v = np.where(magnitude_code >= 0x7F80, 2.0**128, v)
        return sign * v

    xf = x.astype(np.float64)
    take_up = (np.abs(value(up) - xf) < np.abs(xf - value(down))) | (
        (np.abs(value(up) - xf) == np.abs(xf - value(down))) & (up % 2 == 0))
    code = np.where(take_up, up, down)
    code = np.where(np.isinf(x), down, code)  # infinities keep their pattern
    code = np.where(np.isnan(x), down | 0x40, code)
    return code.astype(np.uint16)


def decode(codes, fmt):
    return e4m3_decode(codes) if fmt == "e4m3" else bf16_decode(codes)


def encode(values, fmt):
    return e4m3_encode(values) if fmt == "e4m3" else bf16_encode(values)


def visible_pages(cu_seqlens_q, seq_lens, page, num_tokens):
    nvp = np.zeros(num_tokens, dtype=np.int64)
    for b in range(len(seq_lens)):
        first, last = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        q_len = last - first
        pos = int(seq_lens[b]) - q_len + np.arange(q_len)
        nvp[first:last] = pos // page + 1
    return nvp


def scores(q, k_cache, block_table, cu_seqlens_q, seq_lens, fmt, pitch, absolute=False):
    """FP64 scores [T, H, pitch]; NaN marks cells that must not be written (p >= nvp).

    absolute=True: per cell the largest sum_d |q_d * k_d| over the page's visible keys instead,
    the scale of the FP8-accumulation error bound (131 * 2**-13 times it per dot)."""
    qf = decode(q, fmt)
    if absolute:
        qf = np.abs(qf)
    num_tokens, num_heads, dim = qf.shape
    page = k_cache.shape[1]
    out = np.full((num_tokens, num_heads, pitch), np.nan)
    for b in range(len(seq_lens)):
        first, last = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        q_len = last - first
        if q_len == 0:
            continue
        pages = -(-int(seq_lens[b]) // page)
        keys = decode(k_cache[block_table[b, :pages]], fmt).reshape(pages * page, dim)
        if absolute:
            keys = np.abs(keys)
        dots = qf[first:last].reshape(q_len * num_heads, dim) @ keys.T
        dots = dots.reshape(q_len, num_heads, pages * page)
        pos = int(seq_lens[b]) - q_len + np.arange(q_len)
        visible = np.arange(pages * page)[None, :] <= pos[:, None]
        dots = np.where(visible[:, None, :], dots, -np.inf)
        per_page = dots.reshape(q_len, num_heads, pages, page).max(axis=3)
        for i in range(q_len):
            n = pos[i] // page + 1
            out[first + i, :, :n] = per_page[i, :, :n]
    return out


def exact_bound(ref, abs_dots):
    """SPEC.md section 3's exact tolerance per cell: 2e-4 * max(1, |ref|) + 2**-16 * A, with A
    = scores(..., absolute=True) (FP32 summation error where large products cancel)."""
    return 2e-4 * np.maximum(1.0, np.abs(ref)) + 2.0**-16 * abs_dots


def topk(score_rows, nvp, k, init_blocks, local_blocks):
    """[T, H, k] int32 by a full sort: forced init/local blocks, best scores first, ties to the
    lower page, NaN as -inf; ascending, -1 padded."""
    num_tokens, num_heads, _ = score_rows.shape
    out = np.full((num_tokens, num_heads, k), -1, dtype=np.int32)
    for t in range(num_tokens):
        n = int(nvp[t])
        if n <= 0:
            continue
        if n <= k:
            out[t, :, :n] = np.arange(n)
            continue
        candidates = np.arange(init_blocks, n - local_blocks)
        for h in range(num_heads):
            s = score_rows[t, h, :n].astype(np.float64)
            s = np.where(np.isnan(s), -np.inf, s)
            order = np.lexsort((candidates, -s[candidates]))
            chosen = candidates[order[:k - init_blocks - local_blocks]]
            picked = np.concatenate([np.arange(init_blocks), chosen, np.arange(n - local_blocks, n)])
            out[t, h] = np.sort(picked)
    return out
