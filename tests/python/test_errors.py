"""Every bad argument raises msaidx.Error (a ValueError) whose message names that argument."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import msaidx
from batches import make_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def raises_naming(name, call):
    """The message names `name` first, or right after the failing C function's name."""
    with pytest.raises(msaidx.Error) as caught:
        call()
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert re.search(rf"(^|: ){re.escape(name)}\b", message), message
    return message


@pytest.fixture
def batch(rng):
    return make_batch(rng, "e4m3", 2, [3, 5], [130, 0], pad_tokens=1)


def scores_with(batch, **changes):
    args = dict(q=batch.q, k_cache=batch.k_cache, block_table=batch.block_table,
                cu_seqlens_q=batch.cu_seqlens_q, seq_lens=batch.seq_lens)
    args.update(changes)
    return lambda: msaidx.prefill_scores(**args)


def misaligned(array, offset):
    """A copy of `array` whose data starts `offset` bytes past a 16-byte boundary."""
    raw = np.zeros(array.nbytes + 32, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    view = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    view[...] = array
    return view


def test_q_errors(batch):
    q = batch.q
    raises_naming("q", scores_with(batch, q=q[0]))
    raises_naming("q", scores_with(batch, q=q.astype(np.float32)))
    raises_naming("q", scores_with(batch, q=q.astype(np.int8)))
    raises_naming("q", scores_with(batch, q=np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)))
    raises_naming("q", scores_with(batch, q=np.zeros((q.shape[0], 17, 128), np.uint8)))
    raises_naming("q", scores_with(batch, q=np.zeros((q.shape[0], 0, 128), np.uint8)))
    raises_naming("q", scores_with(batch, q=q.tolist()))
    raises_naming("q", scores_with(batch, q=misaligned(q, 4)))
    raises_naming("q", scores_with(batch, q=q.astype(np.uint8).view(">u1").astype(">u2")))


def test_k_cache_errors(batch):
    k = batch.k_cache
    raises_naming("k_cache", scores_with(batch, k_cache=k.astype(np.uint16)))
    raises_naming("k_cache", scores_with(batch, k_cache=k[:, :, :64]))
    raises_naming("k_cache", scores_with(batch, k_cache=k[..., 0]))
    raises_naming("k_cache", scores_with(batch, k_cache=k[:0]))
    raises_naming("k_cache", scores_with(batch, k_cache=np.zeros((4, 100, 128), np.uint8)))
    raises_naming("k_cache", scores_with(batch, k_cache=k[:, ::2]))
    odd_stride = np.zeros((k.shape[0], 128 * 128 + 8), np.uint8)[:, :128 * 128]
    raises_naming("k_cache", scores_with(batch, k_cache=odd_stride.reshape(-1, 128, 128)))
    raises_naming("k_cache", scores_with(batch, k_cache=misaligned(k, 8)))
    raises_naming("k_cache", scores_with(batch, k_cache=[[[0]]]))


def test_block_table_errors(batch):
    bt = batch.block_table
    raises_naming("block_table", scores_with(batch, block_table=bt.astype(np.int64)))
    raises_naming("block_table", scores_with(batch, block_table=bt[0]))
    raises_naming("block_table", scores_with(batch, block_table=bt[:1]))
    raises_naming("block_table", scores_with(batch, block_table=bt[:, :1]))
    wide = np.repeat(bt, 2, axis=1)
    raises_naming("block_table", scores_with(batch, block_table=wide[:, ::2]))
    outside = bt.copy()
    outside[0, 1] = batch.k_cache.shape[0]
    message = raises_naming("block_table", scores_with(batch, block_table=outside))
    assert "block_table[0][1]" in message
    negative = bt.copy()
    negative[1, 0] = -1
    raises_naming("block_table", scores_with(batch, block_table=negative))
    raises_naming("block_table", scores_with(batch, block_table=misaligned(bt, 2)))


def test_metadata_errors(batch):
    cu, lens = batch.cu_seqlens_q, batch.seq_lens
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=cu.astype(np.int64)))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=cu[None, :]))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=cu[:0]))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=np.repeat(cu, 2)[::2]))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=cu + 1))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=np.array([0, 5, 3], np.int32)))
    too_many = np.array([0, 3, batch.num_tokens + 1], np.int32)
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=too_many,
                                              seq_lens=lens + 10))
    raises_naming("cu_seqlens_q", scores_with(batch, cu_seqlens_q=misaligned(cu, 2)))
    raises_naming("seq_lens", scores_with(batch, seq_lens=lens[:1]))
    raises_naming("seq_lens", scores_with(batch, seq_lens=lens.astype(np.float32)))
    raises_naming("seq_lens", scores_with(batch, seq_lens=np.array([-1, 5], np.int32)))
    raises_naming("seq_lens", scores_with(batch, seq_lens=np.array([133, 4], np.int32)))
    raises_naming("seq_lens", scores_with(batch, seq_lens=tuple(lens)))


