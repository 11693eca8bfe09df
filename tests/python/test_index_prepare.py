"""msaidx.index_prepare (SPEC.md section 11) against an FP64 numpy evaluation written from the
spec: numpy arrays on the cpu backend, and torch CUDA tensors against the cpu backend when torch
and a device are present. Each element must be the FP64 value's rounding to the output format or
one step of it away (or, rarely, within the FP32 evaluation's error where RoPE cancels)."""

import re

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle

DIM = 128
PAGE = 128


def bf16_bits(x):
    """float64 -> BF16 bits, round to nearest even, through the oracle's float32 encoder after
    rounding to 8 significant bits in float64 (so no double rounding)."""
    return oracle.bf16_encode(round_bf16(np.asarray(x, dtype=np.float64)).astype(np.float32))


def round_bf16(v):
    """float64 values rounded to BF16's 8 significant bits, ties to even (normal range)."""
    magnitude = np.abs(v)
    _, exponent = np.frexp(magnitude)
    step = np.ldexp(1.0, np.maximum(exponent - 8, -133))
    return np.copysign(np.rint(magnitude / step) * step, v)


def rounded_ordinal(v, fmt):
    """Signed position on the format's number line of the FP64 value's rounding."""
    magnitude = np.abs(v)
    if fmt == "bf16":
        position = (round_bf16(magnitude).astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
    else:
        ladder = oracle.e4m3_decode(np.arange(0x7F))  # codes 0x00..0x7E, increasing
        below = np.clip(np.searchsorted(ladder, magnitude, side="right") - 1, 0, 0x7D)
        low, high = ladder[below], ladder[below + 1]
        midpoint = (low + high) / 2
        up = (magnitude > midpoint) | ((magnitude == midpoint) & (below % 2 == 1))
        position = np.where(magnitude >= 448.0, 0x7E, below + up)
    return np.where(np.signbit(v), -position, position)


def stored_ordinal(codes, fmt):
    c = np.asarray(codes).astype(np.int64)
    magnitude = c & (0x7FFF if fmt == "bf16" else 0x7F)
    sign = c & (0x8000 if fmt == "bf16" else 0x80)
    return np.where(sign != 0, -magnitude, magnitude)


def stored_value(codes, fmt):
    return oracle.bf16_decode(codes) if fmt == "bf16" else oracle.e4m3_decode(codes)


def reference(x_bits, w_bits, cos, sin, eps=1e-6):
    """Steps 1-3 in float64 for vectors [..., 128]; also the magnitude of the terms per output."""
    x = oracle.bf16_decode(x_bits)
    w = oracle.bf16_decode(w_bits)
    inverse_rms = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True) / DIM + np.float64(np.float32(eps)))
    y = x * inverse_rms * (1.0 + w)
    first, second = y[..., :32], y[..., 32:64]
    out = y.copy()
    out[..., :32] = first * cos - second * sin
    out[..., 32:64] = second * cos + first * sin
    magnitude = np.abs(y)
    terms = np.abs(first * cos) + np.abs(second * sin)
    magnitude[..., :32] = terms
    magnitude[..., 32:64] = np.abs(second * cos) + np.abs(first * sin)
    return out, magnitude


def ordinal_value(ordinal, fmt):
    """The value at a signed position of stored_ordinal / rounded_ordinal."""
    position = np.abs(ordinal)
    sign = np.where(ordinal < 0, 0x8000 if fmt == "bf16" else 0x80, 0)
    codes = (position | sign).astype(np.uint16 if fmt == "bf16" else np.uint8)
    return stored_value(codes, fmt)


