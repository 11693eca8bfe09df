"""What msaidx needs to know about an argument array: numpy arrays, torch CPU tensors (host
memory, the cpu backend, as numpy) and torch CUDA tensors.

torch is never imported here: a torch tensor can only be passed once the caller has imported
torch, so it is looked up in sys.modules.
"""

import numbers
import sys
from dataclasses import dataclass

import numpy as np

from ._capi import DEVICE_HOST, Error

INT32_MAX = 2**31 - 1

_NUMPY_FORMATS = {
    np.dtype(np.uint8): "e4m3",
    np.dtype(np.uint16): "bf16",
    np.dtype(np.int32): "int32",
    np.dtype(np.float32): "float32",
}
# ml_dtypes' numpy dtypes, recognised by name so that ml_dtypes stays optional.
_NUMPY_FORMAT_NAMES = {"float8_e4m3fn": "e4m3", "bfloat16": "bf16"}

FORMAT_BYTES = {"e4m3": 1, "bf16": 2, "int32": 4, "float32": 4}


def torch_module():
    return sys.modules.get("torch")


def is_torch_tensor(value):
    torch = torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


_torch_format_table = None


def _torch_formats(torch):
    global _torch_format_table
    if _torch_format_table is None:
        _torch_format_table = {
            torch.float8_e4m3fn: "e4m3",
            torch.uint8: "e4m3",  # E4M3 bits, as some engines store FP8 caches
            torch.bfloat16: "bf16",
            torch.int32: "int32",
            torch.float32: "float32",
        }
    return _torch_format_table


@dataclass
class Operand:
    name: str
    value: object
    is_torch: bool
    shape: tuple
    strides: tuple  # bytes
    format: object  # "e4m3", "bf16", "int32", "float32" or None
    dtype: object  # the numpy or torch dtype, for messages
    pointer: int
    device: int  # CUDA ordinal or DEVICE_HOST
    writeable: bool

    @property
    def dtype_name(self):
        return str(self.dtype)

    @property
    def ndim(self):
        return len(self.shape)

    def is_c_contiguous(self):
        """Row-major dense; strides of size-1 dimensions (and of empty arrays) do not matter."""
        if 0 in self.shape:
            return True
        expected = FORMAT_BYTES.get(self.format, 1)
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def where(self):
        return "host memory" if self.device == DEVICE_HOST else f"cuda:{self.device}"


def data_pointer(value):
    """The data address of a numpy array or a torch tensor."""
    return value.ctypes.data if isinstance(value, np.ndarray) else value.data_ptr()


def aligned_buffer(allocate, size):
    """(buffer, its first 16-byte aligned address) of a buffer of size + 16 bytes from
    `allocate`: what the library's workspaces need, whatever alignment the allocator gives."""
    buffer = allocate(size + 16)
    address = data_pointer(buffer)
    return buffer, address + (-address) % 16


def host_values(op):
    """The host-resident values of a numpy array or a torch CPU tensor, as numpy."""
    return op.value.numpy() if op.is_torch else op.value


def _strides_of(shape, strides, itemsize):
    """The strides to check: an empty array's are the row-major ones (numpy 2 reports 0 for all
    of them; nothing is read or written through them)."""
    if 0 not in shape:
        return tuple(strides)
    row_major, step = [], itemsize
    for size in reversed(shape):
        row_major.append(step)
        step *= max(size, 1)
    return tuple(reversed(row_major))


def describe(name, value):
    """An Operand for a numpy array or a torch tensor; Error naming `name` otherwise. torch CPU
    tensors live in host memory and run on the cpu backend, as numpy arrays do."""
    if isinstance(value, np.ndarray):
        fmt = _NUMPY_FORMATS.get(value.dtype)
        if fmt is None and value.dtype.itemsize in (1, 2):
            fmt = _NUMPY_FORMAT_NAMES.get(value.dtype.name)
        return Operand(name, value, False, tuple(value.shape),
                       _strides_of(value.shape, value.strides, value.dtype.itemsize), fmt,
                       value.dtype, value.ctypes.data, DEVICE_HOST,
                       bool(value.flags.writeable))
    if is_torch_tensor(value):
        torch = torch_module()
        if value.is_cuda:
            device = value.device.index
        elif value.device.type == "cpu":
            device = DEVICE_HOST
        else:
            raise Error(f"{name}: a torch tensor on {value.device}; msaidx runs torch CUDA "
                        "tensors on the GPU backends, numpy arrays and torch CPU tensors on the "
                        "cpu backend")
        if value.layout != torch.strided or value.is_nested:
            raise Error(f"{name}: a {'nested' if value.is_nested else value.layout} torch "
                        "tensor; msaidx takes dense (strided) tensors")
        size = value.element_size()
        fmt = _torch_formats(torch).get(value.dtype)
        return Operand(name, value, True, tuple(value.shape),
                       _strides_of(value.shape, (s * size for s in value.stride()), size), fmt,
                       value.dtype, value.data_ptr(), device, True)
    raise _not_an_array(name, value)