def test_pitch_out_backend_and_bound_errors(batch):
    args = batch.args()
    shape = (batch.num_tokens, batch.num_heads, batch.largest_nvp())
    for pitch in (0, -3, 2.5, True, "8", batch.largest_nvp() - 1, 2**31):
        raises_naming("pitch", lambda: msaidx.prefill_scores(*args, pitch=pitch))
    for out in (np.zeros(shape, np.float64), np.zeros(shape[:2], np.float32),
                np.zeros((shape[0], 3, shape[2]), np.float32),  # H differs from q's
                np.zeros((shape[0] + 1,) + shape[1:], np.float32),
                np.zeros(shape[::-1], np.float32).T, [0.0]):
        raises_naming("out", lambda: msaidx.decode_scores(*args, out=out))
    frozen = np.zeros(shape, np.float32)
    frozen.flags.writeable = False
    raises_naming("out", lambda: msaidx.prefill_scores(*args, out=frozen))
    raises_naming("out", lambda: msaidx.prefill_scores(*args, pitch=shape[2] + 1,
                                                       out=np.zeros(shape, np.float32)))
    for backend in ("dense", "persistent", "gpu", None):
        raises_naming("backend", lambda: msaidx.prefill_scores(*args, backend=backend))
    raises_naming("max_seq_len", lambda: msaidx.prefill_scores(*args, max_seq_len=10))
    raises_naming("max_q_len", lambda: msaidx.prefill_scores(*args, max_q_len=2))
    raises_naming("max_q_len", lambda: msaidx.prefill_scores(*args, max_q_len=10**6))


def test_fast_accumulation_errors(batch):
    args = batch.args()
    for flag in (2, -1, 0.5, "yes", np.array([1])):  # None: not given
        raises_naming("fast_accumulation",
                      lambda: msaidx.prefill_scores(*args, fast_accumulation=flag))
        raises_naming("fast_accumulation",
                      lambda: msaidx.decode_scores(*args, fast_accumulation=flag))


def test_topk_errors(rng):
    scores = rng.standard_normal((6, 2, 40)).astype(np.float32)
    nvp = np.full(6, 40, np.int32)
    topk = msaidx.topk_select
    raises_naming("scores", lambda: topk(scores.astype(np.float64), nvp))
    raises_naming("scores", lambda: topk(scores[0], nvp))
    raises_naming("scores", lambda: topk(scores[:, :, ::2], nvp))
    raises_naming("scores", lambda: topk(np.zeros((6, 17, 4), np.float32), nvp))
    raises_naming("scores", lambda: topk(np.zeros((6, 2, 0), np.float32), nvp))
    raises_naming("nvp", lambda: topk(scores, nvp[:5]))
    raises_naming("nvp", lambda: topk(scores, nvp.astype(np.int64)))
    raises_naming("nvp", lambda: topk(scores, nvp + 1))  # more pages than the pitch
    for k in (0, 65, 2.0):
        raises_naming("topk", lambda: topk(scores, nvp, topk=k))
    raises_naming("init_blocks", lambda: topk(scores, nvp, init_blocks=-1))
    raises_naming("local_blocks", lambda: topk(scores, nvp, local_blocks=-1))
    raises_naming("init_blocks", lambda: topk(scores, nvp, topk=4, init_blocks=3, local_blocks=2))
    raises_naming("out", lambda: topk(scores, nvp, out=np.zeros((6, 2, 8), np.int32)))
    raises_naming("out", lambda: topk(scores, nvp, out=np.zeros((6, 2, 16), np.int64)))
    raises_naming("out", lambda: topk(scores, nvp, out=np.zeros((6, 2, 16), np.float32)))
    # An output over the scores it reads (rows would read picks written over them).
    words = scores.copy().reshape(-1).view(np.int32)
    overlapping = np.lib.stride_tricks.as_strided(words[34:], (6, 2, 16), (2 * 40 * 4, 40 * 4, 4))
    raises_naming("out", lambda: topk(words.view(np.float32).reshape(6, 2, 40), nvp,
                                      out=overlapping))


def test_num_valid_pages_errors():
    cu, lens = np.array([0, 2, 5], np.int32), np.array([10, 300], np.int32)
    nvp = msaidx.num_valid_pages
    raises_naming("cu_seqlens_q", lambda: nvp(cu.astype(np.uint32), lens))
    raises_naming("cu_seqlens_q", lambda: nvp(np.array([1, 2, 5], np.int32), lens))
    raises_naming("cu_seqlens_q", lambda: nvp(cu, lens, num_tokens=4))
    raises_naming("seq_lens", lambda: nvp(cu, lens[:1]))
    raises_naming("seq_lens", lambda: nvp(cu, np.array([1, 300], np.int32)))
    raises_naming("page_size", lambda: nvp(cu, lens, page_size=100))
    raises_naming("page_size", lambda: nvp(cu, lens, page_size=1024))
    raises_naming("num_tokens", lambda: nvp(cu, lens, num_tokens=-1))
    raises_naming("out", lambda: nvp(cu, lens, out=np.zeros(4, np.int32)))


