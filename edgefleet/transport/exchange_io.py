"""Frames (``protocol.framing``) on non-blocking sockets driven by asyncio, for the exchange server.

A connection is a plain socket or a ``transport.exchange_tls.TlsPipe`` (TLS over one), which
takes the same calls: every function here takes either (:data:`Link`).

asyncio's streams copy every payload (``readexactly`` returns new bytes); these helpers use the
event loop's socket operations instead, receiving into a buffer each connection reuses and
sending tensor memory in place, so a 45 MB gradient costs no extra copy or page faults.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from typing import Any

from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.framing import MAX_FRAME_BYTES, decode_frame, encode_frame
from edgefleet.transport.exchange_tls import TlsPipe
from edgefleet.transport.frame_io import (
    BODY_AT,
    RCVLOWAT_FROM,
    RCVLOWAT_MAX,
    ConnectionClosed,
    claim_buffer,
    set_rcvlowat,
)

_HEADER = struct.Struct(">I")

Link = socket.socket | TlsPipe  # an exchange connection: plain, or TLS over the socket


def _pending(link: Link) -> bool:
    """Whether bytes of the peer already sit in memory (TLS), where no readiness of the socket will announce them."""
    return isinstance(link, TlsPipe) and link.pending


class FrameTooLarge(DecodeError):
    """A frame's header announced more bytes than the reader accepts (refused before anything is allocated)."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"frame announces {size} bytes; accepted are 1 to {max_bytes}")
        self.size, self.max_bytes = size, max_bytes


_IOV_MAX = 1024  # segments per sendmsg call (Linux IOV_MAX)
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


def send_now(sock: Link, segments: list[bytes | memoryview]) -> list[memoryview]:
    """Send what a non-blocking socket takes at once, in one ``sendmsg`` per 1024 segments; return what is left.

    A frame usually fits the socket's send buffer: one system call, one TCP push, and the
    receiver wakes once for the whole frame instead of once per segment. Finish a non-empty
    rest with :func:`send_rest`.

    Raises:
        OSError: the socket failed (the peer is gone).
    """
    return _send_views(sock, [memoryview(segment).cast("B") for segment in segments])


def _send_views(sock: Link, views: list[memoryview]) -> list[memoryview]:
    """:func:`send_now` of byte views; ``views`` itself is left as it was (several sockets may share it)."""
    while views:
        batch = views if len(views) <= _IOV_MAX else views[:_IOV_MAX]
        wanted = sum(view.nbytes for view in batch)
        try:
            sent = sock.sendmsg(batch)
        except (BlockingIOError, InterruptedError):
            return views
        if sent == wanted and batch is views:
            return []  # the usual frame: all of it in one call
        views = _after(views, sent)
        if sent != wanted:
            return views  # the send buffer is full: the caller waits for it to drain
    return views


async def send_rest(loop: asyncio.AbstractEventLoop,
                    pending: list[tuple[Link, list[memoryview]]]) -> list[BaseException | None]:
    """Finish what :func:`send_now` left on each socket, all at once: None or the exception, per socket."""

    async def finish(sock: Link, rest: list[memoryview]) -> None:
        for view in rest:
            await _sendall(loop, sock, view)

    done = await asyncio.gather(*(finish(sock, rest) for sock, rest in pending), return_exceptions=True)
    return [outcome if isinstance(outcome, BaseException) else None for outcome in done]


async def async_send_segments(loop: asyncio.AbstractEventLoop, sock: Link,
                              segments: list[bytes | memoryview], *, stall_s: float | None = None) -> int:
    """Send a frame from ``frame_segments``; returns the bytes sent.

    ``stall_s``: fail with ``TimeoutError`` once the peer has taken no byte for that long (a peer that
    stopped reading cannot hold the sender forever; a slow one that keeps reading is never cut off).
    """
    total = sum(memoryview(segment).nbytes for segment in segments)
    if stall_s is None:
        for rest in send_now(sock, segments):
            await _sendall(loop, sock, rest)
        return total
    views = [memoryview(segment).cast("B") for segment in segments]
    while True:
        views = _send_views(sock, views)
        if not views:
            return total
        await _writable(loop, sock, stall_s)


