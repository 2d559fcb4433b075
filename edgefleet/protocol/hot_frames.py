"""Fixed-layout grad and avg frames: the two frames of every training step, encoded and decoded in C.

A step's ``grad`` frame (board -> exchange) and ``avg`` frame (exchange -> board) always have
the same keys, the same kinds of value and one flat tensor. Here each is laid out once per
(kind, wire dtype) as a fixed msgpack prefix, with every varying number in a fixed-width
msgpack type (uint 32 ``0xce``, float 64 ``0xcb``), so that:

* encoding is one ``struct.pack`` of the prefix; the tensor's memory follows as its own segment;
* decoding is one ``struct.unpack_from`` of the prefix and a comparison of its constant fields
  with the layout's: no walk over the structure, no per-field Python.

The frames are ordinary msgpack maps (fixed-width numbers are valid msgpack; any decoder reads
them, ``protocol.framing.decode_frame`` included) and equal what the general path decodes to.
The prefix starts with the ``_align`` padding entry, sized so the tensor's data starts at a
multiple of ``FRAME_ALIGN`` bytes in the payload, as ``protocol.framing`` does.

Anything else (a loss of None, a re-split in an avg frame, a step beyond 32 bits, another
encoder's frame) goes through the general encoder or decoder: :meth:`HotFrame.encode` returns
None and :meth:`HotFrame.decode` returns None, and the caller takes the general path.

The typed frames of ``protocol.exchange_frames`` go out in these layouts through ``Grad.encode_hot``
and ``Avg.encode_hot``, and their ``from_wire`` reads what :meth:`HotFrame.decode` gives.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

import msgpack

from edgefleet.protocol._msgpack_view import ALIGN_KEY
from edgefleet.protocol.framing import FRAME_ALIGN, FRAME_HEADER, decode_frame
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

_U32_MAX = (1 << 32) - 1
# (key, kind) in frame order; kind: "u32" or "f64" (a number), or a str constant (the frame's type)
_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "grad": (("type", "=grad"), ("step", "u32"), ("n", "u32"), ("loss", "f64"), ("compute_s", "f64")),
    "avg": (("type", "=avg"), ("step", "u32"), ("n", "u32"), ("boards", "u32")),
}
_WIDTH, _CODE = {"u32": 4, "f64": 8}, {"u32": "I", "f64": "d"}
_ELEMENTS, _BYTES = "#elements", "#bytes"  # the tensor's length and its bin's size: numbers of every layout


class HotFrame:
    """The fixed layout of one frame kind (``grad`` or ``avg``) for one wire dtype.

    Args:
        kind: "grad" or "avg".
        dtype: the job's wire dtype, "float32", "float16" or "bfloat16".
    """

    def __init__(self, kind: str, dtype: str) -> None:
        if kind not in _FIELDS or dtype not in WIRE_DTYPES:
            raise ValueError(f"no fixed layout for a {kind!r} frame of {dtype!r}")
        self.kind, self.dtype, self.itemsize = kind, dtype, WIRE_DTYPES[dtype].itemsize
        import numpy  # here, not at import: the agent imports protocol while idle, numpy only to train

        self._np, self._np_dtype = numpy, numpy.dtype(WIRE_DTYPES[dtype].numpy)
        parts: list[tuple[str, Any]] = []  # ("c", bytes) a constant, or ("u32" | "f64", key) a number
        for key, how in _FIELDS[kind]:
            parts.append(("c", msgpack.packb(key)))
            if how.startswith("="):
                parts.append(("c", msgpack.packb(how[1:])))
            else:
                parts += [("c", b"\xce" if how == "u32" else b"\xcb"), (how, key)]
        parts += [("c", msgpack.packb("g") + b"\x83" + msgpack.packb("dtype") + msgpack.packb(dtype)
                   + msgpack.packb("shape") + b"\x91\xce"), ("u32", _ELEMENTS),
                  ("c", msgpack.packb("data") + b"\xc6"), ("u32", _BYTES)]
        align_entry = msgpack.packb(ALIGN_KEY) + b"\xc4"  # a bin8 of ``pad`` zero bytes
        size = 1 + len(align_entry) + 1 + sum(len(v) if how == "c" else _WIDTH[how] for how, v in parts)
        pad = -size % FRAME_ALIGN
        map_header = bytes((0x80 | (len(_FIELDS[kind]) + 2),))  # + the padding and the tensor
        parts.insert(0, ("c", map_header + align_entry + bytes((pad,)) + bytes(pad)))
        merged: list[tuple[str, Any]] = []  # adjacent constants as one: fewer fields to unpack and compare
        for how, v in parts:
            if how == "c" and merged and merged[-1][0] == "c":
                merged[-1] = ("c", merged[-1][1] + v)
            else:
                merged.append((how, v))
        parts = merged
        fmt = ">" + "".join(f"{len(v)}s" if how == "c" else _CODE[how] for how, v in parts)
        self._struct = struct.Struct(fmt)
        self._framed = struct.Struct(">I" + fmt[1:])  # the frame's length header, then the prefix
        self.prefix_bytes = self._struct.size
        self._template = [v if how == "c" else None for how, v in parts]
        const_at = [i for i, (how, _) in enumerate(parts) if how == "c"]
        self._const_at = operator.itemgetter(*const_at)
        self._consts = tuple(parts[i][1] for i in const_at)
        slot = {v: i for i, (how, v) in enumerate(parts) if how != "c"}
        self.keys = tuple(key for key, how in _FIELDS[kind] if not how.startswith("="))
        self._numbers = tuple((slot[key], dict(_FIELDS[kind])[key] == "u32", key) for key in self.keys)
        self._numbers_at = operator.itemgetter(*(slot[key] for key in self.keys))
        self._elements_at, self._bytes_at = slot[_ELEMENTS], slot[_BYTES]

    def encode(self, values: dict[str, Any], tensor: dict[str, Any]) -> list[bytes | memoryview] | None:
        """The frame's segments (length header and prefix, then the tensor's own memory), or None if it does not fit.

        ``values`` holds the frame's numbers by key (``step``, ``n``, ...); ``tensor`` is a flat
        tensor from ``protocol.codec.encode_array``. None: send ``values`` and ``tensor`` as a
        general frame (a loss of None, a step beyond 32 bits, another dtype or shape).
        """
        row = self._template.copy()
        for index, is_u32, key in self._numbers:
            value = values[key]
            if is_u32:
                if type(value) is not int or not 0 <= value <= _U32_MAX:
                    return None
            elif type(value) is not float:
                if type(value) is not int:
                    return None
                value = float(value)
            row[index] = value
        data, shape = tensor["data"], tensor["shape"]
        nbytes = data.nbytes
        if tensor["dtype"] != self.dtype or len(shape) != 1 or nbytes > _U32_MAX or shape[0] * self.itemsize != nbytes:
            return None
        row[self._elements_at], row[self._bytes_at] = shape[0], nbytes
        return [self._framed.pack(self.prefix_bytes + nbytes, *row), data]

    def decode(self, payload: memoryview, *, array: bool = False) -> dict[str, Any] | None:
        """The frame as ``decode_frame`` gives it (the tensor's data a view of ``payload``), or None.

        None means the payload is not in this layout: decode it with ``decode_frame``. With
        ``array``, ``g`` is already the flat read-only numpy array over the payload (what
        ``protocol.codec.decode_array`` would make of the tensor map; bfloat16 as uint16 bits).
        """
        if len(payload) < self.prefix_bytes:
            return None
        row = self._struct.unpack_from(payload)
        if self._const_at(row) != self._consts:
            return None
        elements, nbytes = row[self._elements_at], row[self._bytes_at]
        if nbytes != len(payload) - self.prefix_bytes or elements * self.itemsize != nbytes:
            return None
        frame: dict[str, Any] = {"type": self.kind}
        frame.update(zip(self.keys, self._numbers_at(row)))
        data = payload[self.prefix_bytes:].toreadonly()
        frame["g"] = (self._np.frombuffer(data, dtype=self._np_dtype) if array
                      else {"dtype": self.dtype, "shape": [elements], "data": data})
        return frame

    def header_writer(self, elements: int) -> HeaderWriter:
        """A writer of this layout's length header and prefix for a tensor of ``elements`` values, again and again."""
        return HeaderWriter(self, elements)

    def numbers_in(self, buffer: Any, offset: int, payload_bytes: int) -> tuple[Any, ...] | None:
        """The frame's numbers (in :attr:`keys` order) if the payload of ``payload_bytes`` at ``offset`` of ``buffer``
        is in this layout with its tensor filling the rest, else None (decode it with ``decode_frame``)."""
        if payload_bytes < self.prefix_bytes:
            return None
        row = self._struct.unpack_from(buffer, offset)
        if self._const_at(row) != self._consts:
            return None
        elements, nbytes = row[self._elements_at], row[self._bytes_at]
        if nbytes != payload_bytes - self.prefix_bytes or elements * self.itemsize != nbytes:
            return None
        return self._numbers_at(row) if len(self.keys) > 1 else (self._numbers_at(row),)

    def decode_any(self, payload: memoryview) -> dict[str, Any]:
        """Any frame: this layout's fast path, else ``decode_frame`` (which raises ``DecodeError`` on bad input)."""
        return self.decode(payload) or decode_frame(payload)

    def decode_any_array(self, payload: memoryview) -> dict[str, Any]:
        """:meth:`decode_any`, the fast path's tensor already an array (``decode(payload, array=True)``)."""
        return self.decode(payload, array=True) or decode_frame(payload)


class HeaderWriter:
    """One layout's length header and prefix for one tensor size, packed from a step's numbers in one call.

    :meth:`pack` gives the same bytes as the first segment of :meth:`HotFrame.encode` for the
    same numbers, or raises ``struct.error``/``TypeError`` where ``encode`` would return None (a
    number out of range or of the wrong kind): then send the frame through the general encoder.
    """

    def __init__(self, layout: HotFrame, elements: int) -> None:
        nbytes = elements * layout.itemsize
        if elements < 0 or nbytes > _U32_MAX:
            raise ValueError(f"no fixed layout for a tensor of {elements} values")
        row: list[Any] = [layout.prefix_bytes + nbytes, *layout._template]
        row[1 + layout._elements_at], row[1 + layout._bytes_at] = elements, nbytes
        self._row = row
        self._at = tuple(1 + index for index, _, _ in layout._numbers)
        self._u32 = tuple(is_u32 for _, is_u32, _ in layout._numbers)
        self._pack = layout._framed.pack
        self.frame_bytes = FRAME_HEADER.size + layout.prefix_bytes + nbytes

    def pack(self, *numbers: Any) -> bytes:
        """The header and prefix for ``numbers`` in the layout's key order."""
        row = self._row
        for at, is_u32, value in zip(self._at, self._u32, numbers):
            if is_u32 and type(value) is not int:  # struct takes a bool or numpy integer; the layout's encode does not
                raise TypeError(f"{type(value).__name__} is not an int")
            row[at] = value
        return self._pack(*row)


__all__ = ["HeaderWriter", "HotFrame"]
