"""Overlap (``train --overlap``, issue 22 part 2): the gradient streamed during backward, the same result.

Real agents and a real broker for the run; a real socket pair for the stream's bytes; the
coordinator-side exchange in its own process (``tests/hostile/exchange_proc.py``) for broken frames.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgefleet.agent.grad_stream import GradientStream
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import train
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exchange_frames import Grad, Hello, Welcome
from edgefleet.protocol.framing import FRAME_HEADER, decode_frame
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.protocol.jobs import TRAIN_SCHEMA_VERSION, TrainCommand
from edgefleet.transport.fleet_key import load_fleet_key
from edgefleet.transport.frame_io import recv_frame, send_frame
from edgefleet.transport.settings import BrokerSettings
from edgefleet.workloads.params import flatten_grads, gradient_order, trainable_params
from tests.conftest import Fleet
from tests.helpers import wait_until
from tests.hostile.exchange_server import ServerProcess
from tests.hostile.test_exchange_faults import join_boards, start_boards
from tests.integration.test_local_sgd import BATCHES, FLEET, LENET, SEED, _local_sgd_reference, _relative_error, lenet_job

STEPS = 4

pytestmark = FLEET  # the boards l1 and l2 of test_local_sgd, a fleet of this module's own


def test_an_overlapped_run_trains_the_exact_model_and_records_the_mode(tmp_path: Path, fleet: Fleet) -> None:
    spec = lenet_job("--overlap", steps=STEPS)
    assert spec.overlap
    outcome = train(spec, broker=BrokerSettings(host=fleet.broker.host, port=fleet.broker.port),
                    fleet_key=load_fleet_key(fleet.key), run_dir=tmp_path / "run")
    assert not outcome.interrupted

    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    # the exact mathematics: one process on the concatenated global batches (every = 1: no local step)
    assert _relative_error(trained, _local_sgd_reference(STEPS, every=1, warmup=0)) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and all(r["boards"] == ["l1", "l2"] and r["n"] == sum(BATCHES) for r in records)
    assert all(r["loss"] is not None and "train_loss" in r.get("logs", {}) for r in records)  # numbers and logs arrived
    assert json.loads((tmp_path / "run" / "config.json").read_text())["overlap"] is True
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["overlap"] is True
    # every step's gradient was streamed during backward, not sent after it (the fall-back)
    assert {b: v["streamed_steps"] for b, v in result["boards"].items()} == {"l1": STEPS, "l2": STEPS}


def _lenet() -> torch.nn.Module:
    from edgefleet.workloads.registry import build_dataset, build_model

    torch.manual_seed(SEED)
    return build_model("lenet5", LENET, data=build_dataset("digits", "train", {}))


@pytest.mark.parametrize("wire_dtype", ["float32", "float16"])
def test_the_stream_sends_buckets_before_backward_ends_and_the_frame_is_the_gradient(wire_dtype: str) -> None:
    model = _lenet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = gradient_order(trainable_params(optimizer), overlap=True)
    elements = sum(p.numel() for p in params)
    flat = np.zeros(elements, dtype=np.float32)
    wire = None if wire_dtype == "float32" else np.zeros(elements, dtype=np.float16)
    board, coordinator = socket.socketpair()
    received = bytearray()
    reader = threading.Thread(target=lambda: _read_all(coordinator, received), daemon=True)
    reader.start()
    bucket = 4096
    stream = GradientStream(params, flat, wire, board.sendall, bucket_bytes=bucket)
    arrived_during_backward: list[int] = []

    def last_hook(param: torch.Tensor) -> None:  # after the stream's hook on the first layer's weight: backward still runs
        wait_until(lambda: len(received) > bucket, timeout_s=10, what="a bucket's bytes at the other end during backward")
        arrived_during_backward.append(len(received))

    handle = params[-1].register_post_accumulate_grad_hook(last_hook)
    try:
        x = torch.randn(16, *model.input_shape)
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,)))
        value = float(loss.detach())
        stream.begin(Grad.stream_head(step=5, n=16, loss=value, logs={"train_loss": [value, True, False, False]},
                                      dtype=wire_dtype, elements=elements))
        loss.backward()
        stream.finish(Grad.stream_tail(0.125))
    finally:
        handle.remove()
        stream.close()
        board.close()
    reader.join(10)
    coordinator.close()

    assert arrived_during_backward and stream.sent_at_backward_end >= 0, "backward's last hook did not run"
    itemsize = 4 if wire is None else 2
    assert all(size >= bucket for size in stream.pieces[:-1]), stream.pieces  # buckets, then the rest at the optimizer step
    assert len(stream.pieces) >= 3 and sum(stream.pieces) == elements * itemsize
    (length,) = FRAME_HEADER.unpack_from(received)
    assert length == len(received) - FRAME_HEADER.size
    payload = memoryview(bytes(received))[FRAME_HEADER.size:]
    assert HotFrame("grad", wire_dtype).decode(payload) is None  # the fixed layout's fast path declines it cleanly
    frame = Grad.from_wire(decode_frame(payload), elements=elements, dtype=wire_dtype)
    assert (frame.step, frame.n, frame.compute_s) == (5, 16, 0.125) and frame.logs is not None
    expected = flatten_grads(params, np.zeros(elements, dtype=np.float32))  # reversed order: the last layer first
    assert np.array_equal(frame.array, expected if wire is None else expected.astype(np.float16))


def _read_all(sock: socket.socket, into: bytearray) -> None:
    while chunk := sock.recv(1 << 16):
        into += chunk


@pytest.mark.parametrize("cut", ["mid-tensor", "no-trailing-numbers"])
def test_a_board_whose_streamed_frame_is_cut_short_is_dropped_and_the_run_goes_on(servers: Any, cut: str) -> None:
    size = 1000
    server: ServerProcess = servers("--steps", "3")
    boards = start_boards(server.port, 3, size, ids=("b0", "b1"))
    hostile = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        send_frame(hostile, Hello(job_id="job", board_id="b2", token="secret", param_count=size).to_wire())
        Welcome.from_wire(recv_frame(hostile))
        server.wait_for("gathering", value=0, timeout_s=30)
        head = Grad.stream_head(step=0, n=24, loss=1.0, logs=None, dtype="float32", elements=size)
        data = np.ones(size, dtype=np.float32).tobytes()
        hostile.sendall(head + (data[:len(data) // 2] if cut == "mid-tensor" else data))
    finally:
        hostile.close()
    server.finish()
    join_boards(boards)
    assert [server.steps()[s]["contributors"] for s in range(3)] == [["b0", "b1"]] * 3


def test_overlap_is_carried_in_a_command_old_boards_refuse_and_not_with_periodic_averaging() -> None:
    base: dict[str, Any] = {"job_id": "j", "board_id": "b", "exchange_host": "h", "exchange_port": 1, "token": "t",
                            "model": "lenet5", "dataset": "digits", "board_index": 0, "batch_sizes": [8], "seed": 0,
                            "total_steps": 1}
    assert TrainCommand(**base, overlap=True).schema_version == TRAIN_SCHEMA_VERSION
    with pytest.raises(ValueError, match="overlap needs schema_version 5"):
        TrainCommand(**base, overlap=True, schema_version=4)
    with pytest.raises(ConfigError, match="--overlap with --sync-every 4"):
        JobSpec(model="lenet5", dataset="digits", overlap=True, sync_every=4)
    assert Welcome.from_wire(Welcome(step=0, model={}, optimizer={}, overlap=True).to_wire()).overlap
    assert "overlap" not in Welcome(step=0, model={}, optimizer={}).to_wire()  # an exact job's welcome is unchanged