def judge(stored, ref, magnitude, fmt):
    """Elements that are not the FP64 value's rounding, allowing for the FP32 evaluation's error
    (2^-20 of the terms): one step away only where the FP64 value lies within that error of the
    boundary between the two steps; any distance where the stored value is that close to it."""
    got, want = stored_ordinal(stored, fmt), rounded_ordinal(ref, fmt)
    fp32_error = np.ldexp(magnitude, -20)
    boundary = (ordinal_value(got, fmt) + ordinal_value(want, fmt)) / 2
    near = (got == want) | ((np.abs(got - want) == 1) & (np.abs(ref - boundary) <= fp32_error))
    cancellation = np.abs(stored_value(stored, fmt) - ref) <= fp32_error
    bad = ~(near | cancellation)
    if fmt == "e4m3":
        bad |= (np.asarray(stored) & 0x7F) == 0x7F  # NaN codes
    return int(bad.sum())


class Case:
    """A random batch: q_in and k_in sliced from one fused projection, distinct slots with -1."""

    def __init__(self, rng, num_tokens, num_heads, fmt, table, saturate=False, num_pages=3,
                 max_position=2048, page_pad=16):
        """table: "float32" or "bf16" (a cos/sin table of max_position rows), or "theta" (none:
        the call computes the angles, positions anywhere below 2^24, a random theta)."""
        self.fmt, self.num_heads = fmt, num_heads
        width = num_heads * DIM + DIM + 64
        scales = np.exp(rng.uniform(-4, 4, size=(num_tokens, 1)))
        self.projection = bf16_bits(rng.standard_normal((num_tokens, width)) * scales)
        self.q_in = self.projection[:, :num_heads * DIM].reshape(num_tokens, num_heads, DIM)
        self.k_in = self.projection[:, num_heads * DIM:num_heads * DIM + DIM]
        assert num_tokens == 0 or np.shares_memory(self.q_in, self.projection)  # views
        big = rng.uniform(300, 600, size=DIM) if saturate else 0.0
        self.q_weight = bf16_bits(big + 0.5 * rng.standard_normal(DIM))
        self.k_weight = bf16_bits(big + 0.5 * rng.standard_normal(DIM))
        if table == "theta":
            self.theta = float(rng.choice([5e6, 1e4, np.exp(rng.uniform(0, 18))]))
            self.cos_sin, max_position = None, msaidx.ROPE_THETA_MAX_POSITION
        else:
            self.theta = None
            angles = np.arange(max_position)[:, None] * self.inverse_frequencies(5e6)
            full = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
            self.cos_sin = full.astype(np.float32) if table == "float32" else bf16_bits(full)
            self.table_values = (full.astype(np.float32).astype(np.float64)
                                 if table == "float32" else oracle.bf16_decode(self.cos_sin))
        self.max_position = max_position
        self.positions = rng.integers(0, max_position, size=num_tokens).astype(np.int64)
        slots = rng.permutation(num_pages * PAGE)[:num_tokens]
        self.slots = np.full(num_tokens, -1, dtype=np.int64)
        self.slots[:len(slots)] = slots
        self.slots[rng.random(num_tokens) < 0.1] = -1
        elem = 1 if fmt == "e4m3" else 2
        dtype = np.uint8 if fmt == "e4m3" else np.uint16
        padded = PAGE * DIM + page_pad // elem  # page stride padded by page_pad bytes
        self.poison = 0xA5 if fmt == "e4m3" else 0xA5A5  # the same bytes in both formats
        self.cache_base = np.full((num_pages, padded), self.poison, dtype=dtype)
        self.k_cache = self.cache_base[:, :PAGE * DIM].reshape(num_pages, PAGE, DIM)
        assert np.shares_memory(self.k_cache, self.cache_base)

    @staticmethod
    def inverse_frequencies(theta):
        return theta ** (-2.0 * np.arange(32) / 64)

    def rows(self, positions):
        """[cos(32) | sin(32)] of each position: the table's values, or FP64 from theta."""
        if self.theta is None:
            return self.table_values[positions]
        angles = positions[:, None].astype(np.float64) * self.inverse_frequencies(self.theta)
        return np.concatenate([np.cos(angles), np.sin(angles)], axis=1)

    def run(self, **options):
        return msaidx.index_prepare(self.q_in, self.k_in, self.positions, self.q_weight,
                                    self.k_weight, self.cos_sin, self.slots, self.k_cache,
                                    rope_theta=self.theta, **options)

    def check(self, q_out, k_cache=None):
        """Wrong elements of q_out and of the keys written into the cache; and that slots no
        good key maps to (and the page padding) kept the poison."""
        k_cache = self.k_cache if k_cache is None else k_cache
        ok_position = (self.positions >= 0) & (self.positions < self.max_position)
        rows = self.rows(np.where(ok_position, self.positions, 0))
        cos, sin = rows[:, None, :32], rows[:, None, 32:]
        ref, magnitude = reference(self.q_in, self.q_weight, cos, sin)
        wrong = judge(q_out[ok_position], ref[ok_position], magnitude[ok_position], self.fmt)
        written = ok_position & (self.slots >= 0) & (self.slots < k_cache.shape[0] * PAGE)
        k_ref, k_magnitude = reference(self.k_in, self.k_weight, cos[:, 0], sin[:, 0])
        slots = self.slots[written]
        keys = k_cache[slots // PAGE, slots % PAGE]
        wrong += judge(keys, k_ref[written], k_magnitude[written], self.fmt)
        untouched = np.ones(k_cache.shape[:2], dtype=bool)
        untouched[slots // PAGE, slots % PAGE] = False
        assert (k_cache[untouched] == self.poison).all(), "a slot no good key maps to was written"
        return wrong


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
@pytest.mark.parametrize("table", ["float32", "bf16", "theta"])
@pytest.mark.parametrize("saturate", [False, True])
def test_against_fp64(rng, num_heads, fmt, table, saturate):
    case = Case(rng, int(rng.integers(1, 300)), num_heads, fmt, table, saturate)
    q_out = case.run()
    assert q_out.shape == (case.q_in.shape[0], num_heads, DIM)
    assert q_out.dtype == case.k_cache.dtype
    assert case.check(q_out) == 0
    padding = case.cache_base[:, PAGE * DIM:]
    assert (padding == case.poison).all(), "page padding was written"
    if saturate and fmt == "e4m3":
        assert ((q_out & 0x7F) == 0x7E).any(), "no element saturated to 448"


def test_bad_slots_and_positions(rng):
    case = Case(rng, 64, 2, "e4m3", "float32")
    case.slots[5] = case.k_cache.shape[0] * PAGE  # one past the cache
    case.slots[9] = -7
    case.positions[20] = len(case.table_values)
    out = np.full((64, 2, DIM), 0xA5, dtype=np.uint8)
    with pytest.raises(msaidx.Error, match=r"slot_mapping\[5\]"):
        msaidx.index_prepare(case.q_in, case.k_in, case.positions, case.q_weight, case.k_weight,
                             case.cos_sin, case.slots, case.k_cache, q_out=out)
    assert (out[20] == 0xA5).all(), "a token with a bad position was written"
    assert case.check(out) == 0  # every good query and key written, the bad keys not


def test_theta_arguments(rng):
    """Without a table: one of cos_sin_cache and rope_theta, theta >= 1, positions below
    max_position (a bad one is skipped and named, as with a table)."""
    case = Case(rng, 16, 2, "e4m3", "theta")
    table = Case(rng, 16, 2, "e4m3", "float32").cos_sin
    args = [case.q_in, case.k_in, case.positions, case.q_weight, case.k_weight, None,
            case.slots, case.k_cache]
    with pytest.raises(msaidx.Error, match="^cos_sin_cache.*rope_theta"):
        msaidx.index_prepare(*args)
    with pytest.raises(msaidx.Error, match="^rope_theta.*not both"):
        msaidx.index_prepare(*args[:5], table, *args[6:], rope_theta=5e6)
    for theta in (0.5, float("inf"), float("nan"), "5e6", True):
        with pytest.raises(msaidx.Error, match="^rope_theta"):
            msaidx.index_prepare(*args, rope_theta=theta)
    with pytest.raises(msaidx.Error, match="^max_position"):
        msaidx.index_prepare(*args, rope_theta=5e6, max_position=msaidx.ROPE_THETA_MAX_POSITION + 1)
    with pytest.raises(msaidx.Error, match="^max_position.*only without a table"):
        msaidx.index_prepare(*args[:5], table, *args[6:], max_position=10)
    case.max_position = 1000
    case.positions[:] = np.minimum(case.positions, 999)
    case.positions[7] = 1000
    out = np.full((16, 2, DIM), 0xA5, dtype=np.uint8)
    with pytest.raises(msaidx.Error, match=r"positions\[7\] = 1000"):
        case.run(q_out=out, max_position=1000)
    assert (out[7] == 0xA5).all(), "a token with a bad position was written"
    assert case.check(out) == 0


def test_errors_name_the_argument(rng):
    case = Case(rng, 8, 2, "bf16", "float32")
    args = [case.q_in, case.k_in, case.positions, case.q_weight, case.k_weight, case.cos_sin,
            case.slots, case.k_cache]
    names = ["q_in", "k_in", "positions", "q_norm_weight", "k_norm_weight", "cos_sin_cache",
             "slot_mapping", "k_cache"]
    wrong_dtype = {0: case.q_in.astype(np.float32), 1: case.k_in.astype(np.float32),
                   2: case.positions.astype(np.int32), 3: case.q_weight.astype(np.float32),
                   4: case.k_weight[:64], 5: case.cos_sin[:, :32], 6: case.slots.astype(np.int32),
                   7: case.k_cache.astype(np.float32)}
    for index, bad in wrong_dtype.items():
        broken = list(args)
        broken[index] = bad
        with pytest.raises(msaidx.Error, match=names[index]):
            msaidx.index_prepare(*broken)
    # the cache's page layout (the check the scores calls share)
    pages = case.k_cache.shape[0]
    strided_rows = np.zeros((pages, 2 * PAGE, DIM), dtype=case.k_cache.dtype)[:, ::2]
    elem = case.k_cache.itemsize
    odd_pitch = PAGE * DIM + 8 // elem  # a page stride 8 bytes past a multiple of 16
    odd_stride = np.lib.stride_tricks.as_strided(
        np.zeros(pages * odd_pitch, dtype=case.k_cache.dtype), (pages, PAGE, DIM),
        (odd_pitch * elem, DIM * elem, elem))
    for bad in (strided_rows, odd_stride, case.k_cache[:0]):
        with pytest.raises(msaidx.Error, match="^k_cache"):
            msaidx.index_prepare(*args[:7], bad)
    with pytest.raises(msaidx.Error, match="q_out"):
        msaidx.index_prepare(*args, q_out=np.empty((8, 2, DIM), dtype=np.uint8))
    # eps reaches the library as FP32: values that rounding turns to 0 or inf are refused.
    for bad_eps in (float("nan"), -1e-6, 1e-50, 1e39):
        with pytest.raises(msaidx.Error, match="^" + re.escape(f"eps = {bad_eps!r}:")):
            msaidx.index_prepare(*args, eps=bad_eps)
    # What the call writes shares no memory with what it reads (tests/python/fuzz_api.py): q_out
    # over q_in, the cache over the table, an error word over a weight; a read-only word.
    with pytest.raises(msaidx.Error, match="^q_out: overlaps q_in"):
        msaidx.index_prepare(*args, q_out=np.lib.stride_tricks.as_strided(
            case.q_in, strides=(2 * 2 * DIM, 2 * DIM, 2)))  # contiguous, from q_in's first byte
    rows = case.cos_sin.shape[0]
    shared = np.zeros(max(rows * 64, case.k_cache.size // 2), np.float32)
    table = shared[:rows * 64].reshape(rows, 64)
    table[...] = case.cos_sin
    cache = shared.view(case.k_cache.dtype)[:case.k_cache.size].reshape(case.k_cache.shape)
    with pytest.raises(msaidx.Error, match="^k_cache: overlaps cos_sin_cache"):
        msaidx.index_prepare(*args[:5], table, args[6], cache)
    with pytest.raises(msaidx.Error, match="^error_word: overlaps q_norm_weight"):
        msaidx.index_prepare(*args, error_word=case.q_weight.view(np.uint32)[:1])
    with pytest.raises(msaidx.Error, match="^error_word: is read-only"):
        msaidx.index_prepare(*args, error_word=np.frombuffer(b"\0\0\0\0", np.uint32))


def test_empty_batch(rng):
    case = Case(rng, 0, 4, "e4m3", "bf16")
    q_out = case.run()
    assert q_out.shape == (0, 4, DIM)
    # An empty k_in does not make q_in's tokens disappear.
    case = Case(rng, 5, 2, "e4m3", "bf16")
    args = [case.q_in, np.zeros((0, DIM), np.uint16), case.positions, case.q_weight,
            case.k_weight, case.cos_sin, case.slots, case.k_cache]
    with pytest.raises(msaidx.Error, match="^k_in"):
        msaidx.index_prepare(*args)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
@pytest.mark.parametrize("table", ["float32", "bf16", "theta"])
def test_torch_matches_cpu(rng, num_heads, fmt, table):
    torch = _torch_cuda()
    case = Case(rng, int(rng.integers(1, 3000)), num_heads, fmt, table, num_pages=24)
    q_cpu = case.run()

    def gpu(array, dtype=None):
        tensor = torch.from_numpy(np.ascontiguousarray(array)).cuda()
        return tensor.view(dtype) if dtype is not None else tensor

    projection = gpu(case.projection.view(np.int16), torch.bfloat16)
    T = case.q_in.shape[0]
    q_in = projection[:, :num_heads * DIM].view(T, num_heads, DIM)
    k_in = projection[:, num_heads * DIM:num_heads * DIM + DIM]
    cache_dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.bfloat16
    pages, row = case.cache_base.shape
    base = torch.full((pages, row * case.cache_base.itemsize), 0xA5, dtype=torch.uint8,
                      device="cuda").view(torch.uint8 if fmt == "e4m3" else torch.int16)
    k_cache = torch.as_strided(base.view(cache_dtype), case.k_cache.shape, (base.shape[1], DIM, 1))
    table_tensor = (None if table == "theta" else gpu(case.cos_sin) if table == "float32"
                    else gpu(case.cos_sin.view(np.int16), torch.bfloat16))
    q_out = msaidx.index_prepare(
        q_in, k_in, gpu(case.positions), gpu(case.q_weight.view(np.int16), torch.bfloat16),
        gpu(case.k_weight.view(np.int16), torch.bfloat16), table_tensor, gpu(case.slots),
        k_cache, check=True, rope_theta=case.theta)
    torch.cuda.synchronize()
    as_bits = np.uint8 if fmt == "e4m3" else np.uint16
    q_gpu = q_out.view(torch.uint8 if fmt == "e4m3" else torch.int16).cpu().numpy().view(as_bits)
    k_gpu = base.cpu().numpy().view(as_bits)
    # The CUDA kernel and the cpu backend round the same FP32 steps: byte for byte.
    assert np.array_equal(q_gpu, q_cpu)
    assert np.array_equal(k_gpu, case.cache_base)
    assert case.check(q_gpu, k_gpu[:, :PAGE * DIM].reshape(case.k_cache.shape)) == 0


def test_torch_reports_bad_slots(rng):
    torch = _torch_cuda()
    case = Case(rng, 32, 1, "e4m3", "float32")
    case.slots[3] = 10**12
    tensors = [torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a).cuda()
               for a in (case.projection, case.positions, case.q_weight, case.k_weight,
                         case.cos_sin, case.slots)]
    projection = tensors[0].view(torch.bfloat16)
    k_cache = torch.zeros(case.k_cache.shape, dtype=torch.uint8, device="cuda")
    with pytest.raises(msaidx.Error, match="slot_mapping"):
        msaidx.index_prepare(projection[:, :DIM].view(32, 1, DIM), projection[:, DIM:2 * DIM],
                             tensors[1], tensors[2].view(torch.bfloat16),
                             tensors[3].view(torch.bfloat16), tensors[4], tensors[5], k_cache,
                             check=True)