def _not_an_array(name, value):
    return Error(f"{name}: expected a numpy.ndarray or a torch CUDA tensor, "
                 f"got {type(value).__name__}")


def require_array(name, value):
    """Error naming `name` unless value is a numpy array or a torch tensor (checked before an
    output is allocated beside it)."""
    if not isinstance(value, np.ndarray) and not is_torch_tensor(value):
        raise _not_an_array(name, value)


def require_same_place(first, others):
    """All operands numpy, or all torch tensors on the host or on one CUDA device."""
    for other in others:
        if other.is_torch != first.is_torch or other.device != first.device:
            raise Error(f"{other.name}: lives in {other.where()} "
                        f"({'torch' if other.is_torch else 'numpy'}) but {first.name} lives in "
                        f"{first.where()} ({'torch' if first.is_torch else 'numpy'}); "
                        "pass all arrays as numpy or all as torch tensors on one device")


def require_ndim(op, ndim, layout):
    if op.ndim != ndim:
        raise Error(f"{op.name}: expected {ndim} dimensions {layout}, got shape {op.shape}")


def require_format(op, formats, what):
    if op.format not in formats:
        raise Error(f"{op.name}: dtype {op.dtype_name} is not {what}")


def require_contiguous(op):
    if not op.is_c_contiguous():
        raise Error(f"{op.name}: must be C-contiguous (shape {op.shape}, strides {op.strides} "
                    "bytes)")


def require_metadata(op, length=None, what=""):
    """A 1-D contiguous int32 array, of `length` entries when given."""
    require_format(op, ("int32",), "int32")
    require_ndim(op, 1, what)
    require_contiguous(op)
    if length is not None and op.shape[0] != length:
        raise Error(f"{op.name}: has {op.shape[0]} entries, expected {length} {what}")


def require_output(op, shape, fmt, contiguous=True):
    require_format(op, (fmt,), fmt)
    if op.shape != tuple(shape):
        raise Error(f"{op.name}: shape {op.shape}, expected {tuple(shape)}")
    if contiguous:
        require_contiguous(op)
    if not op.writeable:
        raise Error(f"{op.name}: is read-only")


def row_strides(op):
    """(stride_t, stride_h) in elements of a [T, H, n] output whose rows are contiguous (unit
    stride on the last dimension): any such view, e.g. the transpose of an [H, T, n] buffer."""
    if 0 in op.shape:  # nothing is written: any strides will do
        return op.shape[1] * op.shape[2], op.shape[2]
    size = FORMAT_BYTES[op.format]
    stride_t, stride_h, stride_n = op.strides
    if op.shape[2] > 1 and stride_n != size:
        raise Error(f"{op.name}: the last dimension must have unit stride (strides "
                    f"{op.strides} bytes)")
    if stride_t % size or stride_h % size or stride_t < 0 or stride_h < 0:
        raise Error(f"{op.name}: strides {op.strides} bytes must be non-negative multiples of "
                    f"{size}")
    return stride_t // size, stride_h // size


def score_row_pitch(op):
    """The row pitch, in floats, of a scores output [T, H, pitch] whose rows (t, h) lie at
    (t * H + h) * row_pitch (the library's layout): a contiguous array, or a view of the first
    `pitch` columns of a wider one. Error for any other layout."""
    num_tokens, num_heads, pitch = op.shape
    stride_t, stride_h = row_strides(op)
    row_pitch = stride_h if num_heads > 1 else (stride_t if num_tokens > 1 else pitch)
    if row_pitch < pitch or (num_tokens > 1 and stride_t != num_heads * row_pitch):
        raise Error(f"{op.name}: rows must lie at (t * H + h) * row_pitch with row_pitch >= "
                    f"{pitch} floats (strides {op.strides} bytes): pass a contiguous array or a "
                    "[:, :, :pitch] view of one")
    return row_pitch


