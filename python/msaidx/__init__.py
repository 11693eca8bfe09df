"""msaidx: the MiniMax-M3 sparse-attention lightning indexer (SPEC.md), from Python.

numpy arrays run on the ``cpu`` backend: FP8 tensors are uint8 arrays of E4M3 bits, BF16 tensors
uint16 arrays of BF16 bits, metadata int32. torch CUDA tensors (``torch.float8_e4m3fn`` or uint8
E4M3 bits, ``torch.bfloat16``, int32 metadata) run on the GPU backends on the current stream.

Bounds passed to the library. With numpy the metadata is on the host, so the bounds are exact:
``max_q_len`` and ``max_seq_len`` are the batch's, and ``pitch=None`` is
``ceil(max(seq_lens) / page)``, the largest nvp of the batch whenever every request owns a token.
With torch the metadata stays on the device and is never read on the host (so the calls are
graph-safe): ``pitch=None`` is 8192, ``max_q_len`` defaults to T and ``max_seq_len`` to
``min(pitch, block_table.shape[1]) * page``: a request can see no more pages than its
block-table row holds or the score row has room for. A request beyond that bound is skipped on
the device and reported by ``check=True`` (which synchronises the stream); both bounds may be
tightened with the ``max_q_len`` / ``max_seq_len`` keywords.

``fast_accumulation=True`` (prefill_scores / decode_scores) sets the config's
``fast_accumulation``: the ``persistent`` backend then sums with FP8 tensor cores (about twice as
fast on compute-bound shapes), each dot within ``2**-5 * sum_d |q_d * k_d|`` of the exact value;
every other backend, the numpy (``cpu``) path included, ignores it and stays exact.

Every bad argument raises :class:`Error` (a ``ValueError``) whose message names the argument.
"""

import ctypes

import numpy as np

from . import _capi
from ._capi import DEVICE_HOST, Error
from ._prepare import index_prepare
from ._tensors import (
    INT32_MAX,
    FORMAT_BYTES,
    as_int,
    check_dim,
    describe,
    require_contiguous,
    require_format,
    require_metadata,
    require_ndim,
    require_output,
    require_same_place,
    torch_module,
)

__version__ = "0.1.0"

__all__ = [
    "Error",
    "__version__",
    "backends",
    "bf16_from_float",
    "bf16_to_float",
    "decode_scores",
    "e4m3_from_float",
    "e4m3_to_float",
    "library_path",
    "num_valid_pages",
    "prefill_scores",
    "topk_select",
]

TORCH_DEFAULT_PITCH = 8192

library_path = _capi.library_path


# ---------------------------------------------------------------------------- conversions

def _host_array(name, value, dtype, kinds, low, high):
    """`value` as a C-contiguous numpy array of `dtype`, accepting integer/float array-likes."""
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as error:
            raise Error(f"{name}: not convertible to an array ({error})") from None
    if value.dtype.kind not in kinds:
        raise Error(f"{name}: dtype {value.dtype} cannot be read as {np.dtype(dtype)}")
    if value.dtype != dtype:
        if low is not None and value.size and (value.min() < low or value.max() > high):
            raise Error(f"{name}: values outside [{low}, {high}] cannot be {np.dtype(dtype)}")
        value = value.astype(dtype)
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def _convert(function, src, out_dtype):
    out = np.empty(src.shape, dtype=out_dtype)
    function(src.ctypes.data, out.ctypes.data, src.size)
    return out


def e4m3_from_float(x):
    """float32 array -> uint8 E4M3 bits: round-to-nearest-even, saturating to +-448, NaN -> 0x7F.

    Other float inputs are first cast to float32 (so a float64 value is rounded twice)."""
    src = _host_array("x", x, np.float32, "fiub", None, None)
    return _convert(_capi.lib().msaidx_e4m3_from_float, src, np.uint8)


def e4m3_to_float(b):
    """uint8 E4M3 bits (or integers in [0, 255]) -> float32, exact (0x7F/0xFF -> NaN)."""
    src = _host_array("b", b, np.uint8, "iub", 0, 255)
    return _convert(_capi.lib().msaidx_e4m3_to_float, src, np.float32)


def bf16_from_float(x):
    """float32 array -> uint16 BF16 bits, round-to-nearest-even, NaN kept (quiet)."""
    src = _host_array("x", x, np.float32, "fiub", None, None)
    return _convert(_capi.lib().msaidx_bf16_from_float, src, np.uint16)


def bf16_to_float(b):
    """uint16 BF16 bits (or integers in [0, 65535]) -> float32, exact."""
    src = _host_array("b", b, np.uint16, "iub", 0, 65535)
    return _convert(_capi.lib().msaidx_bf16_to_float, src, np.float32)


