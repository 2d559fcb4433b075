"""Frames (``protocol.framing``) on non-blocking sockets driven by asyncio, for the exchange server.

asyncio's streams copy every payload (``readexactly`` returns new bytes); these helpers use the
event loop's socket operations instead, receiving into a buffer each connection reuses and
sending tensor memory in place, so a 45 MB gradient costs no extra copy or page faults.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

from protocol.errors import DecodeError
from protocol.framing import MAX_FRAME_BYTES, ConnectionClosed, decode_frame, encode_frame

_HEADER = struct.Struct(">I")


COALESCE_BELOW = 64 * 1024  # segments smaller than this are joined: one send (one TCP segment) instead of several


def frame_segments(message: dict[str, Any]) -> list[bytes | memoryview]:
    """Encode once, to send the same frame to several boards: small pieces joined, tensors in place."""
    out: list[bytes | memoryview] = []
    pending = bytearray()
    for segment in encode_frame(message):
        view = memoryview(segment)
        if view.nbytes < COALESCE_BELOW:
            pending += view
            continue
        if pending:
            out.append(bytes(pending))
            pending = bytearray()
        out.append(view)
    if pending:
        out.append(bytes(pending))
    return out


async def async_send_segments(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                              segments: list[bytes | memoryview]) -> int:
    """Send a frame from ``frame_segments``; returns the bytes sent."""
    total = 0
    for segment in segments:
        await loop.sock_sendall(sock, segment)
        total += memoryview(segment).nbytes
    return total


async def async_send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, message: dict[str, Any]) -> int:
    """Send one frame; returns the bytes sent. Do not modify the tensors until it returns."""
    return await async_send_segments(loop, sock, frame_segments(message))


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> int:
    got = 0
    while got < view.nbytes:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            break
        got += n
    return got


async def async_recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, buffer: bytearray, *,
                           max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Receive one frame into ``buffer`` (grown as needed); large bins are views into it.

    The caller must be done with the previous frame's views before calling again.

    Raises:
        ConnectionClosed: the peer closed the connection between frames.
        DecodeError: truncated, too large (checked before allocating) or malformed.
    """
    header = bytearray(_HEADER.size)
    got = await _recv_exactly(loop, sock, memoryview(header))
    if got == 0:
        raise ConnectionClosed("the peer closed the connection")
    if got < _HEADER.size:
        raise DecodeError(f"truncated frame header: {got} of {_HEADER.size} bytes before the peer closed")
    (size,) = _HEADER.unpack(header)
    if size == 0 or size > max_bytes:
        raise DecodeError(f"frame announces {size} bytes; accepted are 1 to {max_bytes}")
    if len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))
    view = memoryview(buffer)[:size]
    got = await _recv_exactly(loop, sock, view)
    if got < size:
        raise DecodeError(f"truncated frame: {got} of {size} bytes before the peer closed")
    return decode_frame(view)


__all__ = ["ConnectionClosed", "async_recv_frame", "async_send_frame", "async_send_segments", "frame_segments"]
