"""Length-prefixed msgpack frames: the gradient exchange's wire format (the data plane).

A frame is a 4-byte big-endian unsigned length, then that many bytes of one msgpack map with a
str ``"type"`` key. Tensors inside travel as ``protocol.codec.encode_array`` maps whose ``data``
is a msgpack ``bin``; never pickle, never ext types.

Both directions avoid copying tensor data (a 45 MB gradient frame is the common case):

* sending packs the structure with msgpack and hands the tensors' own memory to
  ``socket.sendmsg`` as separate segments (see ``protocol._msgpack_view.pack_segments``);
* receiving reads into a reusable ``bytearray`` with ``recv_into`` and decodes over it, so each
  large ``bin`` is a read-only memoryview of that buffer and ``np.frombuffer`` on it is free.

A frame holding a large tensor also starts with an ``_align`` entry of padding bytes so that the
tensor's data starts at a multiple of :data:`FRAME_ALIGN` bytes in the payload: received into a
buffer (always 16-byte aligned), it is an aligned array, which numpy reduces at full speed.
:func:`decode_frame` drops the entry.

The receiver checks the announced length against ``max_bytes`` before allocating anything, and
the decoder enforces the limits of ``protocol._msgpack_view`` (string size, entries per array or
map, total entries, nesting depth). After a ``DecodeError`` the stream position is unknown:
close the connection.

Sending and receiving frames on sockets is ``edgefleet.transport.frame_io``'s.
"""

from __future__ import annotations

import struct
from typing import Any

from edgefleet.protocol._msgpack_view import ALIGN_KEY, BytesLike, pack_segments, unpack_view
from edgefleet.protocol.errors import DecodeError

MAX_FRAME_BYTES = 1 << 30  # 1 GiB; both ends may pass a smaller max_bytes
FRAME_ALIGN = 16           # the first large tensor's data starts at a multiple of this in the payload

FRAME_HEADER = struct.Struct(">I")  # the payload's length, before every frame


def encode_frame(message: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> list[BytesLike]:
    """Encode ``message`` as a frame: the length header, then the payload's segments.

    Raises:
        ValueError: ``message`` is not a dict with a str ``"type"``, has a non-str key or the
            reserved key ``"_align"``, or the payload exceeds ``max_bytes``.
        TypeError: a value msgpack cannot pack (convert tensors with ``protocol.codec``).
    """
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a frame is a dict with a str 'type' key")
    if ALIGN_KEY in message:
        raise ValueError(f"the key {ALIGN_KEY!r} is reserved for the frame's padding")
    segments = pack_segments(message, align=FRAME_ALIGN)
    size = sum(len(segment) for segment in segments)
    if size > max_bytes:
        raise ValueError(f"frame of {size} bytes exceeds max_bytes={max_bytes}; split the message "
                         "or raise max_bytes on both ends")
    return [FRAME_HEADER.pack(size), *segments]


def decode_frame(payload: BytesLike) -> dict[str, Any]:
    """Decode a frame's payload (without its header); large bins stay views of ``payload``.

    Raises:
        DecodeError: malformed msgpack, a limit exceeded, not a map, or no str ``"type"``.
    """
    message = unpack_view(payload)
    if not isinstance(message, dict):
        raise DecodeError(f"a frame must hold a map, not {type(message).__name__}")
    if not isinstance(message.get("type"), str):
        raise DecodeError(f"frame has no str 'type' key (keys: {sorted(message)[:8]})")
    message.pop(ALIGN_KEY, None)
    return message


def check_frame_length(size: int, max_bytes: int) -> None:
    """Refuse an announced payload length before anything is allocated for it."""
    if size == 0:
        raise DecodeError("empty frame: a frame holds at least a msgpack map")
    if size > max_bytes:
        raise DecodeError(f"frame announces {size} bytes, over the limit of {max_bytes}; refusing "
                          "before allocating (a peer speaking another protocol, or raise max_bytes)")


__all__ = [
    "FRAME_ALIGN",
    "FRAME_HEADER",
    "MAX_FRAME_BYTES",
    "check_frame_length",
    "decode_frame",
    "encode_frame",
]
