"""float32 <-> float16 conversion of whole arrays for the gradient exchange, vectorised.

numpy converts float16 element by element (on this project's 2-core test machine: 140 us from
float16 and 350 us to float16 for LeNet-5's 61,706 values); torch's CPU kernels use the processor's
conversion instructions and take about 10 us. Both round to nearest, ties to even, with the same
results bit for bit (tests/protocol/test_half_cast.py checks edge cases: overflow to infinity,
subnormals, signed zero). torch is imported only when a float16 job first converts (never by an
idle agent); without torch, numpy does it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

_torch: Any = None  # the torch module once imported; False if it cannot be


def _load_torch() -> Any:
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError:  # a coordinator without the train extra: numpy does it
            _torch = False
        else:
            _torch = torch
    return _torch


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` converted between float32 and float16 (either way); same shape, both C-contiguous.

    Other dtypes, or arrays that are not contiguous, go through ``numpy.copyto``.
    """
    import numpy as np

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
