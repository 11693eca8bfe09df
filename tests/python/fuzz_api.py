"""Random hostile calls into the Python API on host arrays (the cpu backend): numpy arrays, and
where torch is installed, in 40 % of the scenarios torch CPU tensors over the same memory.

Each scenario builds a valid call (scores, top-k, nvp, index preparation, the context-parallel
merge, a Plan's prefill_topk, or a conversion), runs it, then runs it again four times with one
thing changed: an argument, the layout of one or two arrays, or an output placed over an input.
Every array argument lives inside a larger buffer of poison bytes. The rules checked, from
SPEC.md section 10 and the module docstrings:
- a call returns or raises msaidx.Error; any other exception, and any crash, is a finding;
- it never writes outside its outputs' elements, nor into its inputs or a read-only output
  (every byte of an input's buffer, and of an output's buffer around its elements, is compared
  after the call), and a module function refuses an output over one of its inputs;
- a call whose arrays hold the valid call's values in another layout (strided with gaps,
  axis 0 reversed, Fortran order, misaligned, inside padding) either raises msaidx.Error or gives
  the valid call's outputs bit for bit;
- a Plan that refused or ran a changed call still gives the valid call's outputs afterwards.

With --device cuda (torch and a CUDA device needed) every array is a torch CUDA tensor placed in
a poisoned CUDA buffer the same way (no reversed layouts, which torch cannot express; misaligned
means offset by whole elements), the calls run on the CUDA backends, and the conversions (numpy
functions) are left out. Run it under `compute-sanitizer --tool memcheck` with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that each buffer is an allocation of its own, to catch
accesses past the buffers as well.

usage: PYTHONPATH=python python3 tests/python/fuzz_api.py [--seconds 30] [--seed N]
       [--device cpu|cuda]
(tests/python/test_fuzz_api.py runs it in a subprocess, so that a crash fails the test with the
seed that reproduces it.)
"""

import argparse
import faulthandler
import functools
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batches  # noqa: E402

import msaidx  # noqa: E402
from msaidx import distributed  # noqa: E402

try:  # with torch present, some scenarios pass torch CPU tensors over the same memory
    import torch
except ImportError:
    torch = None

POISON = 0xA5
PAD = 64
LAYOUTS = ("contiguous", "strided", "reversed", "fortran", "misaligned")
DTYPES = (np.uint8, np.uint16, np.int32, np.int64, np.float32, np.float64, np.float16, np.bool_)
HOSTILE_SCALARS = (None, -1, 0, 1, 3, 17, 2**31, -2**31, 2**63, 1.5, float("nan"), float("inf"),
                   "x", True, [1], np.int64(2), np.float32(2.0))
HOSTILE_INTS = (-1, -2, -2**31, 2**31 - 1, 2**31, 2**62)


DEVICE = "cpu"  # --device: where the arrays live and the calls run


class Skip(Exception):
    """A call torch cannot express (negative strides, a read-only array, a misaligned view)."""


def torch_dtype(dtype):
    """The torch dtype torch callers use for a numpy dtype's bytes: BF16 bits as torch.bfloat16,
    an index_prepare error word as torch.int32."""
    retyped = {np.dtype(np.uint16): torch.bfloat16, np.dtype(np.uint32): torch.int32}
    return retyped.get(np.dtype(dtype), torch.from_numpy(np.zeros(0, dtype)).dtype)


