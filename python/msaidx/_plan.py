"""msaidx.Plan: the C API's plan-once / run-per-layer split, from Python."""

import ctypes

import numpy as np

from . import _capi, _torch_ops
from ._capi import DEVICE_HOST, Error
from ._geometries import Geometries
from ._tensors import (
    INT32_MAX,
    MAX_TOPK,
    Apart,
    as_int,
    block_table_layout,
    check_dim,
    data_pointer,
    describe,
    require_format,
    require_metadata,
    require_ndim,
    require_array,
    require_output,
    require_same_place,
    row_strides,
    score_row_pitch,
    topk_params,
    torch_module,
)


def _signature(value, name):
    """What validation of an argument depends on (never its data): shape, strides, dtype, place.
    Error naming `name` when it is neither a numpy array nor a torch tensor."""
    require_array(name, value)
    if isinstance(value, np.ndarray):
        return (value.shape, value.strides, value.dtype, value.ctypes.data % 16 == 0,
                value.flags.writeable)
    return (value.shape, value.stride(), value.dtype, value.get_device(),
            value.data_ptr() % 16 == 0)


class Plan:
    """Plan once per forward, run per layer (SPEC.md section 10).

    ``Plan(num_heads, dtype="e4m3", backend="auto", precision="default", device="cuda",
    max_batch=B, max_tokens=T, max_q_len=None, max_seq_len=None, pitch=8192)`` holds the bounds
    and the library's context; ``plan(block_table, cu_seqlens_q, seq_lens)`` plans a forward from
    device metadata without a host synchronisation (the planned token count is ``max_tokens``
    unless ``num_tokens=`` says otherwise: q of every layer has that many rows; ``max_seq_len=``
    bounds the forward's sequences, so that the top-k runs the kernels of rows that long under a
    wide pitch); then per layer
    ``prefill_scores`` / ``decode_scores`` / ``topk_select`` / ``prefill_topk``. ``nvp`` is the
    planned batch's int32 [T] (a torch tensor where plan() took torch tensors, else numpy);
    ``check()`` synchronises and raises on metadata errors.

    ``cp_world=W, cp_rank=r, cp_layout="interleaved"|"contiguous"`` make a context-parallel
    plan (every backend): block_table rows list only the rank's pages, scores hold
    them in their columns, and ``prefill_topk_candidates`` returns global page ids for
    ``msaidx.distributed`` (docs/context_parallel.md).

    ``device="cpu"`` plans for numpy arrays (or torch CPU tensors) on the cpu backend; bounds
    left None there default to ``max_tokens`` and ``pitch * page_size``. The cache geometry
    (page count, page stride) is taken from the first layer's k_cache; validation that depends
    only on shapes runs once per distinct argument layout and is cached. Its calls update those
    caches: use a Plan from one thread at a time (one per thread, or a lock around its calls).
    """

    def __init__(self, num_heads, dtype="e4m3", backend="auto", precision="default",
                 device="cuda", max_batch=None, max_tokens=None, max_q_len=None,
                 max_seq_len=None, pitch=8192, *, head_dim=128, page_size=128, cp_world=1,
                 cp_rank=0, cp_layout="interleaved"):
        torch = torch_module()
        self._torch = None
        if device == "cpu" or (torch is not None and isinstance(device, torch.device)
                               and device.type == "cpu"):
            self._device = DEVICE_HOST
        else:
            if torch is None:
                raise Error(f"device = {device!r}: a CUDA plan needs torch (import torch first); "
                            "device='cpu' plans for numpy arrays")
            try:
                torch_device = torch.device(device)
            except (RuntimeError, TypeError) as error:
                raise Error(f"device = {device!r}: {error}") from None
            if torch_device.type != "cuda":
                raise Error(f"device = {device!r}: must be 'cpu' or a CUDA device")
            if torch_device.index is not None:
                self._device = torch_device.index
            else:
                try:
                    self._device = torch.cuda.current_device()
                except (RuntimeError, AssertionError) as error:  # no driver; a CPU-only torch
                    raise Error(f"device = {device!r}: torch has no current CUDA device: "
                                f"{error}") from None
            self._torch = torch
            self._torch_device = torch.device("cuda", self._device)
        if isinstance(dtype, str):
            fmt = dtype
        else:
            fmt = {getattr(torch, "float8_e4m3fn", None): "e4m3", getattr(torch, "uint8", None):
                   "e4m3", getattr(torch, "bfloat16", None): "bf16"}.get(dtype) if torch else None
        if fmt not in _capi.DTYPES:
            raise Error(f"dtype = {dtype!r}: must be 'e4m3' or 'bf16' (or a torch dtype)")
        from . import _backend_for
        backend = _backend_for(backend, self._device != DEVICE_HOST)
        self.num_heads = as_int("num_heads", num_heads, low=1, high=16)
        self.head_dim = as_int("head_dim", head_dim)
        check_dim("head_dim", self.head_dim, "head_dim", 16, 256, 16)
        self.page_size = as_int("page_size", page_size)
        check_dim("page_size", self.page_size, "page_size", 16, 512, 16)
        if max_batch is None or max_tokens is None:
            raise Error("max_batch, max_tokens: the plan's bounds are required")
        self.max_batch = as_int("max_batch", max_batch, low=0)
        self.max_tokens = as_int("max_tokens", max_tokens, low=0)
        self.pitch = as_int("pitch", pitch, low=1)
        self.max_q_len = self.max_tokens if max_q_len is None else as_int(
            "max_q_len", max_q_len, low=0, high=self.max_tokens)
        # Context parallel (docs/context_parallel.md): block_table rows and score columns hold
        # only this rank's pages, so pitch bounds a rank's ceil(pages / cp_world).
        self.cp_world = as_int("cp_world", cp_world, low=1)
        self.cp_rank = as_int("cp_rank", cp_rank, low=0, high=self.cp_world - 1)
        if cp_layout not in _capi.CP_LAYOUTS:
            raise Error(f"cp_layout = {cp_layout!r}: must be one of {sorted(_capi.CP_LAYOUTS)}")
        self.cp_layout = cp_layout
        pitch_bound = min(self.pitch * self.page_size * self.cp_world, INT32_MAX)
        self.max_seq_len = pitch_bound if max_seq_len is None else as_int(
            "max_seq_len", max_seq_len, low=0)
        rank_pages = self._row_pages(self.max_seq_len)
        if rank_pages > self.pitch:
            raise Error(f"pitch = {self.pitch}: below the {rank_pages} pages of max_seq_len = "
                        f"{self.max_seq_len}" + (f" per rank of cp_world = {self.cp_world}"
                                                 if self.cp_world > 1 else ""))
        self.dtype = fmt
        self.precision = precision
        fast = _capi.fast_accumulation_for(precision, _capi.DTYPES[fmt])
        self._context = _capi.context(
            backend,
            num_heads=self.num_heads, dtype=_capi.DTYPES[fmt], head_dim=self.head_dim,
            page_size=self.page_size, device=self._device, fast_accumulation=fast)
        self.backend = self._context.backend
        self._lib = _capi.lib()
        self._nvp_buffer = self._empty((self.max_tokens,), "int32")
        # What the torch ops take as the plan's nvp (a tensor, sharing a host plan's memory).
        self._nvp_tensor = (torch.from_numpy(self._nvp_buffer)
                            if torch is not None and self._torch is None else self._nvp_buffer)
        self._geometries = Geometries(self._context, lambda size: self._empty((size,), "uint8"),
                                      self._torch, self._device, self._drop_layer_calls)
        self._metadata = None    # the planned forward's (block_table, cu, seq_lens) and shapes
        self._table_bound = None  # why desc.max_seq_len is below the bound, when block_table
        self._metadata_is_torch = self._torch is not None
        self._num_tokens = self.max_tokens
        self._traced_num_tokens = None  # the last plan()'s num_tokens, for nvp under compile
        self._layer_cache = {}   # (entry, argument signatures) -> validated call parameters
        self._topk_contexts = {}
        self._id = _torch_ops.register_plan(self)
        self._stream = self._stream_function()

    # ------------------------------------------------------------------ memory space helpers

    def _empty(self, shape, fmt, fill=None):
        torch = self._torch
        if torch is None:
            dtype = {"int32": np.int32, "float32": np.float32, "uint8": np.uint8}[fmt]
            return np.empty(shape, dtype) if fill is None else np.full(shape, fill, dtype)
        dtype = {"int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}[fmt]
        if fill is None:
            return torch.empty(shape, dtype=dtype, device=self._torch_device)
        return torch.full(shape, fill, dtype=dtype, device=self._torch_device)

    def _stream_function(self):
        """A function returning the current stream's handle for the plan's device: torch's
        C-level getter where it exists (the per-call cost matters), else the public API."""
        if self._torch is None:
            return lambda: None
        torch, device = self._torch, self._device
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return lambda: raw(device)
        return lambda: torch.cuda.current_stream(device).cuda_stream

    def _place_of(self, op):
        return "cpu" if self._device == DEVICE_HOST else f"cuda:{self._device}"

    def _require_here(self, ops):
        for op in ops:
            if op.device != self._device or (self._torch is not None and not op.is_torch):
                raise Error(f"{op.name}: lives in {op.where()}, the plan in "
                            f"{self._place_of(op)}")

    # ------------------------------------------------------------------ per forward

    @property
    def nvp(self):
        """int32 [T]: pages visible to each token of the planned batch (0 for padding); on a
        context-parallel plan the global count (what msaidx.distributed's merge takes), not the
        rank's score columns."""
        torch = torch_module()
        if torch is not None and torch.compiler.is_compiling():
            # Traced: plan() ran as an op, not in Python; its token count is the traced call's.
            if self._traced_num_tokens is None:
                raise Error("plan(): call plan(block_table, cu_seqlens_q, seq_lens) before "
                            "reading nvp")
            return self._nvp_tensor[:self._traced_num_tokens]
        self._planned()
        # Of the planned metadata's kind, as every output follows its argument's: a torch CPU
        # tensor (sharing the buffer) where plan() was given torch tensors, else numpy.
        buffer = self._nvp_tensor if self._metadata_is_torch else self._nvp_buffer
        return buffer[:self._num_tokens]

    def plan(self, block_table, cu_seqlens_q, seq_lens, *, num_tokens=None, max_seq_len=None):
        """Plans a forward from its metadata (device kernels on the current stream; nothing read
        on the host). ``num_tokens`` (default max_tokens) is q's row count in every layer.
        ``max_seq_len`` (default the Plan's) bounds this forward's seq_lens, as engines know it
        on the host: the top-k then runs the kernels of rows that long whatever the pitch. It is
        rounded up to a power of two pages, so that varying bounds plan few geometries; a
        request above it is skipped and reported like one above the Plan's bound."""
        num_tokens = self._num_tokens_arg(num_tokens)
        bound = self._max_seq_len_arg(max_seq_len)
        # What nvp slices under torch.compile, whether plan() itself was traced or ran eagerly.
        self._traced_num_tokens = num_tokens
        if _torch_ops.tracing(cu_seqlens_q):
            _torch_ops.ops().plan_batch(self._id, block_table, cu_seqlens_q, seq_lens,
                                        num_tokens, bound, self._nvp_tensor)
            return
        self._plan(block_table, cu_seqlens_q, seq_lens, num_tokens, bound)

    def _num_tokens_arg(self, num_tokens):
        if num_tokens is None:
            return self.max_tokens
        return as_int("num_tokens", num_tokens, low=0, high=self.max_tokens)

    def _max_seq_len_arg(self, max_seq_len):
        """The forward's bound on seq_lens: the argument rounded up to a power of two pages,
        at most the Plan's max_seq_len."""
        if max_seq_len is None:
            return self.max_seq_len
        tokens = as_int("max_seq_len", max_seq_len, low=0, high=self.max_seq_len)
        pages = -(-tokens // self.page_size)
        return min(self.max_seq_len, (1 << max(pages - 1, 0).bit_length()) * self.page_size)

    def _plan(self, block_table, cu_seqlens_q, seq_lens, num_tokens, bound):
        bt_op, cu_op, lens_op = (describe("block_table", block_table),
                                 describe("cu_seqlens_q", cu_seqlens_q),
                                 describe("seq_lens", seq_lens))
        self._require_here((bt_op, cu_op, lens_op))
        require_metadata(cu_op, what="[B + 1]")
        if not 1 <= cu_op.shape[0] <= self.max_batch + 1:
            raise Error(f"cu_seqlens_q: has {cu_op.shape[0]} entries, must be B + 1 with "
                        f"B <= max_batch = {self.max_batch}")
        batch_size = cu_op.shape[0] - 1
        require_metadata(lens_op, batch_size, f"(B = {batch_size}, from cu_seqlens_q)")
        cols, bt_stride = block_table_layout(bt_op, batch_size)
        # A request sees no more pages than its block-table row holds: longer ones are skipped
        # on the device and reported by check(), whose message then names the block table.
        table_tokens = cols * self.cp_world * self.page_size
        max_seq_len = min(bound, table_tokens)
        self._table_bound = (f"desc.max_seq_len = {table_tokens} is what the {cols} columns "
                             "of block_table hold" if table_tokens < bound else None)
        # Keep the metadata alive: the library reads it again in every layer on the cpu backend
        # and whenever a geometry is planned late.
        self._metadata = (block_table, cu_seqlens_q, seq_lens, batch_size,
                          bt_stride, max_seq_len, bt_op.pointer, cu_op.pointer,
                          lens_op.pointer)
        self._num_tokens = num_tokens
        self._metadata_is_torch = bt_op.is_torch
        for bound in self._geometries.values():
            bound.planned = False
        stream = self._stream()
        held = _capi.context("auto", page_size=self.page_size, device=self._device)
        _capi.check(self._lib.msaidx_num_valid_pages(
            held.handle, cu_op.pointer, lens_op.pointer, batch_size, num_tokens,
            data_pointer(self._nvp_buffer), stream), "msaidx_num_valid_pages")
        # Geometries layers ran on before are planned now; a new one on its first layer.
        for key, bound in list(self._geometries.items()):
            if bound.ever_planned and key[:4] == (batch_size, num_tokens, max_seq_len,
                                                  self._metadata[4]):
                self._plan_bound(bound, stream)

    def _plan_bound(self, bound, stream):
        bt, cu, lens = self._metadata[6:]
        try:
            self._check_metadata(self._lib.msaidx_plan_batch(
                bound.handle, cu, lens, bt, bound.workspace_address, bound.workspace_bytes,
                stream), "msaidx_plan_batch")
        except Error:
            # A geometry first met by a call that fails here (a k_cache the planned block table
            # does not fit) leaves nothing behind: kept, every later plan() would re-plan it and
            # fail with it.
            if not bound.ever_planned and not bound.captured:
                self._geometries.discard(bound)
            raise
        bound.planned = bound.ever_planned = True
        self._geometries.use(bound, stream)

    def _row_pages(self, seq_len):
        """The most pages a row of a request of seq_len tokens has: the rank's ceil(P / W) of
        its P pages (msaidx_plan_row_pages)."""
        return -(-(-(-seq_len // self.page_size)) // self.cp_world)

    def _planned(self):
        """The planned forward's (batch_size, bt_stride, max_seq_len)."""
        if self._metadata is None:
            raise Error("plan(): call plan(block_table, cu_seqlens_q, seq_lens) before the layers")
        return self._metadata[3:6]

    def _bound_plan(self, num_pages, page_stride, row_pitch):
        batch_size, bt_stride, max_seq_len = self._planned()
        key = (batch_size, self._num_tokens, max_seq_len, bt_stride, num_pages, page_stride,
               row_pitch)

        def make_desc():
            desc = _capi.BatchDesc()
            self._lib.msaidx_batch_desc_init(ctypes.byref(desc))
            desc.batch_size = batch_size
            desc.num_tokens = self._num_tokens
            desc.max_q_len = min(self.max_q_len, self._num_tokens)
            desc.max_seq_len = max_seq_len
            desc.num_pages = num_pages
            desc.bt_stride = bt_stride
            desc.page_stride = page_stride
            desc.pitch = row_pitch
            desc.cp_world = self.cp_world
            desc.cp_rank = self.cp_rank
            desc.cp_layout = _capi.CP_LAYOUTS[self.cp_layout]
            return desc

        return self._geometries.get(key, make_desc)

    def _drop_layer_calls(self, dropped):
        """Drops the layer-cache entries that reference the `dropped` geometries."""
        self._layer_cache = {
            key: value for key, value in self._layer_cache.items()
            if not any(value[0] is bound for bound in dropped)}

    def check(self):
        """Synchronises the stream; raises Error naming the bad metadata of the planned batch
        that the layers run since plan() met (a geometry is planned at its first layer call, so
        before any layer there is nothing to report)."""
        for bound in self._geometries.values():
            if bound.planned:
                self._check_metadata(self._lib.msaidx_plan_check(bound.handle, self._stream()),
                                     "msaidx_plan_check")

    def _check_metadata(self, status, what):
        """_capi.check, saying where desc.max_seq_len came from when the block table's width,
        not the Plan's bound, set it (a request longer than its row is refused for it)."""
        try:
            _capi.check(status, what)
        except Error as error:
            if self._table_bound is None or "desc.max_seq_len" not in str(error):
                raise
            raise Error(f"{error} ({self._table_bound})") from None

    # ------------------------------------------------------------------ per layer

    def prefill_scores(self, q, k_cache, out=None):
        """float32 [T, H, pitch] scores of the planned batch, as msaidx.prefill_scores."""
        return self._layer_scores(False, q, k_cache, out)

    def decode_scores(self, q, k_cache, out=None):
        """As prefill_scores, on the decode path (launch shape from the bounds only)."""
        return self._layer_scores(True, q, k_cache, out)

    def _layer_scores(self, decode, q, k_cache, out):
        if out is None:
            out = self._new_scores(q)
        if _torch_ops.tracing(q):
            _torch_ops.ops().plan_scores(self._id, decode, q, k_cache,
                                         self._nvp_tensor[:q.shape[0]], out)
            return out
        self._scores(decode, q, k_cache, out)
        return out

    def _new_scores(self, q):
        """Scores filled with -inf, of q's kind (numpy, or a torch tensor on q's device)."""
        require_array("q", q)
        shape = (q.shape[0], self.num_heads, self.pitch)
        if isinstance(q, np.ndarray):
            return np.full(shape, -np.inf, np.float32)
        torch = torch_module()
        return torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)

    def _scores(self, decode, q, k_cache, out):
        key = (decode, _signature(q, "q"), _signature(k_cache, "k_cache"), _signature(out, "out"),
               self._metadata[3:6] if self._metadata else None, self._num_tokens)
        call = self._layer_cache.get(key)
        if call is None:
            call = self._validate_scores(q, k_cache, out)
            self._layer_cache[key] = call
        bound, apart = call
        apart.check((data_pointer(out),), (data_pointer(q), data_pointer(k_cache)))
        stream = self._stream()
        if not bound.planned:
            self._plan_bound(bound, stream)
        self._geometries.use(bound, stream)
        run = self._lib.msaidx_decode_scores if decode else self._lib.msaidx_prefill_scores
        status = run(bound.handle, data_pointer(q), data_pointer(k_cache), data_pointer(out),
                     stream)
        if status:
            _capi.check(status, "msaidx_decode_scores" if decode else "msaidx_prefill_scores")

    def _validate_scores(self, q, k_cache, out, out_name="out", outputs=()):
        """Checks a layer call's q, k_cache and score output against the plan; returns the bound
        plan of this cache geometry and the Apart of the score output and the described
        `outputs` (a selection's) from q and k_cache."""
        from . import _validate_cache
        q_op, k_op = describe("q", q), describe("k_cache", k_cache)
        out_op = None if out is None else describe(out_name, out)
        apart = Apart((out_op,) + tuple(outputs), (q_op, k_op))
        others = (k_op,) if out_op is None else (k_op, out_op)
        self._require_here((q_op,) + others)
        require_same_place(q_op, others)
        num_tokens, num_heads, head_dim, num_pages, page_size, page_stride = \
            _validate_cache(q_op, k_op)
        if (num_heads, head_dim, page_size) != (self.num_heads, self.head_dim, self.page_size):
            raise Error(f"q, k_cache: H = {num_heads}, D = {head_dim}, page = {page_size}; the "
                        f"plan has H = {self.num_heads}, D = {self.head_dim}, page = "
                        f"{self.page_size}")
        if q_op.format != self.dtype:
            raise Error(f"q: dtype {q_op.dtype_name} is not the plan's {self.dtype}")
        if num_tokens != self._num_tokens:
            raise Error(f"q: has {num_tokens} rows, the planned batch T = {self._num_tokens} "
                        "(plan(..., num_tokens=q.shape[0]))")
        if q_op.pointer % 16 or k_op.pointer % 16:
            raise Error("q, k_cache: data must be 16-byte aligned")
        if out_op is None:
            # No score reaches the caller, so the workspace's rows hold the forward's pages only,
            # not the Plan's pitch (which engines size for their longest context).
            row_pages = max(1, self._row_pages(self._planned()[2]))
            return self._bound_plan(num_pages, page_stride, row_pages), apart
        require_output(out_op, (num_tokens, num_heads, self.pitch), "float32", contiguous=False)
        row_pitch = as_int(f"{out_name}: row pitch", score_row_pitch(out_op))
        return self._bound_plan(num_pages, page_stride, row_pitch), apart

    def topk_select(self, scores, topk=16, init_blocks=0, local_blocks=1, out=None):
        """int32 [T, H, topk] selection of the planned batch's scores, as msaidx.topk_select
        (``out`` may be any view with unit stride on its last dimension)."""
        if self.cp_world > 1:
            # Plan.nvp holds the global counts; the rank's score columns are its own pages.
            raise Error(f"topk_select: a context-parallel plan (cp_world = {self.cp_world}) "
                        "scores only this rank's pages; select with prefill_topk_candidates and "
                        "msaidx.distributed.merge_candidates (or msaidx.distributed.prefill_topk)")
        if out is None:
            out = self._new_rows("scores", scores, topk)
        if _torch_ops.tracing(scores):
            _torch_ops.ops().plan_topk(self._id, scores, self._nvp_tensor[:scores.shape[0]],
                                       topk, init_blocks, local_blocks, out)
            return out
        self._topk(scores, topk, init_blocks, local_blocks, out)
        return out

    def _new_rows(self, name, like, topk, floats=False):
        """An int32 (or float32) [T, H, topk] output beside `like`, the argument `name` (numpy or
        torch, its device); `like` and `topk` are checked first, as the call would."""
        require_array(name, like)
        topk = as_int("topk", topk, low=1, high=MAX_TOPK)
        shape = (like.shape[0], self.num_heads, topk)
        if isinstance(like, np.ndarray):
            return np.empty(shape, np.float32 if floats else np.int32)
        torch = torch_module()
        return torch.empty(shape, dtype=torch.float32 if floats else torch.int32,
                           device=like.device)

    def _topk(self, scores, topk, init_blocks, local_blocks, out):
        # Checked as ints before they key the layer cache (any value may be passed).
        topk, init_blocks, local_blocks = topk_params(topk, init_blocks, local_blocks)
        key = ("topk", _signature(scores, "scores"), _signature(out, "out"), topk, init_blocks,
               local_blocks,
               self._num_tokens)
        call = self._layer_cache.get(key)
        if call is None:
            call = self._validate_topk(scores, topk, init_blocks, local_blocks, out)
            self._layer_cache[key] = call
        handle, pitch, stride_t, stride_h = call
        # The planned batch's longest row: under a pitch sized for the longest context the
        # device picks the selection kernels of the batch's own length.
        max_nvp = min(pitch, max(1, self._row_pages(self._planned()[2])))
        status = self._lib.msaidx_topk_select_bounded(
            handle, data_pointer(scores), pitch, max_nvp, data_pointer(self._nvp_buffer),
            self._num_tokens, data_pointer(out), stride_t, stride_h, self._stream())
        if status:
            _capi.check(status, "msaidx_topk_select")

    def _validate_topk(self, scores, topk, init_blocks, local_blocks, out):
        scores_op, out_op = describe("scores", scores), describe("out", out)
        self._require_here((scores_op, out_op))
        require_format(scores_op, ("float32",), "float32")
        require_ndim(scores_op, 3, "[T, H, pitch]")
        shape = (self._num_tokens, self.num_heads, self.pitch)
        if scores_op.shape != shape:
            raise Error(f"scores: shape {scores_op.shape}, expected the planned {shape}")
        pitch = as_int("scores: row pitch", score_row_pitch(scores_op))
        require_output(out_op, (self._num_tokens, self.num_heads, topk), "int32",
                       contiguous=False)
        stride_t, stride_h = row_strides(out_op)
        held = _capi.context("auto", num_heads=self.num_heads, topk=topk,
                             init_blocks=init_blocks, local_blocks=local_blocks,
                             page_size=self.page_size, device=self._device)
        return held.handle, pitch, stride_t, stride_h

    def prefill_topk(self, q, k_cache, topk=16, init_blocks=0, local_blocks=1, scores_out=None,
                     out=None):
        """Scores and top-k of one layer in one call (msaidx_prefill_topk): returns the int32
        [T, H, topk] selection, bitwise ``topk_select(prefill_scores(q, k_cache))``. With
        ``scores_out=None`` no score is written to caller memory (the plan keeps a workspace for
        them where the backend needs one); given, it receives exactly prefill_scores' scores.
        ``out`` may be any view with unit stride on its last dimension."""
        if out is None:
            out = self._new_rows("q", q, topk)
        if _torch_ops.tracing(q):
            _torch_ops.ops().plan_prefill_topk(self._id, q, k_cache,
                                               self._nvp_tensor[:q.shape[0]], topk, init_blocks,
                                               local_blocks, scores_out, out)
            return out
        self._prefill_topk(q, k_cache, topk, init_blocks, local_blocks, scores_out, out, None)
        return out

    def prefill_topk_candidates(self, q, k_cache, topk=16, scores_out=None, out=None):
        """Per row the best ``topk`` pages with their scores, no page forced: what a
        context-parallel merge gathers from every rank (msaidx_prefill_topk_candidates). Returns
        (float32 scores, int32 pages), both [T, H, topk]: pages ascending, -1 padded; each
        page's score beside it (NaN as -inf, -inf beside -1). ``out`` is an optional (scores,
        pages) pair of outputs."""
        if out is None:
            out = (self._new_rows("q", q, topk, floats=True), self._new_rows("q", q, topk))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise Error("out: must be a (candidate_scores, pages) pair of outputs")
        candidate_scores, pages = out
        if _torch_ops.tracing(q):
            _torch_ops.ops().plan_prefill_topk_candidates(
                self._id, q, k_cache, self._nvp_tensor[:q.shape[0]], topk, scores_out,
                candidate_scores, pages)
            return candidate_scores, pages
        self._prefill_topk(q, k_cache, topk, 0, 0, scores_out, pages, candidate_scores)
        return candidate_scores, pages

    def _prefill_topk(self, q, k_cache, topk, init_blocks, local_blocks, scores_out, out,
                      candidate_scores):
        out_name = "out" if candidate_scores is None else "out[1]"
        # Checked as ints before they key the layer cache (any value may be passed).
        topk, init_blocks, local_blocks = topk_params(topk, init_blocks, local_blocks)
        key = ("prefill_topk", _signature(q, "q"), _signature(k_cache, "k_cache"),
               None if scores_out is None else _signature(scores_out, "scores_out"),
               _signature(out, out_name),
               None if candidate_scores is None else _signature(candidate_scores, "out[0]"), topk,
               init_blocks, local_blocks, self._metadata[3:6] if self._metadata else None,
               self._num_tokens)
        call = self._layer_cache.get(key)
        if call is None:
            call = self._validate_prefill_topk(q, k_cache, topk, init_blocks, local_blocks,
                                               scores_out, out, candidate_scores)
            self._layer_cache[key] = call
        bound, args, apart = call
        scores = None if scores_out is None else data_pointer(scores_out)
        apart.check((scores, data_pointer(out),
                     None if candidate_scores is None else data_pointer(candidate_scores)),
                    (data_pointer(q), data_pointer(k_cache)))
        stream = self._stream()
        if not bound.planned:
            self._plan_bound(bound, stream)
        self._geometries.use(bound, stream)
        if candidate_scores is None:
            status = self._lib.msaidx_prefill_topk(
                bound.handle, data_pointer(q), data_pointer(k_cache), ctypes.byref(args), scores,
                data_pointer(out), stream)
            if status:
                _capi.check(status, "msaidx_prefill_topk")
            return
        status = self._lib.msaidx_prefill_topk_candidates(
            bound.handle, data_pointer(q), data_pointer(k_cache), ctypes.byref(args), scores,
            data_pointer(candidate_scores), data_pointer(out), stream)
        if status:
            _capi.check(status, "msaidx_prefill_topk_candidates")

    def _validate_prefill_topk(self, q, k_cache, topk, init_blocks, local_blocks, scores_out, out,
                               candidate_scores):
        out_name = "out" if candidate_scores is None else "out[1]"
        out_op = describe(out_name, out)
        scores_op = None if candidate_scores is None else describe("out[0]", candidate_scores)
        bound, apart = self._validate_scores(q, k_cache, scores_out, "scores_out",
                                             (out_op, scores_op))
        shape = (self._num_tokens, self.num_heads, topk)
        self._require_here((out_op,))
        require_output(out_op, shape, "int32", contiguous=False)
        stride_t, stride_h = row_strides(out_op)
        if scores_op is not None:
            self._require_here((scores_op,))
            require_output(scores_op, shape, "float32", contiguous=False)
            if row_strides(scores_op) != (stride_t, stride_h):
                raise Error(f"out[0], out[1]: candidate scores and pages must share their row "
                            f"strides ({scores_op.strides} vs {out_op.strides} bytes)")
        args = _capi.TopkArgs()
        self._lib.msaidx_topk_args_init(ctypes.byref(args))
        args.topk, args.init_blocks, args.local_blocks = topk, init_blocks, local_blocks
        args.out_stride_t, args.out_stride_h = stride_t, stride_h
        if scores_out is None:
            args.workspace, args.workspace_bytes = bound.score_free_workspace()
        return bound, args, apart
