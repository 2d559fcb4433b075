"""A large frame is awaited whole (SO_RCVLOWAT = the bytes still missing), and the mark never outlives it.

Real TCP on 127.0.0.1. The sender stops halfway through a frame; the reader must be waiting
with its low-water mark at exactly the bytes of the frame it has not read (never more: it would
wait for bytes that are not coming), get the whole frame once the rest is sent, and leave the mark at 1.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np

from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.framing import encode_frame
from edgefleet.transport.exchange_io import FrameReader
from edgefleet.transport.frame_io import RCVLOWAT_FROM, recv_frame
from tests.helpers import wait_until


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def _frame_bytes(elements: int) -> tuple[bytes, np.ndarray]:
    data = np.arange(elements, dtype=np.float32)
    return b"".join(bytes(s) for s in encode_frame({"type": "avg", "step": 1, "g": encode_array(data)})), data


def test_a_blocking_reader_waits_for_the_rest_of_a_frame_and_resets_the_mark(tcp_pair) -> None:
    sender, receiver = tcp_pair
    receiver.settimeout(30)
    wire, data = _frame_bytes(300_000)  # 1.2 MB: over RCVLOWAT_FROM
    assert len(wire) > RCVLOWAT_FROM
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(frame=recv_frame(receiver)))
    reader.start()
    half = len(wire) // 2
    sender.sendall(wire[:half])
    # It set the mark before reading any of the body: the whole body (the 4-byte header is read),
    # or what Linux allows (half of net.ipv4.tcp_rmem's largest buffer).
    wait_until(lambda: 1 < _lowat(receiver) <= len(wire) - 4, timeout_s=10, what="a mark within the unread body")
    assert "frame" not in got  # still waiting: half a frame is no frame
    sender.sendall(wire[half:])
    reader.join(timeout=30)
    assert np.array_equal(np.frombuffer(got["frame"]["g"]["data"], dtype=np.float32), data)
    assert _lowat(receiver) == 1


def test_the_event_loop_reader_waits_for_the_rest_of_a_frame_and_resets_the_mark(tcp_pair) -> None:
    sender, receiver = tcp_pair
    receiver.setblocking(False)
    wire, data = _frame_bytes(300_000)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        frames: list[dict] = []
        reader = FrameReader(loop, receiver, bytearray(), lambda frame: frames.append(frame) or True)
        reader.resume()
        sender.sendall(wire[:len(wire) // 2])
        for _ in range(2000):  # the loop must run for the reader to see the first half
            if _lowat(receiver) == len(wire) - len(wire) // 2:
                break
            await asyncio.sleep(0.005)
        assert _lowat(receiver) == len(wire) - len(wire) // 2 and not frames
        sender.sendall(wire[len(wire) // 2:])
        for _ in range(2000):
            if frames:
                break
            await asyncio.sleep(0.005)
        assert len(frames) == 1 and np.array_equal(np.frombuffer(frames[0]["g"]["data"], dtype=np.float32), data)
        assert _lowat(receiver) == 1
        reader.stop()

    asyncio.run(scenario())


def test_a_peer_that_closes_mid_frame_still_wakes_the_reader(tcp_pair) -> None:
    from edgefleet.protocol.errors import DecodeError

    sender, receiver = tcp_pair
    receiver.settimeout(30)
    wire, _ = _frame_bytes(300_000)
    failure: dict = {}

    def read() -> None:
        try:
            recv_frame(receiver)
        except DecodeError as exc:
            failure["error"] = exc

    reader = threading.Thread(target=read)
    reader.start()
    sender.sendall(wire[:len(wire) // 2])
    wait_until(lambda: _lowat(receiver) > 1, timeout_s=10, what="the reader waiting for the rest")
    sender.close()
    reader.join(timeout=30)
    assert not reader.is_alive() and "truncated" in str(failure["error"])