class Placed:
    """An array argument: its values in a chosen layout inside a poisoned byte buffer (a CUDA
    buffer with --device cuda, whose view is then a torch CUDA tensor)."""

    def __init__(self, values, layout, rng):
        values = np.asarray(values)
        if DEVICE == "cuda" and (layout == "reversed" or not values.flags.writeable):
            raise Skip()
        self.shape, self.dtype = values.shape, values.dtype
        item = values.dtype.itemsize
        ndim = values.ndim
        steps = [1] * ndim
        if layout == "strided" and ndim:  # mostly rows apart (slices of a larger array)
            steps = [int(rng.integers(1, 4)) if axis == 0 or rng.random() < 0.3 else 1
                     for axis in range(ndim)]
        order = list(range(ndim))[::-1] if layout == "fortran" else list(range(ndim))
        strides, step = [0] * ndim, item
        for axis in reversed(order):  # the innermost axis of the order first
            strides[axis] = step * steps[axis]
            step *= max(self.shape[axis], 1) * steps[axis]
        span = step if values.size else item
        misalign = int(rng.integers(1, 16)) if layout == "misaligned" else 0
        if DEVICE == "cuda":  # torch views start on a whole element
            misalign = -(-misalign // item) * item
            span = -(-span // item) * item
        self.raw = np.full(span + 2 * PAD + misalign, POISON, np.uint8)
        offset = PAD + misalign
        if layout == "reversed" and ndim and values.size and self.shape[0] > 1:
            offset += (self.shape[0] - 1) * strides[0]
            strides[0] = -strides[0]
        self.offset, self.strides = offset, tuple(strides)
        self.view = self._view_of(self.raw)
        self.view[...] = values
        self.view.flags.writeable = self.writeable = values.flags.writeable
        self.pristine = self.raw.copy()
        if DEVICE == "cuda":
            self.device_raw = torch.from_numpy(self.raw).cuda()
            self.view = self.device_view(self.offset)

    def device_view(self, offset):
        """A torch view of this placement's shape and strides at `offset` bytes into the CUDA
        buffer."""
        item = self.dtype.itemsize
        typed = self.device_raw.view(torch_dtype(self.dtype))
        return torch.as_strided(typed, self.shape, [s // item for s in self.strides],
                                offset // item)

    def _view_of(self, raw):
        return np.ndarray(self.shape, self.dtype, buffer=raw, offset=self.offset,
                          strides=self.strides)

    def host_raw(self):
        return self.device_raw.cpu().numpy() if DEVICE == "cuda" else self.raw

    def untouched_outside(self):
        """True when no byte outside the view's elements changed."""
        now, before = self.host_raw().copy(), self.pristine.copy()
        self._view_of(now)[...] = 0
        self._view_of(before)[...] = 0
        return np.array_equal(now, before)

    def untouched(self):
        return np.array_equal(self.host_raw(), self.pristine)


class Finding(Exception):
    pass


def small_batch(rng):
    fmt = str(rng.choice(["e4m3", "bf16"]))
    shape = batches.random_shape(rng, decode=rng.random() < 0.3, max_prefill=12, max_prefix=300)
    return batches.make_batch(rng, fmt, int(rng.choice([1, 2, 4])), **shape)


def scores_call(rng):
    b = small_batch(rng)
    pitch = b.largest_nvp() + int(rng.integers(0, 3))
    entry = msaidx.decode_scores if rng.random() < 0.3 else msaidx.prefill_scores
    arrays = dict(q=b.q, k_cache=b.k_cache, block_table=b.block_table, cu_seqlens_q=b.cu_seqlens_q,
                  seq_lens=b.seq_lens,
                  out=np.full((b.num_tokens, b.num_heads, pitch), -np.inf, np.float32))
    scalars = dict(backend=backend(rng), pitch=pitch,
                   precision=str(rng.choice(["default", "exact"])))
    return entry, arrays, scalars, ("out",)


def backend(rng):
    """A backend of the arrays' device: cpu, or any CUDA backend (auto picks persistent where it
    is admitted, else dense)."""
    return "cpu" if DEVICE == "cpu" else str(rng.choice(["auto", "dense", "split"]))


def forced_pages(rng, topk):
    """init_blocks and local_blocks of a valid call: at most topk together."""
    init = int(rng.integers(0, min(topk, 2) + 1))
    return dict(init_blocks=init, local_blocks=int(rng.integers(0, min(topk - init, 2) + 1)))


def topk_call(rng):
    b = small_batch(rng)
    pitch = b.largest_nvp() + int(rng.integers(0, 3))
    scores = msaidx.prefill_scores(*b.args(), backend="cpu", pitch=pitch)
    if rng.random() < 0.3:
        scores[rng.random(scores.shape) < 0.2] = rng.choice([np.nan, -np.inf, np.inf])
    topk = int(rng.integers(1, 20))
    arrays = dict(scores=scores, nvp=b.nvp().astype(np.int32),
                  out=np.zeros((b.num_tokens, b.num_heads, topk), np.int32))
    scalars = dict(topk=topk, **forced_pages(rng, topk))
    return msaidx.topk_select, arrays, scalars, ("out",)


def nvp_call(rng):
    b = small_batch(rng)
    arrays = dict(cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens,
                  out=np.zeros(b.num_tokens, np.int32))
    return msaidx.num_valid_pages, arrays, dict(page_size=128, num_tokens=b.num_tokens), ("out",)


def prepare_call(rng):
    T, H = int(rng.integers(0, 24)), int(rng.choice([1, 2, 4]))
    fmt = str(rng.choice(["e4m3", "bf16"]))
    pages = int(rng.integers(1, 3))
    bits = lambda shape: batches.oracle.bf16_encode(  # noqa: E731
        rng.standard_normal(shape).astype(np.float32))
    slots = np.full(T, -1, np.int64)
    chosen = rng.permutation(pages * 128)[:T]
    keep = rng.random(T) < 0.8
    slots[keep] = chosen[keep]
    arrays = dict(q_in=bits((T, H, 128)), k_in=bits((T, 128)),
                  positions=rng.integers(0, 64, size=T).astype(np.int64),
                  q_norm_weight=bits(128), k_norm_weight=bits(128), slot_mapping=slots,
                  k_cache=np.zeros((pages, 128, 128), batches.STORAGE[fmt]),
                  q_out=np.zeros((T, H, 128), batches.STORAGE[fmt]))
    outputs = ("k_cache", "q_out")
    if rng.random() < 0.3:  # bad tokens are recorded in it
        arrays["error_word"] = np.zeros(1, rng.choice([np.uint32, np.int32]))
        outputs += ("error_word",)
    scalars = dict(eps=1e-6)
    if rng.random() < 0.5:
        angles = rng.uniform(-np.pi, np.pi, size=(64, 32))
        arrays["cos_sin_cache"] = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(
            np.float32)
    else:
        scalars.update(cos_sin_cache=None, rope_theta=5e6, max_position=64)
    return msaidx.index_prepare, arrays, scalars, outputs


def merge_call(rng):
    W, T, H, topk = (int(rng.integers(1, 4)), int(rng.integers(0, 10)), int(rng.choice([1, 2])),
                     int(rng.integers(1, 18)))
    nvp = rng.integers(0, 40, size=T).astype(np.int32)
    pages = np.full((W, T, H, topk), -1, np.int32)
    scores = rng.standard_normal((W, T, H, topk)).astype(np.float32)
    for t in range(T):
        owned = rng.permutation(int(nvp[t]))
        for w in range(W):
            mine = owned[w::W][:topk]
            for h in range(H):
                pages[w, t, h, :mine.size] = np.sort(mine)
    scores[pages < 0] = -np.inf
    arrays = dict(candidate_scores=scores, candidate_pages=pages, nvp=nvp,
                  out=np.zeros((T, H, topk), np.int32))
    scalars = dict(topk=topk, **forced_pages(rng, topk))
    return distributed.merge_candidates, arrays, scalars, ("out",)


class PlanCall:
    """A cpu Plan planned on a valid batch; each call plans the given metadata and runs
    prefill_topk. The same Plan runs the valid call, the changed one, then the valid one again."""

    def __init__(self, b, pitch, rng):
        self.plan = msaidx.Plan(b.num_heads, dtype=b.fmt, backend=backend(rng), device=DEVICE,
                                max_batch=len(b.seq_lens) + int(rng.integers(0, 2)),
                                max_tokens=b.num_tokens + int(rng.integers(0, 4)), pitch=pitch)

    def __call__(self, q, k_cache, block_table, cu_seqlens_q, seq_lens, scores_out, out, topk,
                 init_blocks, local_blocks, num_tokens, max_seq_len):
        self.plan.plan(block_table, cu_seqlens_q, seq_lens, num_tokens=num_tokens,
                       max_seq_len=max_seq_len)
        return self.plan.prefill_topk(q, k_cache, topk, init_blocks, local_blocks,
                                      scores_out=scores_out, out=out)


def plan_call(rng):
    b = small_batch(rng)
    # Now and then a pitch far past the batch's pages, as engines size it: the forward's
    # max_seq_len then bounds the rows of a call without scores_out.
    pitch = b.largest_nvp() + int(rng.integers(0, 3)) + (40 if rng.random() < 0.3 else 0)
    topk = int(rng.integers(1, 20))
    with_scores = rng.random() < 0.5
    arrays = dict(q=b.q, k_cache=b.k_cache, block_table=b.block_table,
                  cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens,
                  scores_out=np.full((b.num_tokens, b.num_heads, pitch), -np.inf, np.float32)
                  if with_scores else None,
                  out=np.zeros((b.num_tokens, b.num_heads, topk), np.int32))
    longest = int(b.seq_lens.max()) if b.seq_lens.size else 0
    scalars = dict(topk=topk, num_tokens=b.num_tokens,
                   max_seq_len=int(rng.integers(longest, pitch * 128 + 1)),
                   **forced_pages(rng, topk))
    outputs = ("scores_out", "out") if with_scores else ("out",)
    return PlanCall(b, pitch, rng), arrays, scalars, outputs


def convert_call(rng):
    shape = tuple(int(n) for n in rng.integers(0, 6, size=int(rng.integers(0, 4))))
    values = np.asarray(rng.standard_normal(shape) * 10.0 ** float(rng.integers(-3, 4)))
    fn, name, array = [
        (msaidx.e4m3_from_float, "x", values.astype(np.float32)),
        (msaidx.bf16_from_float, "x", values.astype(np.float32)),
        (msaidx.e4m3_to_float, "b", rng.integers(0, 256, size=shape).astype(np.uint8)),
        (msaidx.bf16_to_float, "b", rng.integers(0, 65536, size=shape).astype(np.uint16)),
    ][int(rng.integers(0, 4))]
    return fn, {name: np.asarray(array)}, {}, ()


CALLS = (scores_call, topk_call, nvp_call, prepare_call, merge_call, plan_call, convert_call)


def as_torch(value):
    """A torch CPU tensor over a numpy array's memory, in torch_dtype."""
    if not isinstance(value, np.ndarray):
        return value
    if any(stride < 0 for stride in value.strides) or not value.flags.writeable:
        raise Skip()
    return torch.from_numpy(value).view(torch_dtype(value.dtype))


def as_bytes(value):
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.cpu()
        value = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy()
    return np.ascontiguousarray(value).tobytes()


def run(fn, arrays, scalars, outputs, layouts, rng, stats, alias=None, use_torch=False):
    """One call with every array placed; returns the outputs' bytes, or None when refused.
    alias = (output, input): the output's view starts at the input's first byte instead.
    use_torch: the arrays are passed as torch CPU tensors over the same memory."""
    try:
        placed = {name: Placed(value, layouts.get(name, "contiguous"), rng)
                  for name, value in arrays.items() if isinstance(value, np.ndarray)}
    except Skip:
        stats["skipped"] += 1
        return None
    kwargs = dict(scalars)
    for name, value in arrays.items():
        kwargs[name] = placed[name].view if name in placed else value
    if alias:
        out, source = placed.pop(alias[0]), placed[alias[1]]
        if DEVICE == "cuda":
            item, count = out.dtype.itemsize, int(np.prod(out.shape))
            if source.offset % item:
                stats["skipped"] += 1
                return None
            start = source.offset
            kwargs[alias[0]] = source.device_raw[start:start + count * item].view(
                torch_dtype(out.dtype)).view(out.shape)
        else:
            kwargs[alias[0]] = np.ndarray(out.shape, out.dtype, buffer=source.raw,
                                          offset=source.offset)
    if use_torch:
        try:
            kwargs = {name: as_torch(value) for name, value in kwargs.items()}
        except Skip:
            stats["skipped"] += 1
            return None
    try:
        result = fn(**kwargs)
        refused = False
    except msaidx.Error as error:
        result, refused = None, True
        stats["last refusal"] = str(error)
    except Exception as error:  # noqa: BLE001: any other exception is the finding
        raise Finding(f"{type(error).__name__} (not msaidx.Error): {error}\n"
                      f"{traceback.format_exc(limit=4)}")
    for name, p in placed.items():
        if name in outputs and p.writeable:
            if not p.untouched_outside():
                raise Finding(f"{name}: bytes outside its elements changed")
        elif not p.untouched():
            raise Finding(f"{name}: {'a read-only output' if name in outputs else 'an input'} "
                          "changed")
    stats["refused" if refused else "ran"] += 1
    if refused:
        return None
    values = {name: as_bytes(placed[name].view) for name in outputs if name in placed}
    if isinstance(result, np.ndarray) or (torch is not None and isinstance(result, torch.Tensor)):
        values["(returned)"] = as_bytes(result)
    return values


def hostile(rng, arrays, scalars, outputs):
    """One argument changed: (arrays, scalars, what was done)."""
    arrays, scalars = dict(arrays), dict(scalars)
    names = [n for n, v in arrays.items() if isinstance(v, np.ndarray)]
    kind = rng.integers(0, 7)
    if kind == 0 or not names:
        name = str(rng.choice(sorted(scalars))) if scalars else None
        if name is None:
            return arrays, scalars, "nothing"
        scalars[name] = HOSTILE_SCALARS[int(rng.integers(0, len(HOSTILE_SCALARS)))]
        return arrays, scalars, f"{name} = {scalars[name]!r}"
    name = str(rng.choice(names))
    value = arrays[name]
    if kind == 1:
        dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
        arrays[name] = value.astype(dtype)
        return arrays, scalars, f"{name} as {np.dtype(dtype).name}"
    if kind == 2 and value.ndim:
        axis = int(rng.integers(0, value.ndim))
        grow = rng.random() < 0.5
        if grow:
            widths = [(0, 0)] * value.ndim
            widths[axis] = (0, 1)
            arrays[name] = np.pad(value, widths)
        else:
            arrays[name] = np.delete(value, slice(value.shape[axis] - 1, None), axis=axis)
        return arrays, scalars, f"{name} axis {axis} {'grown' if grow else 'shrunk'}"
    if kind == 3:
        arrays[name] = value[None] if rng.random() < 0.5 else value.reshape(-1)
        return arrays, scalars, f"{name} reshaped to {arrays[name].shape}"
    if kind == 4 and value.size and value.dtype.kind in "iu":
        poked = value.copy()
        poked.reshape(-1)[int(rng.integers(0, value.size))] = np.array(
            HOSTILE_INTS[int(rng.integers(0, len(HOSTILE_INTS)))]).astype(value.dtype)
        arrays[name] = poked
        return arrays, scalars, f"{name}: one element poked"
    if kind == 5 and name in outputs:
        view = value.copy()
        view.flags.writeable = False
        arrays[name] = view
        return arrays, scalars, f"{name} read-only"
    replacement = (None, 3, 2.5, "x", [0, 1], value.tolist())[int(rng.integers(0, 6))]
    arrays[name] = replacement
    return arrays, scalars, f"{name} replaced by a {type(replacement).__name__}"


def scenario(rng, stats):
    calls = CALLS if DEVICE == "cpu" else tuple(c for c in CALLS if c is not convert_call)
    make = calls[int(rng.integers(0, len(calls)))]
    fn, arrays, scalars, outputs = make(rng)
    # numpy arrays, or (the conversions aside: numpy functions) torch CPU tensors over them; on
    # the device, torch CUDA tensors always (Placed)
    use_torch = (DEVICE == "cpu" and torch is not None and make is not convert_call
                 and rng.random() < 0.4)
    call = functools.partial(run, use_torch=use_torch)
    valid = call(fn, arrays, scalars, outputs, {}, rng, stats)
    if valid is None:
        raise Finding(f"{make.__name__}: the valid call was refused: {stats['last refusal']}")
    for _ in range(4):
        if rng.random() < 0.5:
            names = [n for n, v in arrays.items() if isinstance(v, np.ndarray)]
            layouts = {str(rng.choice(names)): LAYOUTS[int(rng.integers(0, len(LAYOUTS)))]
                       for _ in range(1 + (rng.random() < 0.3))}
            try:
                got = call(fn, arrays, scalars, outputs, layouts, rng, stats)
            except Finding as finding:
                raise Finding(f"{make.__name__} with layouts {layouts}: {finding}")
            if got is not None:
                stats["compared"] += 1
                if got != valid:
                    raise Finding(f"{make.__name__} with layouts {layouts}: outputs differ from "
                                  "the valid call's")
            what = f"layouts {layouts}"
        elif outputs and rng.random() < 0.1:
            # An output over an input's bytes: every call (Plan too) refuses overlapping outputs.
            output = str(rng.choice(outputs))
            # (merge_candidates may write over candidate_pages itself: its in-place merge)
            inputs = [n for n, v in arrays.items()
                      if isinstance(v, np.ndarray) and n not in outputs and v.size
                      and (n, output) != ("candidate_pages", "out")]
            source = str(rng.choice(inputs)) if inputs else None
            if source is None or arrays[output].nbytes > arrays[source].nbytes + PAD:
                continue
            what = f"{output} over {source}'s bytes"
            try:
                got = call(fn, arrays, scalars, outputs, {}, rng, stats, (output, source))
            except Finding as finding:
                raise Finding(f"{make.__name__}, {what}: {finding}")
            if got is not None and arrays[output].size:
                raise Finding(f"{make.__name__}, {what}: ran")
        else:
            changed_arrays, changed_scalars, what = hostile(rng, arrays, scalars, outputs)
            try:
                call(fn, changed_arrays, changed_scalars, outputs, {}, rng, stats)
            except Finding as finding:
                raise Finding(f"{make.__name__}, {what}: {finding}")
        if isinstance(fn, PlanCall) and call(fn, arrays, scalars, outputs, {}, rng, stats) != valid:
            raise Finding(f"plan_call after {what}: the valid call's outputs changed")
    stats["scenarios"] += 1
    stats["torch"] += use_torch or DEVICE == "cuda"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    options = parser.parse_args()
    global DEVICE
    DEVICE = options.device
    if DEVICE == "cuda" and (torch is None or not torch.cuda.is_available()):
        print("fuzz_api.py: --device cuda needs torch with a CUDA device", flush=True)
        return 2
    seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(6), "little")
    faulthandler.enable()
    print(f"fuzz_api.py: seed {seed}", flush=True)
    rng = np.random.default_rng(seed)
    stats = dict(scenarios=0, ran=0, refused=0, compared=0, skipped=0, torch=0)
    end = time.monotonic() + options.seconds
    findings = 0
    while time.monotonic() < end:
        try:
            scenario(rng, stats)
        except Finding as finding:
            findings += 1
            print(f"FINDING: {finding}", flush=True)
            if findings >= 5:
                break
    print(f"fuzz_api.py: seed {seed}: {stats['scenarios']} scenarios, {stats['ran']} calls ran, "
          f"{stats['refused']} refused with msaidx.Error, {stats['compared']} in other layouts "
          f"compared with the valid call; {stats['torch']} scenarios with torch "
          f"{'CUDA' if DEVICE == 'cuda' else 'CPU'} tensors; {stats['skipped']} calls torch "
          "cannot express; "
          f"{findings} findings", flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