# ---------------------------------------------------------------------------- backends

def backends(device=0, dtype="e4m3", num_heads=4, head_dim=128, page_size=128, reasons=False):
    """Backends this build and machine admit for the given indexer shape.

    ``cpu`` is checked on host memory, ``dense``/``split``/``persistent`` on CUDA ``device``.
    Returns the admitted names; with ``reasons=True`` a dict name -> None (admitted) or the
    library's reason for refusing it."""
    if dtype not in _capi.DTYPES:
        raise Error(f"dtype = {dtype!r}: must be one of {sorted(_capi.DTYPES)}")
    device = as_int("device", device, low=0)
    verdicts = {}
    for name in ("cpu",) + _capi.DEVICE_BACKENDS:
        config = _capi.make_config(
            name, num_heads=as_int("num_heads", num_heads), dtype=_capi.DTYPES[dtype],
            head_dim=as_int("head_dim", head_dim), page_size=as_int("page_size", page_size),
            device=DEVICE_HOST if name == "cpu" else device)
        verdicts[name] = _capi.backend_supported(name, config)
    if reasons:
        return verdicts
    return [name for name, reason in verdicts.items() if reason is None]


def _backend_for(backend, on_torch):
    if not isinstance(backend, str) or backend not in _capi.BACKENDS:
        raise Error(f"backend = {backend!r}: must be one of {list(_capi.BACKENDS)}")
    if on_torch and backend == "cpu":
        raise Error("backend = 'cpu': runs numpy arrays; torch CUDA tensors take 'auto', "
                    "'dense', 'split' or 'persistent'")
    if not on_torch and backend in _capi.DEVICE_BACKENDS:
        raise Error(f"backend = {backend!r}: needs torch CUDA tensors; numpy arrays run on "
                    "'cpu' (or 'auto')")
    return backend


# ---------------------------------------------------------------------------- run helpers

class _Runner:
    """Memory space specifics of one call: allocation, stream, synchronisation policy."""

    def __init__(self, first):
        self.on_torch = first.is_torch
        self.device = first.device
        if self.on_torch:
            torch = torch_module()
            self.torch = torch
            self.torch_device = first.value.device
            self.stream = torch.cuda.current_stream(self.torch_device).cuda_stream
        else:
            self.stream = None

    def device_guard(self):
        if self.on_torch:
            return self.torch.cuda.device(self.torch_device)
        return _NoGuard()

    def full(self, shape, fill, fmt):
        if self.on_torch:
            dtype = self.torch.float32 if fmt == "float32" else self.torch.int32
            return self.torch.full(shape, fill, dtype=dtype, device=self.torch_device)
        return np.full(shape, fill, dtype=np.float32 if fmt == "float32" else np.int32)

    def empty(self, shape, fmt):
        if self.on_torch:
            dtype = self.torch.float32 if fmt == "float32" else self.torch.int32
            return self.torch.empty(shape, dtype=dtype, device=self.torch_device)
        return np.empty(shape, dtype=np.float32 if fmt == "float32" else np.int32)

    def workspace(self, size):
        """(keep-alive object, 16-byte aligned address)."""
        if self.on_torch:
            buffer = self.torch.empty(size + 16, dtype=self.torch.uint8, device=self.torch_device)
            address = buffer.data_ptr()
        else:
            buffer = np.empty(size + 16, dtype=np.uint8)
            address = buffer.ctypes.data
        return buffer, address + (-address) % 16


class _NoGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------- scores

def _validate_cache(q, k_cache):
    require_ndim(q, 3, "[T, H, D]")
    require_format(q, ("e4m3", "bf16"),
                   "an E4M3 (uint8 / float8_e4m3fn) or BF16 (uint16 / bfloat16) type")
    require_contiguous(q)
    num_tokens, num_heads, head_dim = q.shape
    as_int("q: T = q.shape[0]", num_tokens)
    if not 1 <= num_heads <= 16:
        raise Error(f"q: H = q.shape[1] = {num_heads}, must be in [1, 16]")
    check_dim("q", head_dim, "D = q.shape[2]", 16, 256, 16)

    require_ndim(k_cache, 3, "[num_pages, page, D]")
    if k_cache.format != q.format:
        raise Error(f"k_cache: dtype {k_cache.dtype_name} does not match q's dtype "
                    f"{q.dtype_name} (both E4M3 or both BF16)")
    num_pages, page_size, k_dim = k_cache.shape
    if k_dim != head_dim:
        raise Error(f"k_cache: last dimension {k_dim} differs from q's head dim D = {head_dim}")
    check_dim("k_cache", page_size, "page = k_cache.shape[1]", 16, 512, 16)
    if num_pages < 1:
        raise Error("k_cache: has no pages (k_cache.shape[0] = 0)")
    as_int("k_cache: num_pages = k_cache.shape[0]", num_pages)
    elem = FORMAT_BYTES[q.format]
    if k_cache.strides[2] != elem or k_cache.strides[1] != head_dim * elem:
        raise Error(f"k_cache: each page must be a contiguous [page, D] block (strides "
                    f"{k_cache.strides} bytes; only the page stride may be padded)")
    min_stride = page_size * head_dim * elem
    page_stride = k_cache.strides[0] if num_pages > 1 else min_stride
    if page_stride < min_stride or page_stride % 16:
        raise Error(f"k_cache: page stride {page_stride} bytes must be a multiple of 16 and "
                    f">= page * D * element size = {min_stride}")
    return num_tokens, num_heads, head_dim, num_pages, page_size, page_stride


