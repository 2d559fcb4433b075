"""Frames on non-blocking sockets in an event loop: the callback reader and the one-call sends."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import numpy as np
import pytest

from edgefleet.protocol.codec import decode_array, encode_array
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.framing import encode_frame
from edgefleet.transport.exchange_io import (
    FrameReader,
    Link,
    async_send_frame,
    frame_segments,
    send_now_to_all,
    send_rest,
)
from edgefleet.transport.frame_io import ConnectionClosed, recv_frame

TIMEOUT_S = 10.0


def _pair() -> tuple[socket.socket, socket.socket]:
    left, right = socket.socketpair()
    left.setblocking(False)
    right.setblocking(False)
    return left, right


def _raw(message: dict[str, Any]) -> bytes:
    return b"".join(bytes(s) for s in encode_frame(message))


def test_reader_delivers_frames_split_anywhere_and_pauses_while_views_are_alive() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = _pair()
        grads = [np.arange(100_000, dtype=np.float32) * (i + 1) for i in range(3)]
        wire = b"".join(_raw({"type": "grad", "step": i, "g": encode_array(g)}) for i, g in enumerate(grads))
        got: list[np.ndarray] = []
        arrived = asyncio.Event()

        def on_frame(frame: dict[str, Any]) -> bool:
            got.append(decode_array(frame["g"], max_elements=100_000))  # a view into the buffer
            arrived.set()
            return False  # paused until the view is gone

        reader = FrameReader(loop, right, bytearray(), on_frame)
        reader.resume()

        async def drip() -> None:  # a prime-sized drip: headers and bodies cut anywhere
            for start in range(0, len(wire), 7919):
                await loop.sock_sendall(left, wire[start:start + 7919])

        sender = asyncio.ensure_future(drip())
        for i in range(3):
            await asyncio.wait_for(arrived.wait(), TIMEOUT_S)
            arrived.clear()
            assert len(got) == 1 and np.array_equal(got[0], grads[i])
            assert np.shares_memory(got[0], np.frombuffer(reader.buffer, np.uint8))
            got.clear()  # drop the view, then read on
            reader.resume()
        await asyncio.wait_for(sender, TIMEOUT_S)
        left.close()
        reason = await asyncio.wait_for(reader.done, TIMEOUT_S)
        assert isinstance(reason, ConnectionClosed)
        right.close()

    asyncio.run(main())


def test_a_frame_arriving_while_views_are_alive_goes_to_a_fresh_buffer_and_a_free_buffer_is_reused() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        left, right = _pair()
        grads = [np.arange(100_000, dtype=np.float32) * (i + 1) for i in range(4)]
        kept: list[np.ndarray] = []
        buffers: list[int] = []
        arrived = asyncio.Event()

        def on_frame(frame: dict[str, Any]) -> bool:
            view = decode_array(frame["g"], max_elements=100_000)
            buffers.append(id(reader.buffer))
            if frame["step"] < 2:
                kept.append(view)  # frames 0 and 1 keep their views while 1 and 2 arrive
            arrived.set()
            return True  # never paused

        reader = FrameReader(loop, right, bytearray(), on_frame)
        reader.resume()
        for i, grad in enumerate(grads):
            if i == 3:
                kept.clear()  # views gone: the last frame may reuse the buffer
            await loop.sock_sendall(left, _raw({"type": "grad", "step": i, "g": encode_array(grad)}))
            await asyncio.wait_for(arrived.wait(), TIMEOUT_S)
            arrived.clear()
            if i < 2:
                assert all(np.array_equal(view, grads[k]) for k, view in enumerate(kept))  # never overwritten
        assert len(set(buffers[:3])) == 3  # frames 1 and 2 each found the last buffer in use
        assert buffers[3] == buffers[2]    # frame 3 found it free
        left.close()
        assert isinstance(await asyncio.wait_for(reader.done, TIMEOUT_S), ConnectionClosed)
        right.close()

    asyncio.run(main())


@pytest.mark.parametrize("wire, fragment", [
    (struct.pack(">I", 0), "accepted are 1 to"),
    (struct.pack(">I", 1 << 31), "accepted are 1 to"),
    (struct.pack(">I", 10) + b"\x81", "truncated frame"),
    (b"\x00\x00", "truncated frame"),
    (struct.pack(">I", 1) + b"\xc1", "not a msgpack type"),
])
def test_reader_ends_with_a_decode_error_naming_the_problem(wire: bytes, fragment: str) -> None:
    async def main() -> BaseException:
        loop = asyncio.get_running_loop()
        left, right = _pair()
        reader = FrameReader(loop, right, bytearray(), lambda frame: True, max_bytes=1 << 20)
        reader.resume()
        await loop.sock_sendall(left, wire)
        left.close()
        reason = await asyncio.wait_for(reader.done, TIMEOUT_S)
        right.close()
        return reason

    reason = asyncio.run(main())
    assert isinstance(reason, DecodeError) and fragment in str(reason)


def test_an_exception_in_on_frame_ends_the_connection_not_the_loop() -> None:
    async def main() -> BaseException:
        loop = asyncio.get_running_loop()
        left, right = _pair()

        def on_frame(frame: dict[str, Any]) -> bool:
            raise KeyError("step")

        reader = FrameReader(loop, right, bytearray(), on_frame)
        reader.resume()
        await loop.sock_sendall(left, _raw({"type": "grad"}))
        reason = await asyncio.wait_for(reader.done, TIMEOUT_S)
        left.close()
        right.close()
        return reason

    reason = asyncio.run(main())
    assert isinstance(reason, DecodeError) and "KeyError" in str(reason)


async def _broadcast(loop: asyncio.AbstractEventLoop, socks: list[Link],
                     segments: list[bytes | memoryview]) -> list[int | BaseException]:
    """The exchange's broadcast: :func:`send_now_to_all`, then :func:`send_rest` on the sockets with bytes left."""
    total = sum(memoryview(segment).nbytes for segment in segments)
    left = send_now_to_all(socks, segments)
    outcomes: list[int | BaseException] = [rest if isinstance(rest, OSError) else total for rest in left]
    waits: list[int] = []
    pending: list[tuple[Link, list[memoryview]]] = []
    for i, rest in enumerate(left):
        if rest and not isinstance(rest, OSError):
            waits.append(i)
            pending.append((socks[i], rest))
    failures = await send_rest(loop, pending)
    for i, failure in zip(waits, failures):
        if failure is not None:
            outcomes[i] = failure
    return outcomes


