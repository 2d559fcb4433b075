"""float32 <-> half-precision wire arrays for the gradient exchange: float16, or bfloat16 as uint16 bits.

numpy converts float16 element by element (on this project's 2-core test machine: 140 us from
float16 and 350 us to float16 for LeNet-5's 61,706 values); torch's CPU kernels use the processor's
conversion instructions and take about 10 us. Both round to nearest, ties to even, with the same
results bit for bit (tests/protocol/test_half_cast.py checks edge cases: overflow to infinity,
subnormals, signed zero). torch is imported only when a float16 job first converts (never by an
idle agent); without torch, numpy does it. bfloat16 (uint16 bit patterns) goes through
``protocol.codec.to_bf16_bits`` / ``from_bf16_bits``, so every caller converts the same way.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

from edgefleet.protocol.codec import from_bf16_bits, to_bf16_bits

if TYPE_CHECKING:
    import numpy as np

@functools.cache
def _load_torch() -> Any:
    """The torch module, imported on first use; False where it is not installed."""
    try:
        import torch  # torch: off the idle agent; optional here
    except ImportError:  # a coordinator without the train extra: numpy does it
        return False
    return torch


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` converted between float32 and a wire dtype (either way), same shape.

    float16 goes through torch when both arrays are C-contiguous; a uint16 array holds bfloat16
    bits (``protocol.codec``'s convention); anything else goes through ``numpy.copyto``.
    """
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    if src.dtype == np.uint16 and dst.dtype == np.float32:
        np.copyto(dst, from_bf16_bits(src))
        return
    if dst.dtype == np.uint16 and src.dtype == np.float32:
        np.copyto(dst, to_bf16_bits(src))
        return
    torch = _load_torch()
    halves = {src.dtype, dst.dtype} == {np.dtype(np.float32), np.dtype(np.float16)}
    if (not torch or not halves or src.shape != dst.shape or not src.flags.c_contiguous
            or not dst.flags.c_contiguous or not dst.flags.writeable):
        np.copyto(dst, src, casting="same_kind")
        return
    with warnings.catch_warnings():  # a received array is read-only; torch only reads it here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(src)
    torch.from_numpy(dst).copy_(source)


__all__ = ["cast_into"]