async def _writable(loop: asyncio.AbstractEventLoop, sock: Link, timeout_s: float | None) -> None:
    """Wait until ``sock`` can take more bytes; ``TimeoutError`` after ``timeout_s`` (None: no limit)."""
    await _ready(loop, sock, write=True, timeout_s=timeout_s)


async def _ready(loop: asyncio.AbstractEventLoop, sock: Link, *, write: bool, timeout_s: float | None = None) -> None:
    """Wait until the socket under ``sock`` is writable (``write``) or readable."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await asyncio.wait_for(ready, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"the peer took no byte for {timeout_s:g} s") from None
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _sendall(loop: asyncio.AbstractEventLoop, sock: Link, data: bytes | memoryview) -> None:
    """All of ``data``, waiting for the socket as need be (a TLS pipe's held records included)."""
    if not isinstance(sock, TlsPipe):
        await loop.sock_sendall(sock, data)
        return
    view = memoryview(data).cast("B")
    while view.nbytes:
        try:
            sent = sock.sendmsg([view])
        except (BlockingIOError, InterruptedError):
            sent = 0
        view = view[sent:]
        if view.nbytes:
            await _ready(loop, sock, write=True)


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: Link, view: memoryview) -> int:
    """Some bytes into ``view`` (0: the peer closed), waiting for them as need be."""
    if not isinstance(sock, TlsPipe):
        return await loop.sock_recv_into(sock, view)
    while True:
        try:
            return sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, write=False)


def send_now_to_all(socks: list[Link], segments: list[bytes | memoryview]) -> list[list[memoryview] | OSError]:
    """:func:`send_now` on every socket: per socket, what it left to send, or the error it raised."""
    views = [memoryview(segment).cast("B") for segment in segments]  # made once for every socket
    left: list[list[memoryview] | OSError] = []
    for sock in socks:
        try:
            left.append(_send_views(sock, views))
        except OSError as exc:
            left.append(exc)
    return left


