"""The board's per-step shortcut on a real TCP connection: byte-identical grad frames, fixed-layout results read
in place, and everything else (a stop, a result with a re-split, a header cut by TCP, a truncated frame)
handed to the general receiver or refused."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from edgefleet.agent.step_channel import StepChannel
from edgefleet.agent.worker_exchange import ExchangeClient, StopTraining
from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import Avg, BatchSplit, Grad, Stop, decode_step_reply
from edgefleet.protocol.framing import decode_frame, encode_frame
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.transport.frame_io import FrameReceiver, recv_frame, send_frame

P = 1000


def _joined(segments: list) -> bytes:
    return b"".join(bytes(memoryview(segment).cast("B")) for segment in segments)


@pytest.fixture()
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(board, coordinator): a connected TCP pair on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        board = socket.create_connection(listener.getsockname(), timeout=10)
        coordinator, _ = listener.accept()
    coordinator.settimeout(10)
    with board, coordinator:
        yield board, coordinator


def _channel(board: socket.socket, grad: np.ndarray, dtype: str = "float32") -> tuple[StepChannel, FrameReceiver]:
    receiver = FrameReceiver(board)
    return StepChannel(board, receiver, grad, grad_layout=HotFrame("grad", dtype), avg_layout=HotFrame("avg", dtype),
                       elements=grad.size), receiver


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the peer closed early"
        data += chunk
    return data


def test_a_gradient_goes_out_byte_for_byte_as_the_fixed_layout_encodes_it(pair: tuple[socket.socket, socket.socket]) -> None:
    board, coordinator = pair
    grad = np.linspace(-1, 1, P, dtype=np.float32)
    channel, _ = _channel(board, grad)
    for step in (0, 7, 2**32 - 1):
        assert channel.send(step, 32, 0.5, 0.125)
        want = _joined(Grad.encode_hot(HotFrame("grad", "float32"), step=step, n=32, loss=0.5, compute_s=0.125,
                                       tensor=encode_array(grad)))
        got = _recv_exactly(coordinator, len(want))
        assert got == want
        frame = Grad.from_wire(decode_frame(memoryview(got)[4:]), elements=P, dtype="float32")
        assert (frame.step, frame.n, frame.loss, frame.compute_s) == (step, 32, 0.5, 0.125)
        assert np.array_equal(frame.array, grad)
    grad[:] = 3.0  # changed in place: the next frame carries the new values
    assert channel.send(8, 32, 0.5, 0.125)
    got = _recv_exactly(coordinator, len(want))
    assert np.array_equal(Grad.from_wire(decode_frame(memoryview(got)[4:]), elements=P, dtype="float32").array, grad)


@pytest.mark.parametrize("step, loss", [(2**32, 1.0), (-1, 1.0), (3, None), (True, 1.0)])
def test_numbers_the_layout_cannot_carry_send_nothing(pair: tuple[socket.socket, socket.socket], step: int, loss: float | None) -> None:
    board, coordinator = pair
    channel, _ = _channel(board, np.zeros(P, np.float32))
    assert not channel.send(step, 32, loss, 0.0)
    board.shutdown(socket.SHUT_WR)
    assert coordinator.recv(1) == b""  # nothing was written before the end


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_fixed_layout_result_is_read_into_the_same_array_every_step(pair: tuple[socket.socket, socket.socket], dtype: str) -> None:
    board, coordinator = pair
    layout = HotFrame("avg", dtype)
    wire = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    channel, _ = _channel(board, np.zeros(P, wire), dtype)
    arrays = []
    for step in range(3):
        avg = np.full(P, step + 1, dtype=wire)
        coordinator.sendall(_joined(Avg.encode_hot(layout, step=step, n=64, boards=2, tensor=encode_array(avg))))
        assert channel.receive() == (step, 64, 2)
        assert np.array_equal(channel.array, avg) and not channel.array.flags.writeable
        arrays.append(channel.array)
    assert all(array is arrays[0] for array in arrays)


def test_a_stop_or_a_result_with_a_split_goes_to_the_general_receiver(pair: tuple[socket.socket, socket.socket]) -> None:
    board, coordinator = pair
    channel, receiver = _channel(board, np.zeros(P, np.float32))
    # A stop and, right behind it, a result carrying a re-split (longer than the usual result).
    split = BatchSplit(from_step=9, batch_sizes=(16, 48))
    with_split = Avg(step=4, n=64, boards=2, g=np.ones(P, np.float32), split=split)
    coordinator.sendall(_joined(encode_frame(Stop("finished").to_wire())) + _joined(encode_frame(with_split.to_wire())))
    assert channel.receive() is None
    reply = decode_step_reply(receiver.recv(), elements=P, dtype="float32")
    assert isinstance(reply, Stop) and reply.reason == "finished"
    assert channel.receive() is None  # what the general receiver already holds is not read again: it reads on
    reply = decode_step_reply(receiver.recv(), elements=P, dtype="float32")
    assert isinstance(reply, Avg) and reply.split == split and np.array_equal(reply.array, np.ones(P, np.float32))


def test_a_header_cut_by_tcp_is_finished_by_the_general_receiver(pair: tuple[socket.socket, socket.socket]) -> None:
    board, coordinator = pair
    channel, receiver = _channel(board, np.zeros(P, np.float32))
    frame = _joined(Avg.encode_hot(HotFrame("avg", "float32"), step=5, n=8, boards=1, tensor=encode_array(np.ones(P, np.float32))))
    coordinator.sendall(frame[:2])  # the only bytes there when the board reads
    assert channel.receive() is None
    coordinator.sendall(frame[2:])
    reply = decode_step_reply(receiver.recv(), elements=P, dtype="float32")
    assert isinstance(reply, Avg) and reply.step == 5 and np.array_equal(reply.array, np.ones(P, np.float32))


def test_a_result_truncated_by_a_closing_coordinator_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    board, coordinator = pair
    channel, _ = _channel(board, np.zeros(P, np.float32))
    frame = _joined(Avg.encode_hot(HotFrame("avg", "float32"), step=5, n=8, boards=1, tensor=encode_array(np.ones(P, np.float32))))
    coordinator.sendall(frame[:len(frame) // 2])
    coordinator.shutdown(socket.SHUT_WR)
    with pytest.raises(DecodeError, match="truncated frame"):
        channel.receive()


def test_the_client_takes_the_shortcut_from_the_second_step_and_leaves_it_for_a_split_or_a_stop() -> None:
    """Through ExchangeClient: fixed results, a split result and a stop, in one connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = ExchangeClient("127.0.0.1", listener.getsockname()[1], result_timeout_s=10)
        coordinator, _ = listener.accept()
    coordinator.settimeout(10)
    client.param_count = P  # as hello sets it
    with coordinator:
        try:
            _steps(client, coordinator)
        finally:
            client.close()


