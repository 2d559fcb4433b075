"""A sparse vector for the compressed exchange: sorted uint32 indices and their values in a wire dtype.

Top-k compression (``workloads.topk_feedback``) sends a board's k largest accumulated gradient
entries instead of the whole vector; the coordinator's average over the union of the boards'
indices goes back down the same way (``coordinator.exchange.sparse_reduce``). Both directions use this type.

On the wire a sparse vector is a map of two ``protocol.codec`` tensors and the dense length::

    {"length": 61706,
     "indices": {"dtype": "int32", "shape": [k], "data": <bin>},     # uint32 bits, strictly increasing
     "values":  {"dtype": "float16", "shape": [k], "data": <bin>}}   # float32, float16 or bfloat16

The indices are uint32 in memory; they travel tagged ``int32`` (the codec's closed dtype list has
no uint32) with the same bits, and a dense length is at most :data:`MAX_DENSE_LENGTH` (2^28, the
codec's per-array limit), so an honest index never has its top bit set. A peer's map is checked by
:func:`decode_sparse` before any of it is used: the dense length, the counts, the dtypes, and that
the indices are strictly increasing and below the length (so no entry is named twice and none
lies outside the vector). Values are not checked for NaN or Inf here: a board whose gradient
overflowed is a training problem, refused by the reduce for that step (as the dense reduce does),
not a broken peer.

numpy only, imported inside the functions (the protocol package stays light for an idle agent).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from edgefleet.protocol.codec import decode_array, encode_array, from_bf16_bits, to_bf16_bits
from edgefleet.protocol.errors import DecodeError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

MAX_DENSE_LENGTH: Final = 1 << 28  # protocol.codec's per-array element limit (1 GiB of float32)
VALUE_DTYPES: Final = ("float32", "float16", "bfloat16")  # wire names of the values; bfloat16 as uint16 bits
_KEYS: Final = frozenset({"length", "indices", "values"})
FLOAT16_MAX: Final = 65504.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseVector:
    """Entries of a dense float vector of ``length`` elements; every other element is zero.

    Attributes:
        length: elements of the dense vector it stands for.
        indices: uint32, strictly increasing, each below ``length``.
        values: one per index: float32, float16, or uint16 bfloat16 bit patterns.
    """

    length: int
    indices: np.ndarray
    values: np.ndarray

    @property
    def nnz(self) -> int:
        """Number of entries sent."""
        return int(self.indices.size)

    @property
    def dtype(self) -> str:
        """The values' wire dtype name: float32, float16 or bfloat16."""
        return _value_dtype_name(self.values)

    def wire_bytes(self) -> int:
        """Bytes of indices and values on the wire (the map's few keys left out)."""
        return int(self.indices.nbytes + self.values.nbytes)


def _value_dtype_name(values: np.ndarray) -> str:
    import numpy as np

    names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16"}
    name = names.get(values.dtype.newbyteorder("="))
    if name is None:
        raise TypeError(f"sparse values of dtype {values.dtype} cannot go on the wire; use float32, float16 or uint16 (bfloat16 bits)")
    return name


def to_wire_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to wire dtype ``dtype`` (nearest, ties to even); float32 is returned as is.

    float16 is clipped to +-65504 first, so a large value is sent as the largest float16 instead of
    infinity (error feedback keeps the rest for later steps).

    Raises:
        ValueError: ``dtype`` is not one of :data:`VALUE_DTYPES`.
    """
    import numpy as np

    if dtype == "float32":
        return np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        half: np.ndarray = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)
        return half
    if dtype == "bfloat16":
        return to_bf16_bits(np.asarray(values, dtype=np.float32))
    raise ValueError(f"sparse value dtype {dtype!r} is not one of {', '.join(VALUE_DTYPES)}")


def widen_values(values: np.ndarray) -> np.ndarray:
    """The values as float32 (exact for every wire dtype); float32 values are returned without a copy."""
    import numpy as np

    if values.dtype == np.uint16:
        return from_bf16_bits(values)
    return np.asarray(values, dtype=np.float32)


def dense_to_sparse(dense: np.ndarray, indices: np.ndarray | None = None, *, dtype: str = "float32") -> SparseVector:
    """The entries of ``dense`` at ``indices`` (all its non-zero entries when None) as a sparse vector.

    Args:
        dense: a 1-d float32 vector.
        indices: strictly increasing positions in ``dense`` (any integer dtype), e.g. the union of
            the boards' indices that the coordinator's average covers.
        dtype: the values' wire dtype.

    Raises:
        ValueError: ``dense`` is not 1-d float32, or ``indices`` are not strictly increasing within it.
    """
    import numpy as np

    if dense.ndim != 1 or dense.dtype != np.float32:
        raise ValueError(f"dense_to_sparse needs a 1-d float32 vector, got shape {dense.shape} {dense.dtype}")
    if indices is None:
        picked = np.flatnonzero(dense).astype(np.uint32)
    else:
        picked = np.asarray(indices).astype(np.uint32, copy=False)
        problem = _index_problem(picked, dense.size)
        if problem:
            raise ValueError(f"dense_to_sparse: {problem}")
    return SparseVector(length=int(dense.size), indices=picked, values=to_wire_values(dense[picked], dtype))


def to_dense(sparse: SparseVector) -> np.ndarray:
    """The dense float32 vector ``sparse`` stands for (zeros elsewhere)."""
    import numpy as np

    out = np.zeros(sparse.length, dtype=np.float32)
    out[sparse.indices] = widen_values(sparse.values)
    return out


def add_weighted_into(dense_out: np.ndarray, sparse: SparseVector, weight: float | np.float32) -> None:
    """``dense_out += weight * sparse`` in float32, touching only the sparse vector's entries.

    The weight is rounded to float32 once and each product rounded once before its add, as the
    dense reduce (``coordinator.exchange.gradient_reduce``) does, so a sparse vector holding every entry
    adds the same bits as the dense one. The indices are distinct, so the scattered add is exact.

    Raises:
        ValueError: ``dense_out`` is not a float32 vector of the sparse vector's length.
    """
    import numpy as np

    if dense_out.dtype != np.float32 or dense_out.shape != (sparse.length,):
        raise ValueError(f"add_weighted_into needs a float32 vector of {sparse.length} elements, "
                         f"got shape {dense_out.shape} {dense_out.dtype}")
    scaled = widen_values(sparse.values) * np.float32(weight)
    dense_out[sparse.indices] += scaled


def encode_sparse(sparse: SparseVector) -> dict[str, Any]:
    """The wire map of ``sparse`` (see the module docstring); the arrays' memory is not copied."""
    import numpy as np

    indices = np.ascontiguousarray(sparse.indices, dtype=np.uint32)
    return {"length": int(sparse.length), "indices": encode_array(indices.view(np.int32)),
            "values": encode_array(sparse.values)}