def as_int(name, value, low=None, high=INT32_MAX):
    """A Python int from an integral argument, within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise Error(f"{name} = {value!r}: must be an integer")
    value = int(value)
    if low is not None and value < low:
        raise Error(f"{name} = {value}: must be >= {low}")
    if high is not None and value > high:
        raise Error(f"{name} = {value}: must be <= {high}")
    return value


MAX_TOPK = 64  # MSAIDX_MAX_TOPK of the C library


def topk_params(topk, init_blocks, local_blocks):
    """(topk, init_blocks, local_blocks) as ints: topk in [1, MAX_TOPK], the forced pages >= 0 and
    together at most topk (SPEC.md section 4)."""
    topk = as_int("topk", topk, low=1, high=MAX_TOPK)
    init_blocks = as_int("init_blocks", init_blocks, low=0)
    local_blocks = as_int("local_blocks", local_blocks, low=0)
    if init_blocks + local_blocks > topk:
        raise Error(f"init_blocks + local_blocks = {init_blocks + local_blocks}: exceeds "
                    f"topk = {topk}")
    return topk, init_blocks, local_blocks


def cache_page_stride(op, head_dim):
    """The page stride, in bytes, of a key cache [num_pages, page, head_dim] whose pages are each
    a contiguous [page, head_dim] block (only the page stride may be padded): at least a page, a
    multiple of 16. Error naming the tensor otherwise."""
    num_pages, page_size, _ = op.shape
    if num_pages < 1:
        raise Error(f"{op.name}: has no pages ({op.name}.shape[0] = 0)")
    as_int(f"{op.name}: num_pages = {op.name}.shape[0]", num_pages)
    elem = FORMAT_BYTES[op.format]
    if op.strides[2] != elem or op.strides[1] != head_dim * elem:
        raise Error(f"{op.name}: each page must be a contiguous [page, {head_dim}] block (strides "
                    f"{op.strides} bytes; only the page stride may be padded)")
    min_stride = page_size * head_dim * elem
    page_stride = op.strides[0] if num_pages > 1 else min_stride
    if page_stride < min_stride or page_stride % 16:
        raise Error(f"{op.name}: page stride {page_stride} bytes must be a multiple of 16 and "
                    f">= page * {head_dim} * element size = {min_stride}")
    return page_stride


def check_dim(name, value, what, low, high, multiple):
    if value < low or value > high or value % multiple:
        raise Error(f"{name}: {what} = {value}, must be a multiple of {multiple} in "
                    f"[{low}, {high}]")


def _byte_range(op):
    """[first, last) bytes an operand's elements span (its bounding box)."""
    if 0 in op.shape:
        return op.pointer, op.pointer
    low = high = op.pointer
    for size, stride in zip(op.shape, op.strides):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return low, high + FORMAT_BYTES.get(op.format, 1)


def byte_extent(op):
    """(first, last) bytes of an operand relative to its data pointer ((0, 0): no element).
    Its shape and strides fix it, so a call cached by signature can check overlaps per call."""
    low, high = _byte_range(op)
    return low - op.pointer, high - op.pointer


def require_disjoint_ranks(out, gathered, rank_bytes, world):
    """require_disjoint against each rank's rows of `gathered` ([W, ...], rank_bytes at every
    strides[0] bytes), not the gaps between them: a packed gather interleaves the ranks' scores
    and pages. O(1) for any W."""
    low, high = _byte_range(out)
    if low == high or gathered.device != out.device or not rank_bytes or not world:
        return
    base, stride = gathered.pointer, gathered.strides[0] if world > 1 else rank_bytes
    if high <= base:
        return
    # The first rank whose rows end past `low`; the ones before it end at or before it.
    first = (low - base - rank_bytes) // stride + 1 if low >= base + rank_bytes else 0
    if first < world and base + first * stride < high:
        raise Error(f"{out.name}: overlaps {gathered.name} in memory; pass a separate output")


class Apart:
    """require_disjoint for a call validated once per signature (shapes, strides), not per data:
    the operands' byte extents are kept, and each call checks its own pointers against them."""

    def __init__(self, written, read):
        self._written = [None if op is None else (op.name, byte_extent(op)) for op in written]
        self._read = [(op.name, byte_extent(op)) for op in read]

    def check(self, written, read):
        """`written`, `read`: the data pointers of the operands given at construction, in order
        (None where an output is absent)."""
        for entry, pointer in zip(self._written, written):
            if entry is None:
                continue
            name, (first, last) = entry
            if first == last:
                continue
            for (other, (other_first, other_last)), other_pointer in zip(self._read, read):
                if (other_first < other_last and pointer + first < other_pointer + other_last
                        and other_pointer + other_first < pointer + last):
                    raise Error(f"{name}: overlaps {other} in memory; pass a separate output")


def require_disjoint(out, inputs):
    """Error naming `out` when its memory may overlap one of `inputs` (the kernels read inputs
    while writing outputs; an overlap gives results that depend on the schedule)."""
    out_low, out_high = _byte_range(out)
    if out_low == out_high:  # nothing written
        return
    for op in inputs:
        if op is None or op.device != out.device:
            continue
        low, high = _byte_range(op)
        if low < high and out_low < high and low < out_high:
            raise Error(f"{out.name}: overlaps {op.name} in memory; pass a separate output")


def block_table_layout(block_table, batch_size):
    """Checks a described int32 block table [B, max pages] of at least `batch_size` rows, each
    row's entries contiguous; returns (entries a row, row stride in entries)."""
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
