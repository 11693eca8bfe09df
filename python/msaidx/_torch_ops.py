"""torch.ops.msaidx: the module functions and the Plan methods as torch custom ops.

Each op writes the caller's ``out`` (declared in mutates_args) and returns nothing; its fake
(meta) implementation does nothing, so torch.compile(fullgraph=True) traces a call without running
it. Outside tracing the Python functions call the library directly: the dispatcher's cost stays
off the eager per-layer path. torch is never imported here; the ops are registered when msaidx is
imported after torch, when a Plan is made, or by the first eager call with a torch tensor (the
tracer cannot register them itself).
"""

import itertools
import threading
import weakref

from ._capi import Error
from ._tensors import torch_module

_ops = None
_register_lock = threading.Lock()

# Plans reachable from the Plan ops by an integer id (a custom op takes no Python objects).
_plans = weakref.WeakValueDictionary()
_plan_ids = itertools.count(1)


def register_plan(plan):
    register_if_torch_loaded()
    plan_id = next(_plan_ids)
    _plans[plan_id] = plan
    return plan_id


def tracing(value):
    """Whether `value` is a torch tensor seen by torch.compile's tracer. An eager call with a torch
    tensor registers the ops, so that a later torch.compile finds them: the tracer cannot run the
    registration itself (it takes a lock and defines ops)."""
    torch = torch_module()
    if torch is None or not isinstance(value, torch.Tensor):
        return False
    if not torch.compiler.is_compiling():
        if _ops is None:
            ops()
        return False
    if _ops is None:
        raise Error("msaidx: torch.ops.msaidx is not registered yet: import torch before msaidx, "
                    "or call msaidx.register_torch_ops() (or any msaidx function eagerly) before "
                    "torch.compile")
    return True


def optional(value):
    return None if value is None else int(value)


def precision_arg(precision, fast_accumulation):
    """The module functions' two accumulation keywords as one string argument of the op
    ("" = neither given: the default precision)."""
    if precision is not None:
        return str(precision) + ("!" if fast_accumulation is not None else "")
    if fast_accumulation is None:
        return ""
    return "default" if fast_accumulation else "exact"


def _precision_kwargs(arg):
    if arg == "":
        return None, None
    if arg.endswith("!"):  # both given: let the eager path raise its error
        return arg[:-1], False
    return arg, None


def new_scores(q, pitch):
    torch = torch_module()
    pitch = 8192 if pitch is None else int(pitch)
    return torch.full((q.shape[0], q.shape[1], pitch), float("-inf"), dtype=torch.float32,
                      device=q.device)


def new_int32(like, shape):
    torch = torch_module()
    return torch.empty(shape, dtype=torch.int32, device=like.device)


def register_if_torch_loaded():
    if torch_module() is not None:
        ops()


def ops():
    """torch.ops.msaidx, registering the ops on first use."""
    global _ops
    if _ops is None:
        with _register_lock:
            if _ops is None:
                _register(torch_module())
                _ops = torch_module().ops.msaidx
    return _ops


