"""The vectorised float16 conversion gives numpy's results bit for bit, both ways."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.protocol import half_cast
from edgefleet.protocol.half_cast import cast_into

EDGES = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e9, np.inf, -np.inf,
                  6.1035156e-05, 6.0e-08, 5.9604645e-08, 2.98e-08, 2.99e-08, 1e-45, 0.1, 1 / 3, 2049.0, 2051.0],
                 dtype=np.float32)


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(200_000) * np.exp(rng.uniform(-25, 12, 200_000))).astype(np.float32)
    return np.concatenate([EDGES, spread])


@pytest.mark.parametrize("torch_available", [True, False])
def test_float32_to_float16_and_back_equal_numpy_bit_for_bit(monkeypatch, torch_available) -> None:
    if not torch_available:
        monkeypatch.setattr(half_cast, "_load_torch", lambda: False)
    src = _values()
    with np.errstate(over="ignore"):  # values beyond float16 become infinity: one of the cases tested
        expected = src.astype(np.float16)
        half = np.empty_like(expected)
        cast_into(half, src)
    assert np.array_equal(half.view(np.uint16), expected.view(np.uint16))
    half.flags.writeable = False  # received arrays are read-only views
    back = np.empty(src.shape, np.float32)
    cast_into(back, half)
    assert np.array_equal(back.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_other_dtypes_and_strided_arrays_fall_back_to_numpy() -> None:
    src = np.arange(20, dtype=np.float32)
    dst = np.zeros(10, np.float16)
    cast_into(dst, src[::2])  # not contiguous
    assert np.array_equal(dst, src[::2].astype(np.float16))
    wide = np.zeros(20, np.float64)
    cast_into(wide, src)
    assert np.array_equal(wide, src)


def test_bfloat16_bits_go_through_the_codec_both_ways() -> None:
    from edgefleet.protocol.codec import from_bf16_bits, to_bf16_bits

    src = _values()
    bits = np.empty(src.shape, np.uint16)
    cast_into(bits, src)
    assert np.array_equal(bits, to_bf16_bits(src))
    back = np.empty(src.shape, np.float32)
    cast_into(back, bits)
    assert np.array_equal(back.view(np.uint32), from_bf16_bits(bits).view(np.uint32))
