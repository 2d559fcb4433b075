"""Frames (``edgefleet.protocol.framing``) on blocking sockets and asyncio streams.

Both directions avoid copying tensor data: sending hands the tensors' own memory to
``socket.sendmsg`` as separate segments; receiving reads into a reusable ``bytearray`` with
``recv_into`` and decodes over it, so each large ``bin`` is a read-only memoryview of that buffer.

The receiver checks the announced length against ``max_bytes`` before allocating anything. After a
``DecodeError`` the stream position is unknown: close the connection.

Sockets must be blocking (a timeout set with ``settimeout`` is fine and raises ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from edgefleet.protocol._msgpack_view import BytesLike
from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.framing import (
    FRAME_ALIGN,
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    check_frame_length,
    decode_frame,
    encode_frame,
)

log = logging.getLogger(__name__)

_HEADER = FRAME_HEADER
BODY_AT = FRAME_ALIGN  # where the receivers put a frame's body in their buffer (aligned); the header just before
_IOV_MAX = 1024  # segments per sendmsg call (Linux IOV_MAX)
RCVLOWAT_FROM = 1 << 20    # frame bodies this large are awaited in pieces (SO_RCVLOWAT), not segment by segment;
# smaller ones are copied as their segments arrive, while the peer is still sending
RCVLOWAT_MAX = 1 << 20     # ... up to this many bytes at a time


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly, between two frames."""


def send_frame(sock: socket.socket, message: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """Send one frame on a blocking socket, tensor data straight from its own memory.

    Args:
        sock: a connected stream socket; without ``sendmsg`` (TLS) each segment goes by ``sendall``.
        message: a dict with a str ``"type"``; tensors as ``protocol.codec.encode_array`` maps.
        max_bytes: largest payload allowed.

    Returns:
        Bytes sent, header included.

    Raises:
        ValueError, TypeError: see :func:`encode_frame`.
        OSError: the socket failed (``TimeoutError`` on a socket timeout).
    """
    return send_segments(sock, encode_frame(message, max_bytes=max_bytes))


def send_segments(sock: socket.socket, pieces: Sequence[BytesLike]) -> int:
    """Send an encoded frame (its length header first) on a blocking socket; returns the bytes sent.

    One ``sendmsg`` per 1024 segments; without ``sendmsg`` (TLS) each segment goes by ``sendall``.

    Raises:
        OSError: the socket failed (``TimeoutError`` on a socket timeout).
    """
    segments = [memoryview(segment) for segment in pieces]
    total = sum(segment.nbytes for segment in segments)
    sendmsg = getattr(sock, "sendmsg", None)
    first = 0
    while first < len(segments):
        if sendmsg is None:
            sock.sendall(segments[first])
            first += 1
            continue
        try:
            sent = sendmsg(segments[first:first + _IOV_MAX])
        except NotImplementedError:  # ssl.SSLSocket has the method but refuses it
            sendmsg = None
            continue
        if sent == total:
            return total  # the usual frame: one call took it all
        while sent:  # drop what went out, trim a partly sent segment
            head = segments[first].nbytes
            if sent >= head:
                sent -= head
                first += 1
            else:
                segments[first] = segments[first][sent:]
                sent = 0
    return total


def _recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; return the bytes received, fewer only if the peer closed.

    For a large ``view`` the socket's low-water mark is the bytes still missing while it waits
    (see :func:`set_rcvlowat`): one wake-up when the frame is in, not one per TCP segment.
    """
    got, total, lowat = 0, view.nbytes, 1
    # The mark only serves a socket with a timeout (Python polls for it before each read). A blocking
    # read copies what has arrived and then waits, but Linux wakes it only once the mark's worth of
    # bytes is queued, counting none it already copied: it would wait for bytes that never come.
    # There MSG_WAITALL does the job: one call, returning when the view is full.
    polled = sock.gettimeout() is not None
    flags = 0 if polled else socket.MSG_WAITALL
    try:
        while got < total:
            want = min(total - got, RCVLOWAT_MAX)
            if polled and total >= RCVLOWAT_FROM and want != lowat:
                lowat = set_rcvlowat(sock, want)
            n = sock.recv_into(view[got:], 0, flags)
            if n == 0:
                break
            got += n
    finally:
        if lowat != 1:
            set_rcvlowat(sock, 1)
    return got


def set_rcvlowat(sock: Any, nbytes: int) -> int:
    """Wake readers of ``sock`` only once ``nbytes`` are queued (SO_RCVLOWAT); returns the mark in force.

    Only ever set to bytes the peer has announced (the rest of a frame), so a reader never waits
    for bytes that are not coming; a closed connection wakes it all the same. Linux caps the
    mark at half the largest receive buffer and grows the buffer to hold it, so the sender
    cannot stall. Where the option is missing, nothing changes (1 is returned).
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
    except (OSError, AttributeError):
        return 1
    return nbytes


def claim_buffer(buffer: bytearray | None, size: int) -> bytearray:
    """Return ``buffer`` grown to ``size`` bytes, or a new bytearray if it is absent or still in use."""
    if buffer is None:
        return bytearray(size)
    try:
        # Resizing fails while views of the previous frame are alive: overwriting would change them.
        buffer.append(0)
        del buffer[-1]
    except BufferError:
        log.debug("receive buffer still referenced by an earlier frame; using a fresh %d-byte one", size)
        return bytearray(size)
    if len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))
    return buffer


