"""The gradient exchange's wire dtypes: their names, the numpy form that travels, and their sizes.

A job's ``wire_dtype`` (the train command, ``--wire-dtype``, the profile file) is one of these
names, and every gradient and average of the job travels as an array of that numpy form:
float32, float16, or bfloat16 as its raw 16-bit patterns (numpy has no bfloat16: ``<u2``, see
``protocol.codec.to_bf16_bits``). This table is the only place they are written; ``protocol.codec``
adds the other tensor dtypes a model's state may hold.

numpy is imported only by :func:`numpy_dtype` (an idle agent never imports it for this).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class WireDtype:
    """One wire dtype."""

    name: str      # on the wire, in the train command and on the command line
    numpy: str     # the numpy dtype string of the array that travels (little-endian)
    itemsize: int  # bytes per value


FLOAT32 = WireDtype("float32", "<f4", 4)
FLOAT16 = WireDtype("float16", "<f2", 2)
BFLOAT16 = WireDtype("bfloat16", "<u2", 2)  # the bit patterns (protocol.codec.to_bf16_bits)

WIRE_DTYPES: Mapping[str, WireDtype] = MappingProxyType({d.name: d for d in (FLOAT32, FLOAT16, BFLOAT16)})
_BY_NUMPY = {d.numpy: d for d in WIRE_DTYPES.values()}


def wire_dtype(name: str) -> WireDtype:
    """The wire dtype called ``name``.

    Raises:
        ValueError: ``name`` is not a wire dtype (the message lists them).
    """
    found = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"{name!r:.40} is not a wire dtype: one of {', '.join(WIRE_DTYPES)}")
    return found


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a vector of wire dtype ``name`` travels as (uint16 for bfloat16). Raises ValueError."""
    import numpy  # numpy: off the idle agent (it imports protocol)

    return numpy.dtype(wire_dtype(name).numpy)


def wire_dtype_of(array_dtype: np.dtype) -> WireDtype:
    """The wire dtype an array of numpy dtype ``array_dtype`` travels as (uint16: bfloat16 bits).

    Raises:
        ValueError: no wire dtype travels as ``array_dtype``.
    """
    import numpy  # numpy: off the idle agent (it imports protocol)

    found = _BY_NUMPY.get(numpy.dtype(array_dtype).newbyteorder("<").str)
    if found is None:
        raise ValueError(f"arrays of {array_dtype} are not a wire dtype's: one of {', '.join(WIRE_DTYPES)}")
    return found


__all__ = ["BFLOAT16", "FLOAT16", "FLOAT32", "WIRE_DTYPES", "WireDtype", "numpy_dtype", "wire_dtype", "wire_dtype_of"]
