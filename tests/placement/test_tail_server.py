"""The tail host's endpoint against real sockets (coordinator.placement.tail_server): a board with a
valid credential that sends an activation of the wrong shape, or NaNs, is dropped from the step and
named, the others' step goes on; a connection without the credential is refused."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch

from edgefleet.coordinator.placement.tail_server import TailServer
from edgefleet.protocol.activation_frames import ACT, DACT, DOUT, OUT, StepTensor, TailHello, TailStopped, decode_tail_reply
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.transport.frame_io import recv_frame, send_frame
from edgefleet.workloads.layer_cut import cut_model
from edgefleet.workloads.models import LeNet5

JOB = "job-tail"


def _server() -> tuple[TailServer, HelloChecker]:
    torch.manual_seed(0)
    checker = HelloChecker(board_keys=None)
    for board in ("b1", "b2"):
        checker.token_for(board)
    cut = cut_model(LeNet5((1, 32, 32), 10), "net.6")
    return TailServer(job_id=JOB, boards=["b1", "b2"], cut=cut, boundary=(400,), output=(10,), global_batch=8,
                      checker=checker, tls=None), checker


def _connect(port: int, board: str, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    send_frame(sock, TailHello(job_id=JOB, board_id=board, token=token, start=0).to_wire())
    decode_tail_reply(recv_frame(sock))
    return sock


def _board(sock: socket.socket, activation: np.ndarray) -> np.ndarray:
    """One honest step: send the activation, take the output, send its gradient, take the activation's."""
    send_frame(sock, StepTensor(ACT, 0, activation).to_wire())
    out = StepTensor.from_wire(recv_frame(sock), OUT, step=0, shape=(4, 10)).tensor
    send_frame(sock, StepTensor(DOUT, 0, np.ones_like(out)).to_wire())
    return StepTensor.from_wire(recv_frame(sock), DACT, step=0, shape=(4, 400)).tensor


@pytest.mark.parametrize("bad", [np.zeros((4, 399), np.float32), np.full((4, 400), np.nan, np.float32)],
                         ids=["wrong shape", "nan"])
def test_a_board_sending_a_bad_activation_is_dropped_from_the_step_and_named(bad: np.ndarray) -> None:
    async def scenario() -> tuple[list[str], dict[str, list[str]], np.ndarray, bool]:
        server, checker = _server()
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        honest = await loop.run_in_executor(None, _connect, port, "b1", checker.token_for("b1"))
        liar = await loop.run_in_executor(None, _connect, port, "b2", checker.token_for("b2"))
        await server.wait_for({"b1", "b2"}, 10)
        send_frame(liar, StepTensor(ACT, 0, bad).to_wire())
        board_step = loop.run_in_executor(None, _board, honest, np.ones((4, 400), np.float32))
        tail = await server.run_step(0, {"b1": 4, "b2": 4}, deadline_s=10)
        dact = await board_step
        liar.settimeout(5)
        closed = liar.recv(1) == b""
        await server.close()
        honest.close()
        liar.close()
        assert tail is not None
        return tail.boards, server.flags(), dact, closed

    boards, flags, dact, closed = asyncio.run(scenario())
    assert boards == ["b1"] and dact.shape == (4, 400) and np.isfinite(dact).all()
    assert list(flags) == ["b2"] and "wrong act frame for step 0" in flags["b2"][0]
    assert closed


def test_a_connection_without_the_boards_credential_is_refused() -> None:
    async def scenario() -> str:
        server, _ = _server()
        port = await server.start("127.0.0.1", 0)
        try:
            await asyncio.get_running_loop().run_in_executor(None, _connect, port, "b1", "not-the-token")
        except (TailStopped, DecodeError) as exc:
            return str(exc)
        finally:
            await server.close()
        return ""

    assert "wrong job or credential" in asyncio.run(scenario())