def recv_frame(sock: socket.socket, *, max_bytes: int = MAX_FRAME_BYTES, buffer: bytearray | None = None,
               decode: Callable[[memoryview], dict[str, Any]] = decode_frame) -> dict[str, Any]:
    """Receive one frame from a blocking socket.

    Large bins in the result (and arrays made from them with ``protocol.codec.decode_array``)
    are read-only views of the receive buffer, not copies. With a reusable ``buffer``, consume or
    copy them before the next call: while any of them is still referenced the next call cannot
    reuse the buffer and falls back to a fresh allocation (it never overwrites live data), which
    costs the speed the buffer is for. The buffer grows to the largest frame seen and stays so.

    Args:
        sock: a connected stream socket.
        max_bytes: largest payload accepted; checked against the header before allocating.
        buffer: a bytearray to receive into, reused across calls; None allocates one per frame.
        decode: turns the payload into the frame (``decode_frame``, or a fast path that falls back to it).

    Raises:
        ConnectionClosed: the peer closed the connection before a new frame began.
        DecodeError: the frame was truncated, too large, or does not decode (see
            :func:`decode_frame`); the connection is then unusable.
        OSError: the socket failed (``TimeoutError`` on a socket timeout).
    """
    header = bytearray(_HEADER.size)
    got = _recv_exactly(sock, memoryview(header))
    if got == 0:
        raise ConnectionClosed("the peer closed the connection")
    if got < _HEADER.size:
        raise DecodeError(f"truncated frame header: {got} of {_HEADER.size} bytes before the peer closed")
    (size,) = _HEADER.unpack(header)
    check_frame_length(size, max_bytes)
    view = memoryview(claim_buffer(buffer, size))[:size]
    got = _recv_exactly(sock, view)
    if got < size:
        raise DecodeError(f"truncated frame: {got} of {size} bytes before the peer closed")
    return decode(view)


