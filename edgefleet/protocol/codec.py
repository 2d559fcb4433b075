"""Tensors and nested state as msgpack-ready values; numpy only, never torch, never pickle.

A tensor is ``{"dtype": "float32", "shape": [3, 4], "data": <bin>}``: little-endian, C order,
``data`` exactly ``prod(shape) * itemsize`` bytes. The dtype names are a closed list
(:data:`TENSOR_DTYPES`: the gradient wire dtypes of ``protocol.wire_dtype``, and the other dtypes
a model's state may hold); the decoder looks them up and never hands a peer's string to ``np.dtype``
(``"O"`` would mean Python objects).

numpy has no bfloat16, so a bfloat16 tensor travels as its raw 16-bit patterns tagged
``"bfloat16"``: :func:`encode_array` tags every uint16 array so (take the bits from
:func:`to_bf16_bits`), :func:`decode_array` returns them as uint16 and :func:`from_bf16_bits`
widens them to float32.

Nested values (model and optimizer ``state_dict`` after tensors became numpy arrays) map onto
msgpack as follows, so that :func:`decode_value` inverts :func:`encode_value`:

* None, bool, int, float, str, bytes: themselves; tuples become lists.
* numpy array, or numpy scalar other than np.float64 (a float subclass, which stays a float);
  a scalar comes back as a 0-d array:
  ``{"__nd__": 1, "dtype": ..., "shape": ..., "data": ...}``.
* dict whose keys are all str and none is a marker (``"__nd__"``, ``"__pairs__"``): a map.
* any other dict with int or str keys (an optimizer's ``state`` is keyed by parameter index):
  ``{"__pairs__": [[key, value], ...]}``, in the dict's order.

numpy is imported inside the functions so that an idle agent that never touches a tensor stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

if TYPE_CHECKING:
    import numpy as np

# Tensor dtype name -> numpy dtype string (little-endian). The only dtypes a peer can ask for.
TENSOR_DTYPES: dict[str, str] = {
    **{d.name: d.numpy for d in WIRE_DTYPES.values()},
    "float64": "<f8", "int64": "<i8", "int32": "<i4", "uint8": "|u1", "bool": "|b1",
}
_WIRE_NAME = {v: k for k, v in TENSOR_DTYPES.items()}
MAX_NDIM = 32
MAX_DEPTH = 32  # nesting of lists and dicts in a value
ND_MARKER = "__nd__"
PAIRS_MARKER = "__pairs__"
_MARKERS = (ND_MARKER, PAIRS_MARKER)
_ND_KEYS = {ND_MARKER, "dtype", "shape", "data"}
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can hold


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeLimits:
    """Bounds :func:`decode_value` enforces on a peer's nested value."""

    max_array_elements: int = 1 << 28  # per array; 1 GiB of float32
    max_depth: int = MAX_DEPTH          # nesting of lists and dicts


DEFAULT_LIMITS = DecodeLimits()


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """Describe ``a`` as a wire tensor; ``data`` is a view of ``a``'s memory when it can be.

    A uint16 array is taken to hold bfloat16 bit patterns (from :func:`to_bf16_bits`) and is
    tagged ``"bfloat16"``: uint16 is not a wire dtype, and the bits come back unchanged.

    Args:
        a: an array whose dtype is in :data:`TENSOR_DTYPES`, or uint16; any byte order and layout
            (a big-endian or non-C-contiguous array is copied once).

    Raises:
        TypeError: the dtype cannot go on the wire (the message lists those that can).
    """
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    a = np.asarray(a)
    name = _WIRE_NAME.get(a.dtype.newbyteorder("<").str, "")
    if not name:
        raise TypeError(f"dtype {a.dtype} cannot go on the wire; convert to one of {sorted(TENSOR_DTYPES)}")
    wire = np.dtype(TENSOR_DTYPES[name])
    if a.dtype != wire or not a.flags.c_contiguous:
        a = a.astype(wire, order="C")  # not ascontiguousarray: it turns 0-d into 1-d
    # A flat uint8 view is a zero-copy "B" memoryview for every shape, 0-d and empty included.
    return {"dtype": name, "shape": list(a.shape), "data": a.reshape(-1).view(np.uint8).data}


def _element_count(shape: Any, limit: int) -> int:
    if not isinstance(shape, list):
        raise DecodeError(f"tensor shape must be a list, got {type(shape).__name__}")
    if len(shape) > MAX_NDIM:
        raise DecodeError(f"tensor has {len(shape)} dimensions, over the limit of {MAX_NDIM}")
    count = 1
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise DecodeError(f"tensor shape {shape!r} must hold non-negative ints")
        count *= dim
    if count > limit:
        raise DecodeError(f"tensor of shape {shape} has {count} elements, over the limit of {limit}")
    return count