def test_send_now_to_all_and_send_rest_send_a_frame_larger_than_the_socket_buffer_to_every_socket() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pairs = [_pair() for _ in range(3)]
        for sender, _ in pairs:
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        grad = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)  # 8 MB: cannot go at once
        segments = frame_segments({"type": "avg", "step": 3, "g": encode_array(grad)})

        def receive(sock: socket.socket) -> np.ndarray:
            sock.setblocking(True)
            sock.settimeout(TIMEOUT_S)
            return decode_array(recv_frame(sock)["g"], max_elements=grad.size)

        receivers = [loop.run_in_executor(None, receive, r) for _, r in pairs]
        outcomes = await _broadcast(loop, [s for s, _ in pairs], segments)
        results = await asyncio.wait_for(asyncio.gather(*receivers), TIMEOUT_S)
        assert outcomes == [sum(memoryview(s).nbytes for s in segments)] * 3
        assert all(np.array_equal(r, grad) for r in results)
        for s, r in pairs:
            s.close()
            r.close()

    asyncio.run(main())


def test_send_now_to_all_reports_a_closed_peer_without_failing_the_others() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        (good, good_peer), (bad, bad_peer) = _pair(), _pair()
        bad_peer.close()
        outcomes = await _broadcast(loop, [good, bad], frame_segments({"type": "stop", "reason": "done"}))
        assert isinstance(outcomes[0], int) and isinstance(outcomes[1], OSError)
        good_peer.setblocking(True)
        assert recv_frame(good_peer) == {"type": "stop", "reason": "done"}
        sent = await async_send_frame(loop, good, {"type": "stop", "reason": "again"})
        assert sent == len(_raw({"type": "stop", "reason": "again"}))
        for s in (good, good_peer, bad):
            s.close()

    asyncio.run(main())