def decode_sparse(m: Any, *, length: int, max_entries: int | None = None) -> SparseVector:
    """Check and decode a sparse vector a peer sent; its arrays share memory with the frame and are read-only.

    Args:
        m: the decoded map.
        length: the dense length the receiver expects (the job's parameter count).
        max_entries: most entries accepted (the job's k, or the union's bound); ``length`` when None.

    Raises:
        DecodeError: not a map, missing or unknown keys, a dense length that is not ``length`` or out of
            bounds, more entries than allowed, unknown dtypes, index and value counts that differ,
            or indices that are not strictly increasing or not below the length. The message names which.
    """
    import numpy as np

    if not isinstance(m, dict):
        raise DecodeError(f"a sparse vector is a map, not {type(m).__name__}")
    if set(m) != _KEYS:
        missing, extra = sorted(_KEYS - set(m)), sorted(str(k) for k in set(m) - _KEYS)
        raise DecodeError(f"sparse vector map must have exactly the keys {sorted(_KEYS)} (missing {missing}, unknown {extra})")
    claimed = m["length"]
    if type(claimed) is not int or not 1 <= claimed <= MAX_DENSE_LENGTH:
        raise DecodeError(f"sparse vector length {claimed!r:.40} is not a whole number from 1 to {MAX_DENSE_LENGTH}")
    if claimed != length:
        raise DecodeError(f"sparse vector is over {claimed} elements; this job's vectors have {length}")
    limit = length if max_entries is None else min(max_entries, length)
    index_map, value_map = m["indices"], m["values"]
    if not isinstance(index_map, dict) or index_map.get("dtype") != "int32":
        raise DecodeError(f"sparse vector indices must be an int32 tensor (uint32 bits), got {_dtype_of(index_map)}")
    if not isinstance(value_map, dict) or value_map.get("dtype") not in VALUE_DTYPES:
        raise DecodeError(f"sparse vector values must be a {'/'.join(VALUE_DTYPES)} tensor, got {_dtype_of(value_map)}")
    try:
        indices = decode_array(index_map, max_elements=limit)
        values = decode_array(value_map, max_elements=limit)
    except DecodeError as exc:
        raise DecodeError(f"sparse vector of at most {limit} entries: {exc}") from None
    if indices.ndim != 1 or values.ndim != 1:
        raise DecodeError(f"sparse vector indices and values must be 1-d, got shapes {list(indices.shape)} and {list(values.shape)}")
    if indices.size != values.size:
        raise DecodeError(f"sparse vector has {indices.size} indices but {values.size} values")
    indices = indices.view(np.uint32)
    problem = _index_problem(indices, length)
    if problem:
        raise DecodeError(f"sparse vector {problem}")
    return SparseVector(length=length, indices=indices, values=values)


def _dtype_of(value: Any) -> str:
    if isinstance(value, dict):
        return repr(value.get("dtype"))[:40]
    return f"a {type(value).__name__}"


def _index_problem(indices: np.ndarray, length: int) -> str | None:
    """Why uint32 ``indices`` are not strictly increasing positions below ``length``, or None."""
    import numpy as np

    if indices.size == 0:
        return None
    if indices.size > 1:
        not_rising = np.flatnonzero(indices[1:] <= indices[:-1])
        if not_rising.size:
            at = int(not_rising[0]) + 1
            return (f"indices are not strictly increasing: position {at} holds {int(indices[at])} "
                    f"after {int(indices[at - 1])}")
    last = int(indices[-1])
    if last >= length:
        return f"index {last} is beyond the vector's {length} elements"
    return None


__all__ = [
    "FLOAT16_MAX",
    "MAX_DENSE_LENGTH",
    "VALUE_DTYPES",
    "SparseVector",
    "add_weighted_into",
    "decode_sparse",
    "dense_to_sparse",
    "encode_sparse",
    "to_dense",
    "to_wire_values",
    "widen_values",
]
