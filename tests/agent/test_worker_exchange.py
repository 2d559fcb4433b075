"""The board's exchange client against a fake coordinator on a real socket: the welcomes it refuses, and the
worker failing its job with the coordinator's or its own message."""

from __future__ import annotations

import io
import json
import socket
import threading
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.job_runner import WorkerContext, job_line
from edgefleet.agent.worker import _run_one, _TorchDefaults
from edgefleet.agent.worker_events import EventWriter
from edgefleet.agent.worker_exchange import ExchangeClient, ExchangeRefused
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import Avg, ExchangeVersionError, Hello, Refusal, Welcome
from edgefleet.protocol.jobs import TrainCommand
from edgefleet.transport.frame_io import recv_frame, send_frame

P = 10


class FakeCoordinator(threading.Thread):
    """Takes one board's hello, answers each of ``replies`` (frame maps) after a frame from the board, then
    waits until the board closes."""

    def __init__(self, *replies: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.replies = replies
        self.hello: Hello | None = None

    def run(self) -> None:
        conn, _ = self.listener.accept()
        with conn, self.listener:
            conn.settimeout(30)
            self.hello = Hello.from_wire(recv_frame(conn))
            for i, reply in enumerate(self.replies):
                if i:
                    recv_frame(conn)
                send_frame(conn, reply)
            conn.recv(1)  # until the board closes


def _hello(coordinator: FakeCoordinator) -> Welcome:
    coordinator.start()
    client = ExchangeClient("127.0.0.1", coordinator.port, result_timeout_s=10)
    try:
        return client.hello(job_id="job", board_id="b1", token="secret", param_count=P)
    finally:
        client.close()
        coordinator.join(10)


@pytest.mark.parametrize("version, upgrade", [(2, "upgrade edge-agent on this board"), (0, "upgrade edge-coordinator")])
def test_the_board_refuses_a_welcome_of_another_version_naming_the_side_to_upgrade(version: int, upgrade: str) -> None:
    coordinator = FakeCoordinator(Welcome(step=0, model={}, optimizer={}, v=version).to_wire())
    with pytest.raises(ExchangeVersionError) as refused:
        _hello(coordinator)
    assert str(refused.value) == f"the coordinator speaks exchange protocol {version}, this board 1: {upgrade}"
    assert coordinator.hello is not None and coordinator.hello.board_id == "b1" and coordinator.hello.v == 1


def test_a_welcome_is_read_into_its_fields_and_a_refusal_raises_its_message() -> None:
    welcome = _hello(FakeCoordinator(Welcome(step=7, model={"w": 1}, optimizer={}, schedulers=[{"last_epoch": 3}]).to_wire()))
    assert (welcome.step, welcome.model, welcome.schedulers, welcome.splits) == (7, {"w": 1}, [{"last_epoch": 3}], ())
    with pytest.raises(ExchangeRefused, match="the coordinator refused this board: wrong job or token"):
        _hello(FakeCoordinator(Refusal("wrong job or token").to_wire()))


def test_a_result_for_another_step_or_of_another_size_is_refused() -> None:
    for avg, message in ((Avg(step=1, n=8, boards=1, g=np.zeros(P, np.float32)), "expected the result of step 0"),
                         (Avg(step=0, n=8, boards=1, g=np.zeros(P + 1, np.float32)), "has 11 elements, over the limit of 10")):
        coordinator = FakeCoordinator(Welcome(step=0, model={}, optimizer={}).to_wire(), avg.to_wire())
        coordinator.start()
        client = ExchangeClient("127.0.0.1", coordinator.port, result_timeout_s=10)
        try:
            client.hello(job_id="job", board_id="b1", token="secret", param_count=P)
            with pytest.raises(DecodeError, match=message):
                client.exchange(step=0, grad=np.ones(P, np.float32), n=8, loss=1.0, compute_s=0.01)
        finally:
            client.close()
            coordinator.join(10)


def test_the_worker_fails_its_job_with_the_upgrade_message() -> None:
    coordinator = FakeCoordinator(Welcome(step=0, model={}, optimizer={}, v=2).to_wire())
    coordinator.start()
    job = TrainCommand(job_id="j-1", board_id="b1", exchange_host="127.0.0.1", exchange_port=coordinator.port,
                       token="secret", model="lenet5", dataset="digits", board_index=0, batch_sizes=[8], seed=0,
                       total_steps=2, threads=1)
    out = io.StringIO()
    code = _run_one(job_line(job, WorkerContext()).decode(), EventWriter(out), _TorchDefaults())
    coordinator.join(10)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 3 and events[-1] == {"phase": "failed", "message": "the coordinator speaks exchange protocol 2, "
                                                                     "this board 1: upgrade edge-agent on this board"}
