"""msaidx.distributed: context parallel over torch.distributed (SPEC.md section 12).

Each rank holds a context-parallel ``msaidx.Plan`` (``cp_world``, ``cp_rank``, ``cp_layout``) whose
block_table rows list only the rank's pages; ``prefill_topk`` scores them, takes the rank's best
``topk`` (score, global page) candidates per row, gathers every rank's with ONE collective
(``all_gather_into_tensor`` of a fixed-size buffer) and merges them into exactly the selection one
device makes over the whole cache. See docs/context_parallel.md. The merge runs where the
candidates live: the cpu backend for numpy arrays and torch CPU tensors (gloo), a CUDA device for
torch CUDA tensors (NCCL), on the current stream. torch is needed only for the collective.
"""

import contextlib
import ctypes

import numpy as np

from . import _capi
from ._capi import Error
from ._tensors import (DEVICE_HOST, as_int, describe, require_array, require_disjoint,
                       require_disjoint_ranks, require_output, require_same_place, row_strides,
                       topk_params, torch_module)

__all__ = ["owned_pages", "merge_candidates", "prefill_topk"]


def owned_pages(num_pages, world, rank, layout="interleaved"):
    """int32 global ids, ascending, of the pages rank ``rank`` of ``world`` owns among a
    request's ``num_pages`` logical pages: its block-table row lists their physical pages in this
    order. "interleaved": page j on rank j mod world; "contiguous": [rank * C, (rank + 1) * C)
    with C = ceil(num_pages / world) (include/msaidx.h, msaidx_cp_layout)."""
    num_pages = as_int("num_pages", num_pages, low=0)
    world = as_int("world", world, low=1)
    rank = as_int("rank", rank, low=0, high=world - 1)
    if layout == "interleaved":
        return np.arange(rank, num_pages, world, dtype=np.int32)
    if layout == "contiguous":
        chunk = -(-num_pages // world)
        return np.arange(rank * chunk, min((rank + 1) * chunk, num_pages), dtype=np.int32)
    raise Error(f"layout = {layout!r}: must be one of {sorted(_capi.CP_LAYOUTS)}")


def merge_candidates(candidate_scores, candidate_pages, nvp, topk=16, init_blocks=0,
                     local_blocks=1, out=None):
    """The selection int32 [T, H, topk] (SPEC.md section 4, global page ids) from the gathered
    candidates of every rank: ``candidate_scores`` float32 and ``candidate_pages`` int32, both
    [W, T, H, topk] with each rank's [T, H, topk] contiguous and the same rank stride (views of
    one gathered buffer are fine); ``nvp`` int32 [T] the GLOBAL visible pages (``Plan.nvp``).
    numpy arrays or torch CPU tensors (msaidx_merge_candidates on the cpu backend), or torch
    tensors on one CUDA device (the device merge, on the current stream). Candidates outside the
    free pages or -1 are ignored; a page given more than once counts once, at its best score."""
    scores_op = describe("candidate_scores", candidate_scores)
    pages_op = describe("candidate_pages", candidate_pages)
    nvp_op = describe("nvp", nvp)
    require_same_place(scores_op, (pages_op, nvp_op))
    if scores_op.format != "float32" or pages_op.format != "int32":
        raise Error(f"candidate_scores, candidate_pages: must be float32 and int32 (got "
                    f"{scores_op.dtype_name} and {pages_op.dtype_name})")
    if len(scores_op.shape) != 4 or scores_op.shape != pages_op.shape:
        raise Error(f"candidate_scores, candidate_pages: must both be [W, T, H, topk] (shapes "
                    f"{scores_op.shape} and {pages_op.shape})")
    world, num_tokens, num_heads, width = scores_op.shape
    if world < 1:
        raise Error("candidate_scores, candidate_pages: no rank (W = shape[0] = 0)")
    topk, init_blocks, local_blocks = topk_params(topk, init_blocks, local_blocks)
    if width != topk:
        raise Error(f"candidate_scores: rows of {width} candidates, topk = {topk}")
    rows = num_tokens * num_heads * topk
    inner = (num_heads * topk * 4, topk * 4, 4)
    for op in (scores_op, pages_op):
        dense = all(stride == want or extent == 1
                    for stride, want, extent in zip(op.strides[1:], inner, op.shape[1:]))
        if not dense or (world > 1 and op.strides[0] % 4):
            raise Error(f"{op.name}: each rank's [T, H, topk] must be contiguous (strides "
                        f"{op.strides} bytes)")
    if world > 1 and scores_op.strides[0] < rows * 4:
        raise Error(f"candidate_scores: rank stride {scores_op.strides[0]} bytes, below a rank's "
                    f"T x H x topk x 4 = {rows * 4} (each rank's rows apart, in rank order)")
    rank_stride = scores_op.strides[0] // 4 if world > 1 else rows
    if world > 1 and pages_op.strides[0] // 4 != rank_stride:
        raise Error(f"candidate_scores, candidate_pages: rank strides differ ({scores_op.strides[0]}"
                    f" and {pages_op.strides[0]} bytes)")
    if nvp_op.format != "int32" or nvp_op.shape != (num_tokens,) or (
            num_tokens > 1 and nvp_op.strides[0] != 4):
        raise Error(f"nvp: must be contiguous int32 [T = {num_tokens}] (got {nvp_op.dtype_name} "
                    f"{nvp_op.shape})")
    shape = (num_tokens, num_heads, topk)
    on_device = scores_op.device != DEVICE_HOST
    if out is None:
        out = (np.empty(shape, np.int32) if not scores_op.is_torch else
               torch_module().empty(shape, dtype=torch_module().int32,
                                    device=candidate_scores.device))
    out_op = describe("out", out)
    require_same_place(scores_op, (out_op,))
    # Any view with unit stride on its last dimension (SPEC.md section 10), as Plan.prefill_topk.
    require_output(out_op, shape, "int32", contiguous=False)
    # out may start where candidate_pages does (the merge in place over rank 0's rows, whose
    # layout the library checks); any other overlap with a rank's rows is refused.
    in_place = out_op.pointer == pages_op.pointer and out_op.device == pages_op.device
    for gathered in (scores_op,) if in_place else (scores_op, pages_op):
        require_disjoint_ranks(out_op, gathered, rows * 4, world)
    require_disjoint(out_op, (nvp_op,))
    stride_t, stride_h = row_strides(out_op)
    held = _capi.context("auto" if on_device else "cpu", num_heads=num_heads, topk=topk,
                         init_blocks=init_blocks, local_blocks=local_blocks,
                         device=scores_op.device)
    stream, guard = None, contextlib.nullcontext()
    if on_device:
        torch = torch_module()
        stream = torch.cuda.current_stream(candidate_scores.device).cuda_stream
        guard = torch.cuda.device(candidate_scores.device)
    args = _capi.TopkArgs()
    lib = _capi.lib()
    lib.msaidx_topk_args_init(ctypes.byref(args))
    args.topk = topk
    args.out_stride_t, args.out_stride_h = stride_t, stride_h
    args.init_blocks, args.local_blocks = init_blocks, local_blocks
    with guard:
        status = lib.msaidx_merge_candidates(held.handle, ctypes.byref(args), world, num_tokens,
                                             nvp_op.pointer, scores_op.pointer, pages_op.pointer,
                                             rank_stride, out_op.pointer, stream)
    _capi.check(status, "msaidx_merge_candidates")
    return out


def prefill_topk(plan, q, k_cache, topk=16, init_blocks=0, local_blocks=1, group=None,
                 out=None):
    """The selection [T, H, topk] of the whole (sharded) cache, the same on every rank of
    ``group``: bitwise what ``Plan.prefill_topk`` of one unsharded plan gives. Call it on every
    rank with its context-parallel ``plan`` (cp_world = the group's size, cp_rank = the rank in
    it; planned with the rank's block table and the global cu_seqlens_q and seq_lens), its q
    (all T query rows: every rank scores every token) and its k_cache. One
    ``all_gather_into_tensor`` of each rank's [2, T, H, topk] float32 buffer (scores and the page
    ids' bits), then ``merge_candidates`` where the plan runs (host, or its CUDA device)."""
    torch = torch_module()
    if torch is None:
        raise Error("msaidx.distributed needs torch (torch.distributed): import torch first")
    dist = torch.distributed
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (plan.cp_world, plan.cp_rank) != (world, rank):
        raise Error(f"plan: cp_world = {plan.cp_world}, cp_rank = {plan.cp_rank}; the process "
                    f"group has world size {world} and this rank is {rank}")
    topk, init_blocks, local_blocks = topk_params(topk, init_blocks, local_blocks)
    require_array("q", q)
    if len(q.shape) != 3:
        raise Error(f"q: must be [T, H, 128] (shape {tuple(q.shape)})")
    # The rank's candidates go straight into the buffer the collective sends, [scores | page
    # bits], with no copy: numpy on the host beside numpy q, else a tensor on q's device.
    rows = (q.shape[0], plan.num_heads, topk)
    if isinstance(q, np.ndarray):
        host = np.empty((2,) + rows, np.float32)
        plan.prefill_topk_candidates(q, k_cache, topk, out=(host[0], host[1].view(np.int32)))
        local = torch.from_numpy(host)
    else:
        local = torch.empty((2,) + rows, dtype=torch.float32, device=q.device)
        plan.prefill_topk_candidates(q, k_cache, topk,
                                     out=(local[0], local[1].view(torch.int32)))
    # Ranks concatenated along dim 0: the output layout every process group takes (gloo
    # refuses a stacked [W, ...] one).
    gathered = local.new_empty((world * 2,) + rows)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view((world,) + tuple(local.shape))
    nvp = torch.as_tensor(plan.nvp, device=gathered.device)
    return merge_candidates(gathered[:, 0], gathered[:, 1].view(torch.int32), nvp, topk,
                            init_blocks, local_blocks, out)