class FrameReceiver:
    """Receives frames from one blocking socket in as few system calls as it can.

    For the frame the peer usually sends (``expected_bytes`` of payload, such as a step's result),
    one ``recv_into`` takes the header with whatever of the body has arrived, and one more with
    ``MSG_WAITALL`` the rest: two calls a frame, no poll and no socket option changes. Give the
    socket no Python timeout (``settimeout(None)``) and bound waits with :func:`set_os_timeouts`;
    with a Python timeout it still works, one poll per read. Bytes read past a frame shorter than
    expected are kept and begin the next one. Large bins in a frame are read-only views of
    :attr:`buffer` (reused for the next frame unless a view is still alive, as :func:`recv_frame`).

    Args:
        sock: a connected stream socket, blocking.
        expected_bytes: the usual payload size, or None to read the header alone first.
        max_bytes: largest payload accepted; checked against the header before allocating.
    """

    def __init__(self, sock: socket.socket, *, expected_bytes: int | None = None,
                 max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock, self.max_bytes = sock, max_bytes
        self.expected_bytes = expected_bytes if expected_bytes and expected_bytes <= max_bytes else None
        self.buffer = bytearray()
        self._carry = b""  # bytes read past the last frame: the start of the next

    def recv(self, decode: Callable[[memoryview], dict[str, Any]] = decode_frame) -> dict[str, Any]:
        """Receive and decode one frame.

        Raises:
            ConnectionClosed: the peer closed the connection before a new frame began.
            DecodeError: truncated, too large, or does not decode; the connection is then unusable.
            OSError: the socket failed (``BlockingIOError``/``TimeoutError`` when a timeout ran out).
        """
        first = self.expected_bytes or 0
        self.buffer = claim_buffer(self.buffer, BODY_AT + first)
        view = memoryview(self.buffer)
        start = BODY_AT - _HEADER.size  # the header goes just before the body
        got = self._take_carry(view[start:BODY_AT + first]) if self._carry else 0
        while got < _HEADER.size:
            n = self.sock.recv_into(view[start + got:BODY_AT + first])
            if n == 0:
                if got == 0:
                    raise ConnectionClosed("the peer closed the connection")
                raise DecodeError(f"truncated frame header: {got} of {_HEADER.size} bytes before the peer closed")
            got += n
        (size,) = _HEADER.unpack_from(self.buffer, start)
        check_frame_length(size, self.max_bytes)
        body = got - _HEADER.size
        if body > size:  # a shorter frame than expected, and the next one began
            self._carry = bytes(view[BODY_AT + size:BODY_AT + body]) + self._carry
            body = size
        if size > first:
            view.release()
            self.buffer = claim_buffer(self.buffer, BODY_AT + size)  # this frame's buffer: it grows in place
            view = memoryview(self.buffer)
            body += self._take_carry(view[BODY_AT + body:BODY_AT + size])
        while body < size:
            n = self.sock.recv_into(view[BODY_AT + body:BODY_AT + size], 0, socket.MSG_WAITALL)
            if n == 0:
                raise DecodeError(f"truncated frame: {body} of {size} bytes before the peer closed")
            body += n
        return decode(view[BODY_AT:BODY_AT + size])

    @property
    def holds_bytes(self) -> bool:
        """Whether bytes already read from the socket wait to begin the next frame (read it with :meth:`recv`)."""
        return bool(self._carry)

    def unread(self, data: bytes) -> None:
        """Put bytes read from the socket elsewhere back in front: the next :meth:`recv` begins with them."""
        self._carry = bytes(data) + self._carry

    def _take_carry(self, target: memoryview) -> int:
        """Copy kept bytes of the next frame into ``target``; how many (the rest stays kept)."""
        if not self._carry:
            return 0
        take = min(len(self._carry), len(target))
        target[:take] = self._carry[:take]
        self._carry = self._carry[take:]
        return take


def set_os_timeouts(sock: socket.socket, seconds: float) -> bool:
    """Bound a blocking socket's reads and writes in the kernel (SO_RCVTIMEO/SO_SNDTIMEO), not by polling.

    The socket stays blocking (``settimeout(None)``); a read or write that waits longer raises
    ``BlockingIOError`` (EAGAIN). Where the kernel refuses the option (a ``struct timeval`` of
    another size, e.g. 32-bit systems with a 64-bit ``time_t``), the socket gets a Python timeout
    instead (``socket.timeout`` then, one poll per call) and False is returned.
    """
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    for layout in ("ll", "qq"):  # the C timeval: two longs, or two 64-bit fields
        try:
            timeval = struct.pack(layout, whole, micros)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except OSError:
            continue
        sock.settimeout(None)
        return True
    sock.settimeout(seconds)
    return False


async def read_frame(reader: asyncio.StreamReader, *, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame from an asyncio stream; wrap in ``asyncio.wait_for`` for a deadline.

    The payload is one ``bytes`` object (asyncio's ``readexactly`` copies once); large bins are
    views of it, so the result owns its memory.

    Raises:
        ConnectionClosed: the peer closed the connection before a new frame began.
        DecodeError: the frame was truncated, too large, or does not decode.
    """
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ConnectionClosed("the peer closed the connection") from None
        raise DecodeError(f"truncated frame header: {len(exc.partial)} of {_HEADER.size} bytes "
                          "before the peer closed") from None
    (size,) = _HEADER.unpack(header)
    check_frame_length(size, max_bytes)
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise DecodeError(f"truncated frame: {len(exc.partial)} of {size} bytes before the peer closed") from None
    return decode_frame(payload)


def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any], *,
                max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Queue one frame on an asyncio stream; the caller then awaits ``writer.drain()``.

    Tensor memory is handed to the transport without a copy, and the transport may hold it
    until the bytes are on the wire: do not modify the arrays until the peer has answered.

    Raises:
        ValueError, TypeError: see :func:`encode_frame`.
    """
    for segment in encode_frame(message, max_bytes=max_bytes):
        writer.write(segment)


__all__ = [
    "BODY_AT",
    "ConnectionClosed",
    "FrameReceiver",
    "claim_buffer",
    "read_frame",
    "recv_frame",
    "send_frame",
    "send_segments",
    "set_os_timeouts",
    "set_rcvlowat",
    "write_frame",
]