def test_conversion_and_backend_errors():
    raises_naming("b", lambda: msaidx.e4m3_to_float(np.array([0, 300])))
    raises_naming("b", lambda: msaidx.e4m3_to_float(np.array([1.5])))
    raises_naming("b", lambda: msaidx.bf16_to_float([-1]))
    raises_naming("x", lambda: msaidx.e4m3_from_float(["a"]))
    raises_naming("x", lambda: msaidx.bf16_from_float(np.array([1j])))
    raises_naming("dtype", lambda: msaidx.backends(dtype="fp16"))
    raises_naming("device", lambda: msaidx.backends(device=-1))


def test_backends_reports_cpu():
    assert "cpu" in msaidx.backends()
    verdicts = msaidx.backends(reasons=True)
    assert set(verdicts) == {"cpu", "dense", "split", "persistent"} and verdicts["cpu"] is None
    for name, reason in verdicts.items():
        assert reason is None or name in reason  # a refusal names the backend


def test_version_matches_cmake():
    with open(os.path.join(REPO, "CMakeLists.txt")) as cmake:
        version = re.search(r"project\(msaidx VERSION ([0-9.]+)", cmake.read()).group(1)
    assert msaidx.__version__ == version


def test_missing_library_is_a_clear_error(tmp_path):
    script = ("import msaidx\n"
              "try:\n    msaidx.e4m3_to_float([1])\n"
              "except msaidx.Error as e:\n    print('ERROR', e)\n")
    env = dict(os.environ, MSAIDX_LIBRARY=str(tmp_path / "missing.so"),
               PYTHONPATH=os.path.join(REPO, "python"))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ERROR" in result.stdout and "missing.so" in result.stdout
    assert "make" in result.stdout and "MSAIDX_LIBRARY" in result.stdout
    assert "torch" not in result.stdout


def test_installed_package_without_its_library_names_its_own_folder(tmp_path):
    """An installed package (no checkout around it) that lacks libmsaidx.so says where it looked:
    its own folder, not a build folder of a checkout that is not there."""
    installed = tmp_path / "site-packages"
    shutil.copytree(os.path.join(REPO, "python", "msaidx"), installed / "msaidx",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = ("import msaidx\n"
              "try:\n    msaidx.e4m3_to_float([1])\n"
              "except msaidx.Error as e:\n    print('ERROR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "MSAIDX_LIBRARY"}
    env["PYTHONPATH"] = str(installed)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    looked = os.path.join(str(installed / "msaidx"), "libmsaidx.so")
    assert f"not found at {looked}:" in result.stdout, result.stdout


def test_foreign_library_is_a_clear_error():
    """A library that is not this package's libmsaidx (a foreign one here; an older build lacks
    newer symbols the same way) gives msaidx.Error naming it, not an AttributeError; the loaded
    library's msaidx_version() equals the package's version."""
    foreign = np.random.mtrand.__file__  # a shared object without msaidx_* symbols
    script = ("import msaidx\n"
              "try:\n    msaidx.e4m3_to_float([1])\n"
              "except msaidx.Error as e:\n    print('ERROR', e)\n")
    env = dict(os.environ, MSAIDX_LIBRARY=foreign,
               PYTHONPATH=os.path.dirname(os.path.dirname(msaidx.__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ERROR" in result.stdout and "lacks msaidx_" in result.stdout, result.stdout
    from msaidx import _capi
    assert _capi.lib().msaidx_version().decode() == msaidx.__version__


def test_import_does_not_import_torch():
    script = "import sys, msaidx, numpy\nmsaidx.e4m3_to_float([1])\nprint('torch' in sys.modules)"
    # The msaidx under test: the checkout's python/ or an installed package.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(msaidx.__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_outputs_over_inputs_are_refused():
    """Module functions refuse an out= over their inputs (tests/python/fuzz_api.py found
    num_valid_pages writing over its cu_seqlens_q)."""
    metadata = np.zeros(8, np.int32)
    metadata[:3] = [0, 2, 5]
    lens = np.array([3, 6], np.int32)
    raises_naming("out", lambda: msaidx.num_valid_pages(metadata[:3], lens, out=metadata[1:6]))
    assert msaidx.num_valid_pages(metadata[:3], lens, out=metadata[3:8]).tolist() == [1] * 5


def test_disjoint_outputs_by_byte_range():
    """The overlap test on operands' byte ranges: an output over an input is refused, one beside
    it or writing nothing (an empty view inside an input, as CUDA tensors may be) is not."""
    from msaidx._tensors import DEVICE_HOST, Operand, require_disjoint

    def operand(name, pointer, shape, strides):
        return Operand(name, None, False, shape, strides, "int32", np.int32, pointer, DEVICE_HOST,
                       True)

    scores = operand("scores", 4096, (4, 40), (160, 4))
    raises_naming("out", lambda: require_disjoint(operand("out", 4096 + 600, (4, 16), (64, 4)),
                                                  [scores]))
    require_disjoint(operand("out", 4096 + 640, (4, 16), (64, 4)), [scores])
    require_disjoint(operand("out", 4096 + 64, (0, 16), (64, 4)), [scores])
    require_disjoint(operand("out", 4096, (4, 16), (64, 4)),
                     [operand("nvp", 4096 + 8, (0,), (4,))])
