"""E4M3 and BF16 conversions against the bit-field oracle, on edge values and in bulk."""

import numpy as np
import pytest

import msaidx
import msaidx_oracle as oracle


def test_e4m3_decodes_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = msaidx.e4m3_to_float(codes)
    assert got.dtype == np.float32 and got.shape == (256,)
    want = oracle.e4m3_decode(codes)
    nan = np.isnan(want)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF]
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].astype(np.float64), want[~nan])
    assert np.array_equal(np.signbit(got[~nan]), codes[~nan] >= 0x80)  # -0 for 0x80
    # spot values that pin the oracle itself
    assert got[0x38] == 1.0 and got[0x7E] == 448.0 and got[0x01] == 2.0**-9
    assert got[0x08] == 2.0**-6 and got[0xFE] == -448.0 and got[0x07] == 7 * 2.0**-9


EDGES = [
    (0.0, 0x00), (-0.0, 0x80), (2.0**-10, 0x00), (-(2.0**-10), 0x80),
    (2.0**-10 * 1.0001, 0x01), (3 * 2.0**-10, 0x02), (5 * 2.0**-10, 0x02),
    (1e-30, 0x00), (1.4e-45, 0x00), (2.0**-6, 0x08), (15 * 2.0**-10, 0x08),
    (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A), (1.0625 * (1 + 2**-20), 0x39),
    (448.0, 0x7E), (449.0, 0x7E), (463.99, 0x7E), (464.0, 0x7E), (464.01, 0x7E),
    (1e30, 0x7E), (np.inf, 0x7E), (-np.inf, 0xFE), (-500.0, 0xFE), (-464.0, 0xFE),
    (np.nan, 0x7F), (-np.nan, 0x7F), (240.0, 0x77), (232.0, 0x76), (-0.001953125, 0x81),
]


@pytest.mark.parametrize("value,code", EDGES)
def test_e4m3_encode_edges(value, code):
    got = msaidx.e4m3_from_float(np.array([value], dtype=np.float32))
    assert got.dtype == np.uint8
    assert got[0] == code, f"{value!r} -> {got[0]:#04x}, want {code:#04x}"
    assert oracle.e4m3_encode(value) == code  # the oracle agrees with the spec table


def test_e4m3_encode_matches_oracle_in_bulk(rng):
    finite = np.flatnonzero(~np.isnan(oracle.e4m3_decode(np.arange(256))))
    values = oracle.e4m3_decode(finite).astype(np.float32)
    ladder = np.unique(np.abs(values.astype(np.float64)))
    midpoints = ((ladder[1:] + ladder[:-1]) / 2).astype(np.float32)  # exact ties
    near = np.concatenate([np.nextafter(midpoints, np.float32(0)),
                           np.nextafter(midpoints, np.float32(np.inf))])
    magnitudes = np.exp2(rng.uniform(-14, 10, size=200_000)).astype(np.float32)
    signs = rng.choice(np.array([-1, 1], np.float32), size=magnitudes.size)
    samples = np.concatenate([values, midpoints, -midpoints, near, -near, magnitudes * signs,
                              rng.uniform(-600, 600, size=20_000).astype(np.float32)])
    got = msaidx.e4m3_from_float(samples)
    want = oracle.e4m3_encode(samples)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(samples[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    # every finite code is a fixed point of decode then encode
    assert np.array_equal(msaidx.e4m3_from_float(msaidx.e4m3_to_float(finite.astype(np.uint8))),
                          finite.astype(np.uint8))


def test_conversions_keep_shape_and_take_array_likes():
    grid = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    codes = msaidx.e4m3_from_float(grid)
    assert codes.shape == (3, 4)
    assert np.array_equal(codes, oracle.e4m3_encode(grid))
    assert np.array_equal(msaidx.e4m3_to_float([0x38, 0xB8]), np.array([1.0, -1.0], np.float32))
    assert msaidx.e4m3_from_float(2.0).shape == ()
    transposed = msaidx.e4m3_from_float(grid.T)  # non-contiguous input
    assert np.array_equal(transposed, oracle.e4m3_encode(grid.T))
    assert msaidx.e4m3_from_float(np.zeros(0, np.float32)).shape == (0,)


def test_bf16_round_trip_and_rounding(rng):
    bits = rng.integers(0, 2**16, size=50_000).astype(np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]  # finite
    decoded = msaidx.bf16_to_float(bits)
    assert np.array_equal(decoded.astype(np.float64), oracle.bf16_decode(bits))
    assert np.array_equal(msaidx.bf16_from_float(decoded), bits)
    raw = rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    values = raw.view(np.float32)
    values = values[np.isfinite(values)]
    ties = (rng.integers(0, 2**16, size=1000).astype(np.uint32) << 16 | 0x8000).view(np.float32)
    samples = np.concatenate([values, ties[np.isfinite(ties)],
                              np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0], np.float32)])
    got = msaidx.bf16_from_float(samples)
    want = oracle.bf16_encode(samples)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(samples[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    nan = msaidx.bf16_from_float(np.array([np.nan], np.float32))
    assert np.isnan(msaidx.bf16_to_float(nan))[0] and nan[0] & 0x40
