"""Random ragged batches in the library's layouts, with poison wherever nothing may be read."""

from dataclasses import dataclass

import numpy as np

import msaidx_oracle as oracle

STORAGE = {"e4m3": np.uint8, "bf16": np.uint16}


def poison_codes(rng, fmt, shape):
    """Large finite keys: read by mistake (an unused page, the padding of a page stride, a key
    past the end of a request), they would dominate a page's max."""
    magnitude = rng.uniform(256.0, 448.0, size=shape).astype(np.float32)
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=shape)
    return oracle.encode(magnitude * sign, fmt)


@dataclass
class Batch:
    fmt: str
    q: np.ndarray
    k_cache: np.ndarray
    block_table: np.ndarray
    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray
    page: int
    k_base: np.ndarray  # [num_pages, padded page] storage behind k_cache
    bt_base: np.ndarray  # [rows, padded row] storage behind block_table

    @property
    def num_tokens(self):
        return self.q.shape[0]

    @property
    def num_heads(self):
        return self.q.shape[1]

    def args(self):
        return self.q, self.k_cache, self.block_table, self.cu_seqlens_q, self.seq_lens

    def largest_nvp(self):
        return max(1, int(-(-self.seq_lens.max() // self.page))) if self.seq_lens.size else 1

    def nvp(self):
        return oracle.visible_pages(self.cu_seqlens_q, self.seq_lens, self.page, self.num_tokens)

    def reference(self, pitch):
        return oracle.scores(self.q, self.k_cache, self.block_table, self.cu_seqlens_q,
                             self.seq_lens, self.fmt, pitch)

    def abs_dot_maxima(self, pitch):
        """Per cell the largest sum_d |q_d * k_d| over the page's visible keys (NaN as in
        reference): what the fast-accumulation error bound scales with."""
        return oracle.scores(self.q, self.k_cache, self.block_table, self.cu_seqlens_q,
                             self.seq_lens, self.fmt, pitch, absolute=True)


def make_batch(rng, fmt, num_heads, q_lens, prefixes, page=128, dim=128, pad_tokens=0,
               page_pad_bytes=0, bt_extra_cols=0, bt_row_pad=0, extra_pages=0, extra_rows=0):
    """q_lens/prefixes per request; the page stride is padded by page_pad_bytes (a multiple
    of 16); block-table rows are bt_row_pad entries longer than the view the library gets."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    seq_lens = np.asarray(prefixes, dtype=np.int64) + q_lens
    batch_size = len(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pages = -(-seq_lens // page)
    num_pages = max(1, int(pages.sum()) + extra_pages)
    physical = rng.permutation(num_pages).astype(np.int32)

    cols = max(int(pages.max()) if batch_size else 0, 1) + bt_extra_cols
    bt_base = rng.integers(-10**6, 10**6, size=(batch_size + extra_rows, cols + bt_row_pad),
                           dtype=np.int32)
    used = 0
    for b in range(batch_size):
        bt_base[b, :pages[b]] = physical[used:used + pages[b]]
        used += pages[b]
    block_table = bt_base[:, :cols]

    dtype = STORAGE[fmt]
    elem = np.dtype(dtype).itemsize
    assert page_pad_bytes % 16 == 0
    page_elems = page * dim
    base = poison_codes(rng, fmt, (num_pages, page_elems + page_pad_bytes // elem))
    for b in range(batch_size):
        for p in range(pages[b]):
            keys = min(page, int(seq_lens[b]) - p * page)  # slots past seq_len stay poison
            values = rng.standard_normal((keys, dim)).astype(np.float32)
            base[block_table[b, p], :keys * dim] = oracle.encode(values, fmt).reshape(-1)
    k_cache = base[:, :page_elems].reshape(num_pages, page, dim)
    assert np.shares_memory(k_cache, base)
    assert num_pages == 1 or k_cache.strides[0] == base.strides[0]

    num_tokens = int(cu[-1]) + pad_tokens
    q = oracle.encode(rng.standard_normal((num_tokens, num_heads, dim)).astype(np.float32), fmt)
    assert q.ctypes.data % 16 == 0 and k_cache.ctypes.data % 16 == 0
    return Batch(fmt, q, k_cache, block_table, cu, seq_lens.astype(np.int32), page, base, bt_base)


def random_shape(rng, decode=False, max_prefill=160, max_prefix=500, page=128):
    """Keyword arguments of make_batch: decode requests first, then prefill chunks; prefixes
    often on page boundaries; sometimes a request without tokens, padding tokens, padded
    page strides and block-table rows."""
    batch_size = int(rng.integers(1, 5))
    num_decode = batch_size if decode else int(rng.integers(0, batch_size + 1))
    q_lens = [int(rng.integers(1, 9)) for _ in range(num_decode)]
    q_lens += [int(rng.integers(1, max_prefill + 1)) for _ in range(batch_size - num_decode)]
    q_lens = [0 if rng.random() < 0.1 else n for n in q_lens]
    boundaries = [0, 1, page - 1, page, 2 * page - 1, 2 * page, 3 * page]
    prefixes = [int(rng.choice(boundaries)) if rng.random() < 0.3
                else int(rng.integers(0, max_prefix + 1)) for _ in range(batch_size)]
    return dict(q_lens=q_lens, prefixes=prefixes, page=page,
                pad_tokens=int(rng.integers(0, 4)),
                page_pad_bytes=16 * int(rng.choice([0, 0, 1, 5])),
                bt_extra_cols=int(rng.integers(0, 3)),
                bt_row_pad=int(rng.choice([0, 0, 3])),
                extra_pages=int(rng.integers(0, 4)),
                extra_rows=int(rng.integers(0, 2)))
