"""The geometries of a msaidx.Plan: one msaidx_plan per batch shape and cache geometry its layers
met, with its workspaces, and the rules by which they are dropped under continuous batching and
kept for CUDA graphs."""

import collections
import ctypes
import weakref

from . import _capi
from ._tensors import aligned_buffer


class BoundPlan:
    """One msaidx_plan (a batch shape and a cache geometry) with its workspace."""

    def __init__(self, context, desc, allocate, key):
        handle = ctypes.c_void_p()
        lib = _capi.lib()
        _capi.check(lib.msaidx_plan_create(ctypes.byref(handle), context.handle,
                                           ctypes.byref(desc)), "msaidx_plan_create")
        self.handle = handle
        self.key = key
        self._finalizer = weakref.finalize(self, lib.msaidx_plan_destroy, handle)
        self._allocate = allocate
        size = ctypes.c_size_t()
        _capi.check(lib.msaidx_plan_workspace_size(handle, ctypes.byref(size)),
                    "msaidx_plan_workspace_size")
        self.workspace_bytes = size.value
        self.workspace, self.workspace_address = aligned_buffer(allocate, size.value)
        self.planned = False  # for the metadata of the last plan()
        self.ever_planned = False
        # Set once a CUDA graph captured a call on this geometry: the graph replays its
        # workspaces, so the Plan keeps them for its lifetime.
        self.captured = False
        # msaidx_prefill_topk's workspace for calls without a score buffer, made at the first.
        self.topk_workspace = None
        # The streams its calls ran on: a dropped geometry's buffers stay reserved until the
        # work queued there when they were dropped is done (Geometries._forget).
        self.streams = set()

    def score_free_workspace(self):
        """(address, bytes) of the workspace of prefill_topk calls without a score buffer."""
        if self.topk_workspace is None:
            size = ctypes.c_size_t()
            _capi.check(_capi.lib().msaidx_prefill_topk_workspace_size(
                self.handle, 0, ctypes.byref(size)), "msaidx_prefill_topk_workspace_size")
            buffer, address = aligned_buffer(self._allocate, size.value)
            self.topk_workspace = (buffer, address, size.value)
        return self.topk_workspace[1:]

    def buffers(self):
        return [self.workspace] + ([] if self.topk_workspace is None else
                                   [self.topk_workspace[0]])


class Geometries:
    """A Plan's BoundPlans by key, least recently used first."""

    # Geometries kept that no CUDA graph captured. Continuous batching plans a new (B, T) almost
    # every forward; each geometry holds a plan workspace and, after prefill_topk without a score
    # buffer, T x H x (pages of the forward's max_seq_len) floats, so they cannot all stay. 16 covers the shapes one forward
    # alternates between (prefill chunk, decode rows, cache geometries) many times over.
    MAX_EAGER = 16

    def __init__(self, context, allocate, torch, device, on_drop):
        """`allocate(size)`: a uint8 buffer of the Plan's memory space; `torch` None for a host
        Plan; `on_drop(dropped)` is told of the BoundPlans dropped, before they go."""
        self._context = context
        self._allocate = allocate
        self._torch = torch
        self._device = device
        self._on_drop = on_drop
        self._bound = collections.OrderedDict()
        self._capturing = self._capture_function()

    def values(self):
        return self._bound.values()

    def items(self):
        return self._bound.items()

    def get(self, key, make_desc):
        """The BoundPlan of `key`, made from make_desc() at the first call."""
        bound = self._bound.get(key)
        if bound is None:
            bound = BoundPlan(self._context, make_desc(), self._allocate, key)
            self._bound[key] = bound
            self._evict()
        return bound

    def use(self, bound, stream):
        """Records a call on `bound` on `stream`: most recently used, and captured for good when
        a CUDA graph is being captured."""
        self._bound.move_to_end(bound.key)
        bound.streams.add(stream)
        if not bound.captured and self._capturing():
            bound.captured = True

    def discard(self, bound):
        """Drops `bound` now (a geometry whose first planning failed)."""
        self._forget([self._bound.pop(bound.key)])

    def _capture_function(self):
        """A function telling whether the current stream is capturing a CUDA graph (torch's
        C-level query where it exists: it runs on every layer call of an uncaptured geometry)."""
        if self._torch is None:
            return lambda: False
        torch = self._torch
        return getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                       torch.cuda.is_current_stream_capturing)

    def _evict(self):
        """Drops the least recently used geometries beyond MAX_EAGER that no graph captured.
        Captured ones stay: their graphs replay their workspaces. Nothing is dropped during a
        capture."""
        eager = [key for key, bound in self._bound.items() if not bound.captured]
        if len(eager) <= self.MAX_EAGER or self._capturing():
            return
        self._forget([self._bound.pop(key) for key in eager[:-self.MAX_EAGER]])

    def _forget(self, dropped):
        """Tells on_drop of the `dropped` geometries, whose buffers stay reserved for the work
        already queued on the streams they were used on."""
        if self._torch is not None:
            # torch's allocator reuses a freed block in stream order on the stream that made it
            # only; a geometry also used on other streams must wait for their queued work.
            torch = self._torch
            for bound in dropped:
                for buffer in bound.buffers():
                    for stream in bound.streams:
                        buffer.record_stream(torch.cuda.ExternalStream(stream, self._device))
        self._on_drop(dropped)
