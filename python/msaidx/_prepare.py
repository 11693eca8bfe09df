"""msaidx.index_prepare: index Q/K preparation (SPEC.md section 11) through msaidx_index_prepare.

numpy arrays and torch CPU tensors run on the cpu backend (BF16 inputs as uint16 arrays, an E4M3
cache as uint8 codes, a BF16 cache as uint16), torch CUDA tensors on the GPU on the current stream.
"""

import ctypes
import math

import numpy as np

from . import _capi, _torch_ops
from ._capi import DEVICE_HOST, Error
from ._tensors import (
    as_int,
    cache_page_stride,
    describe,
    require_contiguous,
    require_disjoint,
    require_format,
    require_ndim,
    require_output,
    require_same_place,
    torch_module,
)

HEAD_DIM = 128
COS_SIN_FORMATS = {"float32": 0, "bf16": 1}  # msaidx_cos_sin_format
COS_SIN_THETA = 2  # MSAIDX_COS_SIN_THETA
ROPE_THETA_MAX_POSITION = 1 << 24  # MSAIDX_ROPE_THETA_MAX_POSITION
BAD_POSITION = 1 << 8  # MSAIDX_BAD_PREPARE_POSITION
BAD_SLOT = 1 << 9  # MSAIDX_BAD_PREPARE_SLOT