def _validate_block_table(block_table, batch_size):
    require_format(block_table, ("int32",), "int32")
    require_ndim(block_table, 2, "[B, max pages]")
    rows, cols = block_table.shape
    if rows < batch_size:
        raise Error(f"block_table: has {rows} rows, fewer than the batch's B = {batch_size} "
                    "requests")
    if cols > 1 and block_table.strides[1] != 4:
        raise Error(f"block_table: entries of a row must be contiguous (strides "
                    f"{block_table.strides} bytes)")
    row_stride = block_table.strides[0] if rows > 1 else 4 * cols
    if row_stride % 4 or row_stride < 4 * cols:
        raise Error(f"block_table: row stride {row_stride} bytes must be a multiple of 4 and "
                    f"cover the {cols} entries of a row")
    bt_stride = as_int("block_table: row stride in entries", max(row_stride // 4, 1))
    return cols, bt_stride


def _host_bounds(cu_seqlens_q, seq_lens, num_tokens, page_size):
    """Exact bounds from host metadata; bad values are clamped here and reported by the C plan
    (whose messages name the bad entry)."""
    cu = cu_seqlens_q.value.astype(np.int64)
    lens = seq_lens.value.astype(np.int64)
    max_q_len = int(np.clip(np.diff(cu).max(), 0, num_tokens)) if lens.size else 0
    max_seq_len = max(0, int(lens.max())) if lens.size else 0
    return max_q_len, max_seq_len, -(-max_seq_len // page_size)


def _flag(name, value):
    """A bool argument as 0 / 1 (numpy bools and the integers 0 and 1 pass too)."""
    if not isinstance(value, (bool, int, np.bool_, np.integer)) or value not in (0, 1):
        raise Error(f"{name} = {value!r}: must be True or False")
    return int(value)


def _scores(entry, q, k_cache, block_table, cu_seqlens_q, seq_lens, backend, pitch, out, check,
            max_q_len, max_seq_len, fast_accumulation):
    ops = [describe("q", q), describe("k_cache", k_cache), describe("block_table", block_table),
           describe("cu_seqlens_q", cu_seqlens_q), describe("seq_lens", seq_lens)]
    out_op = describe("out", out) if out is not None else None
    require_same_place(ops[0], ops[1:] + ([out_op] if out_op else []))
    q_op, k_op, bt_op, cu_op, lens_op = ops
    on_torch = q_op.is_torch
    backend = _backend_for(backend, on_torch)
    fast_accumulation = _flag("fast_accumulation", fast_accumulation)

    num_tokens, num_heads, head_dim, num_pages, page_size, page_stride = _validate_cache(q_op, k_op)
    require_metadata(cu_op, what="[B + 1]")
    if cu_op.shape[0] < 1:
        raise Error("cu_seqlens_q: must have B + 1 >= 1 entries")
    batch_size = as_int("cu_seqlens_q: B = len(cu_seqlens_q) - 1", cu_op.shape[0] - 1)
    require_metadata(lens_op, batch_size, f"(B = {batch_size}, from cu_seqlens_q)")
    bt_cols, bt_stride = _validate_block_table(bt_op, batch_size)

    if on_torch:
        if pitch is None:
            pitch = out_op.shape[2] if out_op is not None and out_op.ndim == 3 else TORCH_DEFAULT_PITCH
        pitch = as_int("pitch", pitch, low=1)
        if max_q_len is None:
            max_q_len = num_tokens
        max_q_len = as_int("max_q_len", max_q_len, low=0, high=num_tokens)
        if max_seq_len is None:
            max_seq_len = min(min(pitch, bt_cols) * page_size, INT32_MAX)
        max_seq_len = as_int("max_seq_len", max_seq_len, low=0)
        pages = -(-max_seq_len // page_size)
        if pages > bt_cols:
            raise Error(f"block_table: {bt_cols} entries per row cannot hold the {pages} pages "
                        f"of max_seq_len = {max_seq_len}")
        if pages > pitch:
            raise Error(f"pitch = {pitch}: below the {pages} pages of max_seq_len = "
                        f"{max_seq_len}")
    else:
        exact_q, exact_seq, pages = _host_bounds(cu_op, lens_op, num_tokens, page_size)
        max_q_len = exact_q if max_q_len is None else as_int("max_q_len", max_q_len,
                                                             low=exact_q, high=num_tokens)
        max_seq_len = exact_seq if max_seq_len is None else as_int("max_seq_len", max_seq_len,
                                                                   low=exact_seq)
        pages = max(pages, -(-max_seq_len // page_size))
        if pitch is None:
            pitch = out_op.shape[2] if out_op is not None and out_op.ndim == 3 else max(1, pages)
        pitch = as_int("pitch", pitch, low=1)
        if pages > pitch:
            raise Error(f"pitch = {pitch}: below the batch's largest number of visible pages "
                        f"{pages} (max(seq_lens) = {exact_seq}, page = {page_size})")
        if pages > bt_cols:
            raise Error(f"block_table: {bt_cols} entries per row cannot hold the {pages} pages "
                        f"of the longest request (max(seq_lens) = {exact_seq})")
        check = True  # host planning is synchronous: the check is free

    shape = (num_tokens, num_heads, pitch)
    runner = _Runner(q_op)
    if out_op is not None:
        require_output(out_op, shape, "float32")
    else:
        out = runner.full(shape, float("-inf"), "float32")
        out_op = describe("out", out)

    held = _capi.context(backend, num_heads=num_heads, dtype=_capi.DTYPES[q_op.format],
                         head_dim=head_dim, page_size=page_size, device=runner.device,
                         fast_accumulation=fast_accumulation)
    desc = _capi.BatchDesc()
    lib = _capi.lib()
    lib.msaidx_batch_desc_init(ctypes.byref(desc))
    desc.batch_size = batch_size
    desc.num_tokens = num_tokens
    desc.max_q_len = max_q_len
    desc.max_seq_len = max_seq_len
    desc.num_pages = num_pages
    desc.bt_stride = bt_stride
    desc.page_stride = page_stride
    desc.pitch = pitch
    with runner.device_guard(), _capi.Plan(held, desc) as plan:
        size = plan.workspace_size()
        workspace, address = runner.workspace(size)
        _capi.check(lib.msaidx_plan_batch(plan.handle, cu_op.pointer, lens_op.pointer,
                                          bt_op.pointer, address, size, runner.stream),
                    "msaidx_plan_batch")
        run = lib.msaidx_decode_scores if entry == "decode" else lib.msaidx_prefill_scores
        _capi.check(run(plan.handle, q_op.pointer, k_op.pointer, out_op.pointer, runner.stream),
                    f"msaidx_{entry}_scores")
        if check:
            _capi.check(lib.msaidx_plan_check(plan.handle, runner.stream), "msaidx_plan_check")
        del workspace  # stream-ordered: torch's allocator reuses it only after the kernels
    return out


def prefill_scores(q, k_cache, block_table, cu_seqlens_q, seq_lens, backend="auto", pitch=None,
                   out=None, *, check=False, max_q_len=None, max_seq_len=None,
                   fast_accumulation=False):
    """Scores [T, H, pitch] float32: S[t, h, p] = max over visible keys j of page p of
    dot(q[t, h], k[j]) for p < nvp[t]; cells p >= nvp are never written (a fresh ``out`` is
    filled with -inf first).

    q [T, H, D]; k_cache [num_pages, page, D] (the page stride may be padded); block_table int32
    [>= B, max pages] (rows may be strided); cu_seqlens_q int32 [B + 1]; seq_lens int32 [B].
    ``check=True`` (torch only: numpy metadata is always checked) synchronises the stream and
    raises on device-side metadata errors. See the module docstring for the bounds rule.
    ``fast_accumulation=True`` lets ``persistent`` sum with FP8 tensor cores (each dot within
    ``2**-5 * sum_d |q_d * k_d|``); the other backends ignore it and stay exact."""
    return _scores("prefill", q, k_cache, block_table, cu_seqlens_q, seq_lens, backend, pitch,
                   out, check, max_q_len, max_seq_len, fast_accumulation)


def decode_scores(q, k_cache, block_table, cu_seqlens_q, seq_lens, backend="auto", pitch=None,
                  out=None, *, check=False, max_q_len=None, max_seq_len=None,
                  fast_accumulation=False):
    """Same contract as :func:`prefill_scores`, on the decode path (graph-safe launch shape)."""
    return _scores("decode", q, k_cache, block_table, cu_seqlens_q, seq_lens, backend, pitch,
                   out, check, max_q_len, max_seq_len, fast_accumulation)


# ---------------------------------------------------------------------------- nvp and top-k

def num_valid_pages(cu_seqlens_q, seq_lens, page_size=128, num_tokens=None, out=None):
    """nvp int32 [num_tokens]: pages visible to each token, 0 for padding tokens.

    ``num_tokens`` defaults to cu_seqlens_q[-1] (read on the host: with torch tensors that
    synchronises, so pass it, e.g. q.shape[0], inside graph capture)."""
    cu_op, lens_op = describe("cu_seqlens_q", cu_seqlens_q), describe("seq_lens", seq_lens)
    out_op = describe("out", out) if out is not None else None
    require_same_place(cu_op, [lens_op] + ([out_op] if out_op else []))
    require_metadata(cu_op, what="[B + 1]")
    if cu_op.shape[0] < 1:
        raise Error("cu_seqlens_q: must have B + 1 >= 1 entries")
    batch_size = as_int("cu_seqlens_q: B = len(cu_seqlens_q) - 1", cu_op.shape[0] - 1)
    require_metadata(lens_op, batch_size, f"(B = {batch_size}, from cu_seqlens_q)")
    page_size = as_int("page_size", page_size)
    check_dim("page_size", page_size, "page_size", 16, 512, 16)
    if num_tokens is None:
        num_tokens = max(0, int(cu_op.value[-1]))
    num_tokens = as_int("num_tokens", num_tokens, low=0)
    runner = _Runner(cu_op)
    if out_op is not None:
        require_output(out_op, (num_tokens,), "int32")
    else:
        out = runner.empty((num_tokens,), "int32")
        out_op = describe("out", out)
    held = _capi.context("auto", page_size=page_size, device=runner.device)
    with runner.device_guard():
        _capi.check(_capi.lib().msaidx_num_valid_pages(
            held.handle, cu_op.pointer, lens_op.pointer, batch_size, num_tokens, out_op.pointer,
            runner.stream), "msaidx_num_valid_pages")
    return out


def topk_select(scores, nvp, topk=16, init_blocks=0, local_blocks=1, out=None):
    """int32 [T, H, topk]: per row the ascending logical page ids of the chosen blocks, -1 tail
    padding. Blocks [0, init_blocks) and [nvp - local_blocks, nvp) are forced; the rest take the
    highest scores (ties to the lower page, NaN as -inf). nvp <= 0 rows are all -1."""
    scores_op, nvp_op = describe("scores", scores), describe("nvp", nvp)
    out_op = describe("out", out) if out is not None else None
    require_same_place(scores_op, [nvp_op] + ([out_op] if out_op else []))
    require_format(scores_op, ("float32",), "float32")
    require_ndim(scores_op, 3, "[T, H, pitch]")
    require_contiguous(scores_op)
    num_tokens, num_heads, pitch = scores_op.shape
    as_int("scores: T = scores.shape[0]", num_tokens)
    if not 1 <= num_heads <= 16:
        raise Error(f"scores: H = scores.shape[1] = {num_heads}, must be in [1, 16]")
    pitch = as_int("scores: pitch = scores.shape[2]", pitch, low=1)
    require_metadata(nvp_op, num_tokens, f"(T = {num_tokens}, from scores)")
    topk = as_int("topk", topk, low=1, high=64)
    init_blocks = as_int("init_blocks", init_blocks, low=0)
    local_blocks = as_int("local_blocks", local_blocks, low=0)
    if init_blocks + local_blocks > topk:
        raise Error(f"init_blocks + local_blocks = {init_blocks + local_blocks}: exceeds "
                    f"topk = {topk}")
    runner = _Runner(scores_op)
    shape = (num_tokens, num_heads, topk)
    if out_op is not None:
        require_output(out_op, shape, "int32")
    else:
        out = runner.empty(shape, "int32")
        out_op = describe("out", out)
    held = _capi.context("auto", num_heads=num_heads, topk=topk, init_blocks=init_blocks,
                         local_blocks=local_blocks, device=runner.device)
    with runner.device_guard():
        _capi.check(_capi.lib().msaidx_topk_select(
            held.handle, scores_op.pointer, pitch, nvp_op.pointer, num_tokens, out_op.pointer,
            runner.stream), "msaidx_topk_select")
    return out