def _steps(client: ExchangeClient, coordinator: socket.socket) -> None:
    grad = np.ones(P, np.float32)
    layout = HotFrame("avg", "float32")
    split = BatchSplit(from_step=3, batch_sizes=(8, 8))
    replies = [Avg(step=0, n=8, boards=1, g=grad).to_wire(),  # the first step: general path
               Avg(step=1, n=8, boards=1, g=grad * 2).to_wire(),
               Avg(step=2, n=8, boards=1, g=grad * 3, split=split).to_wire(),
               Avg(step=3, n=8, boards=1, g=grad * 4).to_wire(),
               Stop("finished").to_wire()]
    for step, reply in enumerate(replies):
        if step == 0:
            send_frame(coordinator, reply)
        elif reply.get("split") is None and reply["type"] == "avg":
            coordinator.sendall(_joined(Avg.encode_hot(layout, step=reply["step"], n=8, boards=1, tensor=reply["g"])))
        else:
            send_frame(coordinator, reply)
        if reply["type"] == "stop":
            with pytest.raises(StopTraining, match="finished"):
                client.exchange(step=step, grad=grad, n=8, loss=1.0, compute_s=0.0)
        else:
            avg = client.exchange(step=step, grad=grad, n=8, loss=1.0, compute_s=0.0)
            assert np.array_equal(avg, grad * (step + 1))
            assert client.split == (split if step == 2 else None)
        assert Grad.from_wire(recv_frame(coordinator), elements=P, dtype="float32").step == step
        if step == 1:
            assert client._channel is not None and avg is client._channel.array