class PrepareArgs(ctypes.Structure):
    """msaidx_index_prepare_args."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_tokens", ctypes.c_int32),
        ("q_in", ctypes.c_void_p),
        ("q_in_token_stride", ctypes.c_int64),
        ("k_in", ctypes.c_void_p),
        ("k_in_token_stride", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("cos_sin_cache", ctypes.c_void_p),
        ("cos_sin_format", ctypes.c_int),
        ("max_position", ctypes.c_int64),
        ("slot_mapping", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("page_stride", ctypes.c_int64),
        ("num_pages", ctypes.c_int32),
        ("q_out", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("error_word", ctypes.c_void_p),
        ("rope_theta", ctypes.c_double),
    ]


_entry_points = None


def _library():
    """(msaidx_index_prepare_args_init, msaidx_index_prepare) with their prototypes set."""
    global _entry_points
    if _entry_points is None:
        lib = _capi.lib()
        init, run = lib.msaidx_index_prepare_args_init, lib.msaidx_index_prepare
        init.restype, init.argtypes = None, [ctypes.POINTER(PrepareArgs)]
        run.restype = ctypes.c_int
        run.argtypes = [ctypes.c_void_p, ctypes.POINTER(PrepareArgs), ctypes.c_void_p]
        _entry_points = (init, run)
    return _entry_points


def _is_int64(op):
    if op.is_torch:
        return op.dtype == torch_module().int64
    return op.dtype == np.dtype(np.int64)


def _require_token_vector(op, num_tokens):
    """A contiguous int64 [T] array."""
    if not _is_int64(op):
        raise Error(f"{op.name}: dtype {op.dtype_name} is not int64")
    require_ndim(op, 1, "[T]")
    if op.shape[0] != num_tokens:
        raise Error(f"{op.name}: has {op.shape[0]} entries, expected T = {num_tokens} (from q_in)")
    if num_tokens > 1 and op.strides[0] != 8:
        raise Error(f"{op.name}: must be contiguous (strides {op.strides} bytes)")


def _token_stride(op, row_bytes):
    """Elements between tokens of a BF16 input whose rows of `row_bytes` are contiguous."""
    stride = op.strides[0] if op.shape[0] > 1 else row_bytes
    if stride % 16 or stride < row_bytes:
        raise Error(f"{op.name}: token stride {stride} bytes must be a multiple of 16 and >= "
                    f"{row_bytes} (strides {op.strides} bytes)")
    return stride // 2


def _validate_inputs(q_op, k_op):
    require_format(q_op, ("bf16",), "BF16 (uint16 bits / torch.bfloat16)")
    require_ndim(q_op, 3, "[T, H, 128]")
    num_tokens, num_heads, head_dim = q_op.shape
    as_int("q_in: T = q_in.shape[0]", num_tokens)
    if not 1 <= num_heads <= 16:
        raise Error(f"q_in: H = q_in.shape[1] = {num_heads}, must be in [1, 16]")
    if head_dim != HEAD_DIM:
        raise Error(f"q_in: head dim q_in.shape[2] = {head_dim}, index preparation needs 128")
    if q_op.strides[2] != 2 or (num_heads > 1 and q_op.strides[1] != 2 * HEAD_DIM):
        raise Error(f"q_in: the heads of a token must be contiguous (strides {q_op.strides} "
                    "bytes; only the token stride may be larger)")
    require_format(k_op, ("bf16",), "BF16 (uint16 bits / torch.bfloat16)")
    require_ndim(k_op, 2, "[T, 128]")
    if k_op.shape != (num_tokens, HEAD_DIM):
        raise Error(f"k_in: shape {k_op.shape}, expected ({num_tokens}, 128)")
    if k_op.strides[1] != 2:
        raise Error(f"k_in: each key must be contiguous (strides {k_op.strides} bytes)")
    return (num_tokens, num_heads, _token_stride(q_op, num_heads * HEAD_DIM * 2),
            _token_stride(k_op, HEAD_DIM * 2))


def _validate_cache(k_op):
    require_ndim(k_op, 3, "[num_pages, page, 128]")
    require_format(k_op, ("e4m3", "bf16"),
                   "an E4M3 (uint8 / float8_e4m3fn) or BF16 (uint16 / bfloat16) type")
    num_pages, page_size, dim = k_op.shape
    if dim != HEAD_DIM or page_size != 128:
        raise Error(f"k_cache: shape {k_op.shape}, expected [num_pages, 128, 128]")
    page_stride = cache_page_stride(k_op, HEAD_DIM)
    if not k_op.writeable:
        raise Error("k_cache: is read-only")
    return num_pages, page_stride


def _new_q_out(k_cache, on_torch, shape):
    if on_torch:
        return torch_module().empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    return np.empty(shape, dtype=k_cache.dtype)


def index_prepare(q_in, k_in, positions, q_norm_weight, k_norm_weight, cos_sin_cache,
                  slot_mapping, k_cache, q_out=None, eps=1e-6, *, error_word=None, check=False,
                  rope_theta=None, max_position=None):
    """SPEC.md section 11: per token, each query head of q_in and the key k_in (BF16, 128 wide)
    go through Gemma RMSNorm (x * rsqrt(mean(x^2) + eps) * (1 + w)), partial NeoX RoPE on dims
    [0, 64) with cos_sin_cache[positions[t]] ([cos(32) | sin(32)], float32 or BF16) and a cast to
    the cache dtype straight from FP32. Each output is the FP64 value's rounding or one step from
    it, except where RoPE cancels far below its terms and for vectors whose RMS is above about
    1.6e18 (they come out 0) or whose squares underflow FP32 with eps < 2^-100
    (docs/index_prepare.md).

    Without a table (cos_sin_cache=None, rope_theta given, MiniMax-M3: 5e6), the call computes
    the cos and sin of positions[t] * rope_theta^(-2i/64) itself (within 1.5 FP32 ulps; it reads
    256 bytes a token less than a float32 table); positions must then lie in [0, max_position),
    max_position at most 2^24 (the default). The key is written into k_cache at slot_mapping[t]
    (page * 128 + offset; -1 skips it); the queries into q_out [T, H, 128] (returned; allocated
    in the cache dtype when None).

    q_in [T, H, 128] and k_in [T, 128] may be strided slices of one fused projection (token stride
    a multiple of 16 bytes); positions and slot_mapping are int64 [T]; the norm weights BF16 [128].
    A token whose position is outside the table is skipped whole, a slot outside the cache (not
    -1) is not written. numpy and torch CPU: every good token is written, then Error names the
    first bad one. torch CUDA: bad tokens are recorded in ``error_word`` (an int32 [1] CUDA tensor
    the caller zeroes) when given; ``check=True`` uses a fresh word, synchronises and raises Error.

    Under torch.compile the call becomes the custom op torch.ops.msaidx.index_prepare (q_out
    allocated here, where the tracer sees it); everywhere else it runs directly."""
    theta, max_position = _rotation(cos_sin_cache, rope_theta, max_position)
    if _torch_ops.tracing(q_in):
        if q_out is None:
            q_out = _new_q_out(k_cache, True, (q_in.shape[0], q_in.shape[1], HEAD_DIM))
        _torch_ops.ops().index_prepare(q_in, k_in, positions, q_norm_weight, k_norm_weight,
                                       cos_sin_cache, slot_mapping, k_cache, q_out, float(eps),
                                       error_word, bool(check), theta, max_position)
        return q_out
    table_op = None if theta else describe("cos_sin_cache", cos_sin_cache)
    ops = [describe("q_in", q_in), describe("k_in", k_in), describe("positions", positions),
           describe("q_norm_weight", q_norm_weight), describe("k_norm_weight", k_norm_weight),
           describe("slot_mapping", slot_mapping), describe("k_cache", k_cache)]
    q_out_op = describe("q_out", q_out) if q_out is not None else None
    word_op = describe("error_word", error_word) if error_word is not None else None
    require_same_place(ops[0], ops[1:] + [op for op in (table_op, q_out_op, word_op)
                                          if op is not None])
    q_op, k_op, positions_op, q_weight_op, k_weight_op, slots_op, cache_op = ops
    on_torch = q_op.is_torch
    on_cuda = q_op.device != DEVICE_HOST

    num_tokens, num_heads, q_stride, k_stride = _validate_inputs(q_op, k_op)
    _require_token_vector(positions_op, num_tokens)
    _require_token_vector(slots_op, num_tokens)
    for weight in (q_weight_op, k_weight_op):
        require_format(weight, ("bf16",), "BF16 (uint16 bits / torch.bfloat16)")
        if weight.shape != (HEAD_DIM,):
            raise Error(f"{weight.name}: shape {weight.shape}, expected (128,)")
        require_contiguous(weight)
    if table_op is not None:
        require_format(table_op, tuple(COS_SIN_FORMATS), "float32 or BF16")
        require_ndim(table_op, 2, "[max_position, 64]")
        max_position, table_width = table_op.shape
        if table_width != 64 or max_position < 1:
            raise Error(f"cos_sin_cache: shape {table_op.shape}, expected [max_position >= 1, 64]")
        require_contiguous(table_op)
    num_pages, page_stride = _validate_cache(cache_op)
    if not isinstance(eps, (int, float, np.floating)) or isinstance(eps, bool):
        raise Error(f"eps = {eps!r}: must be a number")
    # The library takes eps as an FP32 value: refuse what that rounding would change in kind.
    with np.errstate(over="ignore", under="ignore"):
        eps32 = np.float32(eps)
    if not np.isfinite(eps32) or eps32 < 0 or (eps32 == 0) != (eps == 0):
        raise Error(f"eps = {eps!r}: must be >= 0 and, as an FP32 value, finite and zero only "
                    f"when eps is (it would be {float(eps32)!r})")
    if word_op is not None:
        if word_op.format != "int32" and not (not on_torch and word_op.dtype == np.uint32):
            raise Error(f"error_word: dtype {word_op.dtype_name} is not int32")
        if word_op.shape != (1,):
            raise Error(f"error_word: shape {word_op.shape}, expected (1,)")
        if not word_op.writeable:
            raise Error("error_word: is read-only")

    shape = (num_tokens, num_heads, HEAD_DIM)
    # What the call writes shares no memory with what it reads, nor with each other.
    inputs = (q_op, k_op, positions_op, q_weight_op, k_weight_op, table_op, slots_op)
    require_disjoint(cache_op, inputs)
    if word_op is not None:
        require_disjoint(word_op, inputs + (cache_op, q_out_op))
    if q_out_op is not None:
        require_output(q_out_op, shape, cache_op.format)
        require_disjoint(q_out_op, inputs + (cache_op,))
    else:
        q_out = _new_q_out(k_cache, on_torch, shape)
        q_out_op = describe("q_out", q_out)

    torch = torch_module() if on_torch else None
    if on_cuda and check and word_op is None:
        error_word = torch.zeros(1, dtype=torch.int32, device=q_op.value.device)
        word_op = describe("error_word", error_word)

    held = _capi.context("auto", num_heads=num_heads, dtype=_capi.DTYPES[cache_op.format],
                         device=q_op.device)
    init, run = _library()
    args = PrepareArgs()
    init(ctypes.byref(args))
    args.num_tokens = num_tokens
    args.q_in, args.q_in_token_stride = q_op.pointer, q_stride
    args.k_in, args.k_in_token_stride = k_op.pointer, k_stride
    args.positions = positions_op.pointer
    args.q_norm_weight, args.k_norm_weight = q_weight_op.pointer, k_weight_op.pointer
    if table_op is not None:
        args.cos_sin_cache = table_op.pointer
        args.cos_sin_format = COS_SIN_FORMATS[table_op.format]
    else:
        args.cos_sin_format, args.rope_theta = COS_SIN_THETA, theta
    args.max_position = max_position
    args.slot_mapping = slots_op.pointer
    args.k_cache, args.page_stride, args.num_pages = cache_op.pointer, page_stride, num_pages
    args.q_out = q_out_op.pointer
    args.eps = float(eps)
    args.error_word = word_op.pointer if word_op is not None else None
    if on_cuda:
        with torch.cuda.device(q_op.value.device):
            stream = torch.cuda.current_stream(q_op.value.device).cuda_stream
            _capi.check(run(held.handle, ctypes.byref(args), stream), "msaidx_index_prepare")
        if check:
            bits = int(error_word.item())  # synchronises
            if bits:
                raise Error(_describe_bits(bits, theta))
    else:
        _capi.check(run(held.handle, ctypes.byref(args), None), "msaidx_index_prepare")
    return q_out


def _rotation(cos_sin_cache, rope_theta, max_position):
    """(theta, max_position) of a call without a table; (0.0, 0) with one (its rows bound the
    positions)."""
    if rope_theta is None:
        if cos_sin_cache is None:
            raise Error("cos_sin_cache: None needs rope_theta (the RoPE base, MiniMax-M3: 5e6)")
        if max_position is not None:
            raise Error("max_position: only without a table (cos_sin_cache.shape[0] bounds the "
                        "positions)")
        return 0.0, 0
    if cos_sin_cache is not None:
        raise Error("rope_theta: give a cos_sin_cache or rope_theta, not both")
    # math, not numpy: torch.compile traces this with rope_theta a Python constant
    if (not isinstance(rope_theta, (int, float, np.floating)) or isinstance(rope_theta, bool)
            or not math.isfinite(rope_theta) or rope_theta < 1):
        raise Error(f"rope_theta = {rope_theta!r}: must be a finite number >= 1")
    if max_position is None:
        max_position = ROPE_THETA_MAX_POSITION
    max_position = as_int("max_position", max_position, low=1, high=ROPE_THETA_MAX_POSITION)
    return float(rope_theta), max_position


def _describe_bits(bits, theta):
    found = []
    if bits & BAD_POSITION:
        bound = "max_position" if theta else "cos_sin_cache.shape[0]"
        found.append(f"positions outside [0, {bound}) (those tokens were skipped)")
    if bits & BAD_SLOT:
        found.append("slot_mapping entries outside the cache and not -1 (those keys were not "
                     "written)")
    return "msaidx_index_prepare: device check found " + "; ".join(found)