def _after(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``sent`` bytes have gone."""
    rest = list(views)
    while sent:
        head = rest[0].nbytes
        if sent >= head:
            sent -= head
            rest.pop(0)
        else:
            rest[0] = rest[0][sent:]
            sent = 0
    return rest


async def async_send_frame(loop: asyncio.AbstractEventLoop, sock: Link, message: dict[str, Any], *,
                           stall_s: float | None = None) -> int:
    """Send one frame; returns the bytes sent. Do not modify the tensors until it returns.

    ``stall_s``: see :func:`async_send_segments`.
    """
    return await async_send_segments(loop, sock, frame_segments(message), stall_s=stall_s)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: Link, view: memoryview) -> int:
    got = 0
    while got < view.nbytes:
        n = await _recv_into(loop, sock, view[got:])
        if n == 0:
            break
        got += n
    return got


async def async_recv_frame(loop: asyncio.AbstractEventLoop, sock: Link, buffer: bytearray, *,
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
    if size > max_bytes:
        raise FrameTooLarge(size, max_bytes)
    if size == 0:
        raise DecodeError(f"frame announces 0 bytes; accepted are 1 to {max_bytes}")
    if len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))
    view = memoryview(buffer)[:size]
    got = await _recv_exactly(loop, sock, view)
    if got < size:
        raise DecodeError(f"truncated frame: {got} of {size} bytes before the peer closed")
    return decode_frame(view)


class FrameReader:
    """Reads frames from a non-blocking socket in event-loop callbacks: no task, no future per frame.

    The loop calls back when the socket is readable; the callback reads as much of the current
    frame as has arrived (header, then body into ``buffer``, grown as needed), and hands each
    complete frame, decoded by ``decode`` (``decode_frame`` or a fast path falling back to it), to
    ``on_frame``. Large bins in a frame are views into ``buffer``; ``on_frame``
    may keep them: a frame that begins while any is alive goes into a fresh buffer (the exchange
    drops its views before a board can send again, so in practice one buffer serves every frame
    and the reader never stops watching the socket, which would cost two epoll_ctl calls a
    frame). ``on_frame`` returns True to go on reading, or False to pause until :meth:`resume`. Reading ends
    with :attr:`done` holding the reason: ``ConnectionClosed`` (between frames), ``DecodeError``
    (truncated, oversized (``FrameTooLarge``, raised before anything is allocated) or malformed; also
    an exception ``on_frame`` raised) or ``OSError``.

    With ``expected_bytes`` (the payload size of the frame the peer usually sends, such as a
    step's gradient frame), a new frame's header and body are read by one ``recv_into``, and the
    callback returns to the loop once the frame is handled instead of reading again to learn
    that nothing more has arrived: a frame that has fully arrived costs one system call. Bytes
    read past a shorter frame are kept and begin the next one.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: Link, buffer: bytearray,
                 on_frame: Callable[[dict[str, Any]], bool], *, max_bytes: int = MAX_FRAME_BYTES,
                 decode: Callable[[memoryview], dict[str, Any]] = decode_frame,
                 expected_bytes: int | None = None) -> None:
        self._loop, self._sock, self.buffer, self._on_frame = loop, sock, buffer, on_frame
        self._max_bytes, self._decode = max_bytes, decode
        self.expected_bytes = expected_bytes if expected_bytes and expected_bytes <= max_bytes else None
        self._header = bytearray(_HEADER.size)
        self._got = 0                  # bytes of the current header, then of the current body
        self._size: int | None = None  # body size once the header is complete
        self._carry = b""              # bytes read past the end of the last frame: the next one's start
        self._lowat = 1                # the socket's SO_RCVLOWAT while waiting for the rest of a body
        self._watching = False
        self.done: asyncio.Future[BaseException] = loop.create_future()

    def resume(self) -> None:
        """Start or go on reading (after ``on_frame`` returned False and its views are gone)."""
        if not self._watching and not self.done.done():
            self._watching = True
            self._loop.add_reader(self._sock.fileno(), self._readable)
            if self._carry or _pending(self._sock):  # a frame may be waiting in what was read already: no readiness
                self._loop.call_soon(self._readable)   # will announce it

    def stop(self, reason: BaseException | None = None) -> None:
        """Stop reading for good; ``done`` gets ``reason`` (ConnectionClosed by default)."""
        self._pause()
        if not self.done.done():
            self.done.set_result(reason or ConnectionClosed("reading stopped"))

    def read_now(self) -> None:
        """Read what has arrived at once, as if the loop had just reported the socket readable.

        For a caller that must not miss bytes already in the kernel's buffer (a deadline that
        fires in the same loop iteration as the readiness it would otherwise precede).
        """
        if self._watching:
            self._readable()

    def _pause(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._sock.fileno())

    def _readable(self) -> None:
        try:
            while self._watching:
                if not self._read_some():
                    return  # wait for the next callback
        except (ProtocolError, OSError) as exc:  # ConnectionClosed, DecodeError, a socket error
            self.stop(exc)
        except Exception as exc:
            self.stop(DecodeError(f"{type(exc).__name__}: {exc}"))

    def _read_some(self) -> bool:
        """Take one step; True to go on at once, False to wait for the socket (or a completed frame's wake-up)."""
        between_frames = self._size is None and self._got == 0
        if between_frames and self._carry:
            return self._take_carry()
        if between_frames and self.expected_bytes is not None:
            return self._read_header_and_body(self.expected_bytes)
        if self._size is None:
            target = memoryview(self._header)[self._got:]
        else:
            target = memoryview(self.buffer)[BODY_AT + self._got:BODY_AT + self._size]
        n = self._recv(target)
        if n is None:
            return False
        self._got += n
        if self._size is None:
            if self._got == _HEADER.size:
                self._begin_body(_HEADER.unpack(self._header)[0])
            return True
        return self._complete() if self._got == self._size else True

    def _recv(self, target: memoryview) -> int | None:
        """``recv_into`` the target: the bytes read, or None if nothing has arrived (ConnectionClosed/DecodeError at the end)."""
        try:
            n = self._sock.recv_into(target)
        except (BlockingIOError, InterruptedError):
            if self._size is not None and self._size >= RCVLOWAT_FROM:  # wake when the rest is in, not per segment
                self._lowat = set_rcvlowat(self._sock, min(self._size - self._got, RCVLOWAT_MAX))
            return None
        finally:
            target.release()
        if n == 0:
            if self._size is None and self._got == 0:
                raise ConnectionClosed("the peer closed the connection")
            raise DecodeError(f"truncated frame: the peer closed after {self._got} bytes of "
                              f"{'the header' if self._size is None else f'a {self._size}-byte frame'}")
        return n

    def _read_header_and_body(self, expected: int) -> bool:
        """Read a new frame's header and (up to ``expected`` bytes of) its body in one call."""
        self.buffer = claim_buffer(self.buffer, BODY_AT + expected)  # a fresh one while views of the last frame are alive
        n = self._recv(memoryview(self.buffer)[BODY_AT - _HEADER.size:BODY_AT + expected])
        if n is None:
            return False
        if n < _HEADER.size:
            self._header[:n] = self.buffer[BODY_AT - _HEADER.size:BODY_AT - _HEADER.size + n]
            self._got = n
            return True
        (size,) = _HEADER.unpack_from(self.buffer, BODY_AT - _HEADER.size)
        self._begin_body(size, claimed=True)
        body = n - _HEADER.size
        if body > size:  # a shorter frame than expected, and the next one began
            self._carry = bytes(self.buffer[BODY_AT + size:BODY_AT + body])
            body = size
        self._got = body
        return self._complete() if body == size else True

    def _begin_body(self, size: int, *, claimed: bool = False) -> None:
        """A frame of ``size`` bytes begins; ``claimed``: the buffer is this frame's already (it grows in place if need be)."""
        if size == 0 or size > self._max_bytes:
            raise FrameTooLarge(size, self._max_bytes) if size else DecodeError(
                f"frame announces 0 bytes; accepted are 1 to {self._max_bytes}")
        if not claimed or len(self.buffer) < BODY_AT + size:
            self.buffer = claim_buffer(self.buffer, BODY_AT + size)  # a fresh one while views of the last frame are alive
        self._size, self._got = size, 0

    def _take_carry(self) -> bool:
        """Go on with bytes already read past the last frame, as if they had just arrived."""
        data, self._carry = memoryview(self._carry), b""
        while data:
            if self._size is None:
                take = min(_HEADER.size - self._got, len(data))
                self._header[self._got:self._got + take] = data[:take]
                self._got += take
                if self._got == _HEADER.size:
                    self._begin_body(_HEADER.unpack(self._header)[0])
            else:
                take = min(self._size - self._got, len(data))
                self.buffer[BODY_AT + self._got:BODY_AT + self._got + take] = data[:take]
                self._got += take
                if self._got == self._size:
                    self._carry = bytes(data[take:])
                    return self._complete()
            data = data[take:]
        return True

    def _complete(self) -> bool:
        """Decode the frame in the buffer and hand it on; True only if bytes of the next one are already here."""
        assert self._size is not None
        if self._lowat != 1:  # the next frame's header is 4 bytes
            self._lowat = set_rcvlowat(self._sock, 1)
        frame = self._decode(memoryview(self.buffer)[BODY_AT:BODY_AT + self._size])
        self._size, self._got = None, 0
        if not self._on_frame(frame):
            self._pause()
        return bool(self._carry) or _pending(self._sock)


__all__ = ["ConnectionClosed", "FrameReader", "FrameTooLarge", "Link", "async_recv_frame", "async_send_frame", "async_send_segments",
           "frame_segments", "send_now", "send_now_to_all", "send_rest"]
