"""Readers that expect a frame size: header and body in one read, bytes past a shorter frame kept.

Real sockets. ``FrameReceiver`` (the board's blocking side) and ``FrameReader`` with
``expected_bytes`` (the exchange server's event-loop side) must deliver every frame intact
whatever its size relative to the expected one, however the bytes are cut, and a blocking socket
without a Python timeout must never wait for bytes that are not coming.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import threading
from typing import Any

import numpy as np
import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import Grad
from edgefleet.protocol.framing import encode_frame
from edgefleet.transport.exchange_io import FrameReader
from edgefleet.transport.frame_io import ConnectionClosed, FrameReceiver, recv_frame, set_os_timeouts
from tests.helpers import wait_until

TIMEOUT_S = 10.0


def _wire(step: int, elements: int) -> bytes:
    grad = np.arange(elements, dtype=np.float32) + step
    frame = Grad(step=step, n=1, loss=None, compute_s=None, g=grad)  # a general frame: loss None has no fixed layout
    return b"".join(bytes(s) for s in encode_frame(frame.to_wire()))


def _check(frame: dict[str, Any], step: int, elements: int) -> None:
    grad = Grad.from_wire(frame, elements=elements, dtype="float32")
    assert grad.step == step and np.array_equal(grad.array, np.arange(elements, dtype=np.float32) + step)


def _queued(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


@pytest.fixture()
def blocking_pair(tcp_pair: tuple[socket.socket, socket.socket]) -> tuple[socket.socket, socket.socket]:
    """(sender, receiver) over TCP, the receiver blocking with kernel timeouts, as a board's connection."""
    set_os_timeouts(tcp_pair[1], TIMEOUT_S)
    return tcp_pair