def decode_array(m: dict[str, Any], *, max_elements: int) -> np.ndarray:
    """Turn a wire tensor back into a read-only array that shares memory with ``m["data"]``.

    A ``"bfloat16"`` tensor comes back as uint16 bit patterns (see :func:`from_bf16_bits`).

    Args:
        m: a map with ``dtype``, ``shape`` and ``data``; other keys are ignored.
        max_elements: largest element count accepted, checked before touching the data.

    Raises:
        DecodeError: a missing key, an unknown dtype, a bad shape, too many elements, a byte
            count that does not match the shape, or a bool tensor holding bytes other than 0/1.
    """
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    if not isinstance(m, dict):
        raise DecodeError(f"a tensor is a map, not {type(m).__name__}")
    missing = [key for key in ("dtype", "shape", "data") if key not in m]
    if missing:
        raise DecodeError(f"tensor map lacks {missing}")
    name, data = m["dtype"], m["data"]
    if not isinstance(name, str) or name not in TENSOR_DTYPES:
        raise DecodeError(f"tensor dtype {name!r} is not one of {sorted(TENSOR_DTYPES)}")
    count = _element_count(m["shape"], max_elements)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"tensor data must be bin, not {type(data).__name__}")
    dtype = np.dtype(TENSOR_DTYPES[name])
    nbytes = memoryview(data).nbytes
    if nbytes != count * dtype.itemsize:
        raise DecodeError(f"{name} tensor of shape {m['shape']} needs {count * dtype.itemsize} bytes, "
                          f"got {nbytes}")
    array: np.ndarray = np.frombuffer(data, dtype=dtype, count=count).reshape(m["shape"])
    if name == "bool" and count and array.view(np.uint8).max() > 1:
        raise DecodeError("bool tensor holds bytes other than 0 and 1")
    array.flags.writeable = False
    return array


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the bits as uint16.

    NaN stays NaN (quiet) and values beyond bfloat16's range round to infinity, as torch does.

    Raises:
        TypeError: ``a`` is not float32 (convert with ``.astype(np.float32)`` first; rounding
            float64 twice could differ from one rounding).
    """
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"to_bf16_bits needs float32, got {a.dtype}")
    bits = a.view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)  # wraps only for NaN bit patterns
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(a), quiet_nan, rounded)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32; exact."""
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"from_bf16_bits needs uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_value(obj: Any) -> Any:
    """Map a nested value onto msgpack types (see the module docstring for the mapping).

    Raises:
        TypeError: a value of another type, e.g. a torch tensor (convert with
            ``t.detach().cpu().numpy()``), or a dict key that is neither int nor str.
        ValueError: an int beyond 64 bits, or nesting deeper than ``MAX_DEPTH`` levels.
    """
    return _encode(obj, 0)


def _encode(obj: Any, depth: int) -> Any:
    import numpy as np  # numpy: off the idle agent (it imports protocol)

    if obj is None or isinstance(obj, (bool, bytes)):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, float):
        return float(obj)  # np.float64 is a float: it travels as one
    if isinstance(obj, int):
        if not _INT_MIN <= obj <= _INT_MAX:
            raise ValueError(f"int {obj} does not fit in 64 bits")
        return int(obj)
    if isinstance(obj, (np.ndarray, np.generic)):
        return {ND_MARKER: 1, **encode_array(np.asarray(obj))}
    if depth >= MAX_DEPTH:
        raise ValueError(f"value nests deeper than {MAX_DEPTH} levels (a cycle?)")
    if isinstance(obj, (list, tuple)):
        return [_encode(item, depth + 1) for item in obj]
    if isinstance(obj, dict):
        for key in obj:
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise TypeError(f"dict key {key!r} is {type(key).__name__}; only int and str keys encode")
        if all(isinstance(key, str) and key not in _MARKERS for key in obj):
            return {str(key): _encode(value, depth + 1) for key, value in obj.items()}
        return {PAIRS_MARKER: [[_encode(key, depth), _encode(value, depth + 1)] for key, value in obj.items()]}
    raise TypeError(f"cannot encode {type(obj).__module__}.{type(obj).__qualname__}; convert tensors "
                    "with t.detach().cpu().numpy() first")


def decode_value(obj: Any, *, limits: DecodeLimits = DEFAULT_LIMITS) -> Any:
    """Invert :func:`encode_value` on a value a peer sent, validating as it goes.

    Arrays share memory with the bins they came from and are read-only; other bins become bytes.

    Raises:
        DecodeError: a type msgpack frames do not carry, a malformed marker map, a bad pair
            key, a repeated key, a bad tensor, or a limit of ``limits`` exceeded.
    """
    return _decode(obj, limits, 0)


def _decode(obj: Any, limits: DecodeLimits, depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, memoryview):
        return bytes(obj)
    if depth >= limits.max_depth:
        raise DecodeError(f"value nests deeper than {limits.max_depth} levels")
    if isinstance(obj, list):
        return [_decode(item, limits, depth + 1) for item in obj]
    if not isinstance(obj, dict):
        raise DecodeError(f"unexpected {type(obj).__name__} in a nested value")
    if ND_MARKER in obj:
        if set(obj) != _ND_KEYS or obj[ND_MARKER] != 1:
            raise DecodeError(f"array map must have exactly the keys {sorted(_ND_KEYS)} and __nd__ 1")
        return decode_array(obj, max_elements=limits.max_array_elements)
    if PAIRS_MARKER in obj:
        return _decode_pairs(obj, limits, depth)
    if not all(isinstance(key, str) for key in obj):
        raise DecodeError("map keys must be str (int-keyed dicts travel as __pairs__)")
    return {key: _decode(value, limits, depth + 1) for key, value in obj.items()}


def _decode_pairs(obj: dict[Any, Any], limits: DecodeLimits, depth: int) -> dict[int | str, Any]:
    pairs = obj[PAIRS_MARKER]
    if len(obj) != 1 or not isinstance(pairs, list):
        raise DecodeError("a __pairs__ map holds only a list of [key, value] pairs")
    out: dict[int | str, Any] = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise DecodeError(f"__pairs__ entry {pair!r:.60} is not a [key, value] pair")
        key = pair[0]
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise DecodeError(f"__pairs__ key {key!r:.60} is neither int nor str")
        if key in out:
            raise DecodeError(f"__pairs__ key {key!r} appears twice")
        out[key] = _decode(pair[1], limits, depth + 1)
    return out


__all__ = [
    "DEFAULT_LIMITS",
    "MAX_DEPTH",
    "ND_MARKER",
    "PAIRS_MARKER",
    "TENSOR_DTYPES",
    "DecodeLimits",
    "decode_array",
    "decode_value",
    "encode_array",
    "encode_value",
    "from_bf16_bits",
    "to_bf16_bits",
]