def _register(torch):
    from typing import Optional

    import msaidx
    from torch import Tensor

    @torch.library.custom_op("msaidx::scores", mutates_args=("out",))
    def scores(entry: str, q: Tensor, k_cache: Tensor, block_table: Tensor,
               cu_seqlens_q: Tensor, seq_lens: Tensor, backend: str, pitch: Optional[int],
               out: Tensor, check: bool, max_q_len: Optional[int], max_seq_len: Optional[int],
               precision: str) -> None:
        precision, fast = _precision_kwargs(precision)
        msaidx._scores(entry, q, k_cache, block_table, cu_seqlens_q, seq_lens, backend, pitch,
                       out, check, max_q_len, max_seq_len, precision, fast)

    @torch.library.custom_op("msaidx::num_valid_pages", mutates_args=("out",))
    def num_valid_pages(cu_seqlens_q: Tensor, seq_lens: Tensor, page_size: int,
                        out: Tensor) -> None:
        msaidx.num_valid_pages(cu_seqlens_q, seq_lens, page_size, out.shape[0], out)

    @torch.library.custom_op("msaidx::topk_select", mutates_args=("out",))
    def topk_select(scores: Tensor, nvp: Tensor, topk: int, init_blocks: int,
                    local_blocks: int, out: Tensor) -> None:
        msaidx.topk_select(scores, nvp, topk, init_blocks, local_blocks, out)

    # The Plan's ops. `nvp` is the plan's own buffer: written by plan_batch and read by the layer
    # ops, it orders them in the traced graph.
    @torch.library.custom_op("msaidx::plan_batch", mutates_args=("nvp",))
    def plan_batch(plan: int, block_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                   num_tokens: int, max_seq_len: int, nvp: Tensor) -> None:
        owner = _plans[plan]
        owner._plan(block_table, cu_seqlens_q, seq_lens, num_tokens, max_seq_len)
        # A functionalizing backend (aot_eager) hands the op a copy of the plan's buffer and
        # copies it back after the graph: it must hold what the plan wrote.
        if nvp.data_ptr() != owner._nvp_tensor.data_ptr():
            nvp.copy_(owner._nvp_tensor)

    @torch.library.custom_op("msaidx::plan_scores", mutates_args=("out",))
    def plan_scores(plan: int, decode: bool, q: Tensor, k_cache: Tensor, nvp: Tensor,
                    out: Tensor) -> None:
        _plans[plan]._scores(decode, q, k_cache, out)

    @torch.library.custom_op("msaidx::plan_topk", mutates_args=("out",))
    def plan_topk(plan: int, scores: Tensor, nvp: Tensor, topk: int, init_blocks: int,
                  local_blocks: int, out: Tensor) -> None:
        _plans[plan]._topk(scores, topk, init_blocks, local_blocks, out)

    @torch.library.custom_op("msaidx::plan_prefill_topk", mutates_args=("scores_out", "out"))
    def plan_prefill_topk(plan: int, q: Tensor, k_cache: Tensor, nvp: Tensor, topk: int,
                          init_blocks: int, local_blocks: int, scores_out: Optional[Tensor],
                          out: Tensor) -> None:
        _plans[plan]._prefill_topk(q, k_cache, topk, init_blocks, local_blocks, scores_out, out,
                                   None)

    @torch.library.custom_op("msaidx::plan_prefill_topk_candidates",
                             mutates_args=("scores_out", "candidate_scores", "pages"))
    def plan_prefill_topk_candidates(plan: int, q: Tensor, k_cache: Tensor, nvp: Tensor,
                                     topk: int, scores_out: Optional[Tensor],
                                     candidate_scores: Tensor, pages: Tensor) -> None:
        _plans[plan]._prefill_topk(q, k_cache, topk, 0, 0, scores_out, pages, candidate_scores)

    @torch.library.custom_op("msaidx::index_prepare",
                             mutates_args=("k_cache", "q_out", "error_word"))
    def index_prepare(q_in: Tensor, k_in: Tensor, positions: Tensor, q_norm_weight: Tensor,
                      k_norm_weight: Tensor, cos_sin_cache: Optional[Tensor],
                      slot_mapping: Tensor, k_cache: Tensor, q_out: Tensor, eps: float,
                      error_word: Optional[Tensor], check: bool, rope_theta: float,
                      max_position: int) -> None:
        # rope_theta 0: the table's call (cos_sin_cache given, max_position unused)
        theta = rope_theta if cos_sin_cache is None else None
        msaidx.index_prepare(q_in, k_in, positions, q_norm_weight, k_norm_weight, cos_sin_cache,
                             slot_mapping, k_cache, q_out, eps, error_word=error_word,
                             check=check, rope_theta=theta,
                             max_position=max_position if theta is not None else None)

    for op in (scores, num_valid_pages, topk_select, plan_batch, plan_scores, plan_topk,
               plan_prefill_topk, plan_prefill_topk_candidates, index_prepare):
        op.register_fake(_writes_out_only)


def _writes_out_only(*args, **kwargs):
    return None