@pytest.mark.parametrize("read", ["recv_frame", "FrameReceiver"])
def test_a_blocking_socket_gets_a_frame_whose_second_half_comes_after_the_first_was_read(blocking_pair, read) -> None:
    # Linux wakes a blocked reader only when SO_RCVLOWAT bytes are queued, not counting what it already
    # copied: a mark of the whole body on a blocking socket never wakes for the second half.
    sender, receiver = blocking_pair
    set_os_timeouts(receiver, 3 * TIMEOUT_S)  # a reader that hangs is not rescued by its timeout before we look
    wire = _wire(7, 100_000)  # 400 kB
    got: dict[str, Any] = {}

    def reader() -> None:
        try:
            got["frame"] = recv_frame(receiver) if read == "recv_frame" else FrameReceiver(receiver).recv()
        except Exception as exc:
            got["error"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    sender.sendall(wire[:len(wire) // 2])
    wait_until(lambda: _queued(receiver) == 0, timeout_s=TIMEOUT_S, what="the reader to take the first half")
    sender.sendall(wire[len(wire) // 2:])
    thread.join(TIMEOUT_S)
    hung = thread.is_alive()
    if hung:
        receiver.shutdown(socket.SHUT_RDWR)  # release the thread
        thread.join(TIMEOUT_S)
    assert not hung, "the reader did not wake for the second half of the frame"
    assert "error" not in got, got.get("error")
    _check(got["frame"], 7, 100_000)


@pytest.mark.parametrize("sizes", [
    [1000, 1000, 1000],       # the expected size every time
    [10, 1000, 3, 1000],      # shorter frames: the next frame's bytes are read with them
    [1000, 5000, 1000],       # a longer frame: the rest is read after the header says so
    [3, 3, 3, 3, 1000],       # several whole frames inside one expected-size read
])
@pytest.mark.parametrize("cut", [None, 1, 4093])
def test_the_blocking_receiver_delivers_frames_of_any_size_cut_anywhere(blocking_pair, sizes, cut) -> None:
    sender, receiver = blocking_pair
    wires = [_wire(step, n) for step, n in enumerate(sizes)]
    stream = b"".join(wires)
    expected = len(wires[0]) - 4 if sizes[0] == 1000 else len(_wire(0, 1000)) - 4
    sink = FrameReceiver(receiver, expected_bytes=expected)
    writer = threading.Thread(target=lambda: [sender.sendall(stream[i:i + (cut or len(stream))])
                                              for i in range(0, len(stream), cut or len(stream))])
    writer.start()
    for step, n in enumerate(sizes):
        frame = sink.recv()
        _check(frame, step, n)
        del frame
    writer.join(TIMEOUT_S)
    sender.close()
    with pytest.raises(ConnectionClosed):
        sink.recv()


def test_the_blocking_receiver_names_a_truncated_or_oversized_frame(blocking_pair) -> None:
    sender, receiver = blocking_pair
    wire = _wire(0, 1000)
    sender.sendall(wire[:2000])
    sender.close()
    with pytest.raises(DecodeError, match="truncated frame: 1996 of"):
        FrameReceiver(receiver, expected_bytes=len(wire) - 4).recv()


def test_the_blocking_receiver_refuses_an_announced_size_over_the_limit_before_reading_it(blocking_pair) -> None:
    sender, receiver = blocking_pair
    sender.sendall(struct.pack(">I", 1 << 30) + b"x" * 100)
    with pytest.raises(DecodeError, match="over the limit"):
        FrameReceiver(receiver, expected_bytes=100, max_bytes=1 << 20).recv()


@pytest.mark.parametrize("sizes", [[1000, 1000], [10, 1000, 3, 1000], [1000, 5000, 1000], [3, 3, 3, 3, 1000]])
@pytest.mark.parametrize("pause", [False, True])
def test_the_event_loop_reader_with_an_expected_size_delivers_every_frame(sizes, pause) -> None:
    """Sent in one write, so shorter frames leave whole frames among the bytes already read;
    with ``pause`` the reader stops after each frame and must find them again on resume."""
    stream = b"".join(_wire(step, n) for step, n in enumerate(sizes))

    async def main() -> list[tuple[int, np.ndarray]]:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        left.setblocking(False)
        right.setblocking(False)
        frames: list[tuple[int, np.ndarray]] = []
        arrived = asyncio.Event()

        def on_frame(frame: dict[str, Any]) -> bool:
            grad = Grad.from_wire(frame, elements=sizes[len(frames)], dtype="float32")
            frames.append((grad.step, grad.array.copy()))
            arrived.set()
            return not pause

        reader = FrameReader(loop, right, bytearray(), on_frame, expected_bytes=len(_wire(0, 1000)) - 4)
        reader.resume()
        await loop.sock_sendall(left, stream)
        while len(frames) < len(sizes):
            await asyncio.wait_for(arrived.wait(), TIMEOUT_S)
            arrived.clear()
            if pause:
                reader.resume()
        left.close()
        assert isinstance(await asyncio.wait_for(reader.done, TIMEOUT_S), ConnectionClosed)
        right.close()
        return frames

    frames = asyncio.run(main())
    assert [step for step, _ in frames] == list(range(len(sizes)))
    for (step, grad), n in zip(frames, sizes):
        assert np.array_equal(grad, np.arange(n, dtype=np.float32) + step)


def test_where_the_kernel_refuses_its_timeouts_the_socket_gets_a_python_timeout_instead() -> None:
    class NoKernelTimeouts(socket.socket):
        def setsockopt(self, level: int, option: int, value: Any, *rest: Any) -> None:  # type: ignore[override]
            if option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                raise OSError(22, "Invalid argument")
            super().setsockopt(level, option, value, *rest)

    with NoKernelTimeouts(socket.AF_INET, socket.SOCK_STREAM) as sock:
        assert set_os_timeouts(sock, 2.5) is False
        assert sock.gettimeout() == 2.5
    with socket.socket() as sock:
        assert set_os_timeouts(sock, 2.5) is True
        assert sock.gettimeout() is None
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll")))
        assert (sec, usec) == (2, 500_000)
