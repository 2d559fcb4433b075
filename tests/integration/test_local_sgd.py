"""Periodic averaging (local SGD, ``--sync-every H``) through real agents and a real broker, the coordinator's
service called in-process (``train_job.train``, what ``edge-coordinator train`` runs).

The fleet's result is compared with a single-process simulation of the same mathematics: exact steps
on the global batch, then each board stepping on its own slice of every global batch, the boards'
parameters averaged (weighted by their samples since the last average) at the schedule's sync steps.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgefleet.coordinator.cli.main import build_parser
from edgefleet.coordinator.cli.train_args import job_from_args
from edgefleet.coordinator.exchange.server import ExchangeServer
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import TrainObserver, train
from edgefleet.protocol.codec import encode_array, encode_value
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exchange_frames import Grad, Hello, decode_hello_reply, decode_step_reply
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.transport.fleet_key import load_fleet_key
from edgefleet.transport.frame_io import recv_frame, send_frame
from edgefleet.transport.settings import BrokerSettings
from tests.conftest import Fleet
from tests.helpers import train_args
from tests.integration.periodic_reference import periodic_reference

SEED = 7
BATCHES = (8, 16)
STEPS, EVERY, WARMUP = 8, 3, 2  # exact 0-1, local 2-3, sync 4, local 5-6, sync 7 (the run's last step)
KINDS = ["exact", "exact", "local", "local", "sync", "local", "local", "sync"]
LENET = {"optimizer": "sgd", "lr": 0.05}
FLEET = pytest.mark.fleet(boards=("l1", "l2"), agent_args=("--interval", "0.2"), wait="online",
                         keep_worker=True)  # here and in test_overlap

pytestmark = FLEET


class _Notes(TrainObserver):
    """Keeps the run's notes for the user."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def _local_sgd_reference(steps: int, *, every: int, warmup: int) -> dict[str, torch.Tensor]:
    """One process: the post-local SGD mathematics on each board's slice of the run's global batches."""
    return periodic_reference(steps, every=every, warmup=warmup, batches=BATCHES, seed=SEED, options=LENET)


def _relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def lenet_job(*flags: str, steps: int) -> JobSpec:
    """LeNet-5 (SGD) on boards l1 and l2 at BATCHES for ``steps`` steps, with ``flags``, as ``train`` reads its command line."""
    args = build_parser().parse_args(train_args(*flags, boards="l1,l2", batch=BATCHES, model="lenet5", model_options=LENET,
                                                dataset="digits", seed=SEED, threads=1, no_rebalance=True, steps=steps))
    return job_from_args(args)


def test_periodic_averaging_trains_what_the_local_sgd_mathematics_gives(tmp_path: Path, fleet: Fleet) -> None:
    spec = lenet_job("--sync-every", str(EVERY), "--sync-warmup", str(WARMUP), steps=STEPS)
    assert (spec.sync_every, spec.sync_warmup) == (EVERY, WARMUP)
    observer = _Notes()
    outcome = train(spec, broker=BrokerSettings(host=fleet.broker.host, port=fleet.broker.port),
                    fleet_key=load_fleet_key(fleet.key), run_dir=tmp_path / "run", observer=observer)
    assert not outcome.interrupted
    assert any("changes the mathematics" in note for note in observer.notes)

    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert _relative_error(trained, _local_sgd_reference(STEPS, every=EVERY, warmup=WARMUP)) <= 1e-5
    # and it is not the exact mode's model: the mathematics did change
    assert _relative_error(trained, _local_sgd_reference(STEPS, every=1, warmup=0)) > 1e-4

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == KINDS
    assert all(r["boards"] == ["l1", "l2"] and r["n"] == sum(BATCHES) and r["loss"] is not None for r in records)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["sync_every"] == EVERY and result["sync_warmup"] == WARMUP and "local SGD" in result["mode"]
    # Only exact and sync steps carried vectors: 4 of the 8 steps, each board's fp32 vector once.
    params = sum(t.numel() for t in trained.values() if t.is_floating_point())
    assert result["exchange_bytes_in"] == 4 * len(BATCHES) * params * 4
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["sync_every"] == EVERY and config["sync_warmup"] == WARMUP
    assert JobSpec.from_json(config).sync_schedule == SyncSchedule(every=EVERY, warmup=WARMUP,
                                                                   steps_per_epoch=config["steps_per_epoch"],
                                                                   total_steps=STEPS)


def test_requests_periodic_averaging_cannot_honour_are_refused_with_the_way_out() -> None:
    with pytest.raises(ConfigError, match=r"--sync-every 0: give a whole number of steps >= 1"):
        JobSpec(model="lenet5", dataset="digits", sync_every=0)
    with pytest.raises(ConfigError, match=r"--sync-warmup -1"):
        JobSpec(model="lenet5", dataset="digits", sync_every=2, sync_warmup=-1)
    with pytest.raises(ConfigError, match=r"--sync-every 4 with --accumulate-grad-batches 2: .* use one or the other"):
        JobSpec(model="lenet5", dataset="digits", sync_every=4, accumulate_grad_batches=2)

    from edgefleet.coordinator.run.replica import Replica
    from tests.conformance.modules import PlateauNet

    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau .* use --sync-every 1"):
        Replica(PlateauNet(), sync=SyncSchedule(every=3, warmup=2, steps_per_epoch=10, total_steps=20))


def test_the_cli_refuses_sync_every_0_before_touching_the_fleet(fleet_key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgefleet.coordinator.cli.main import main

    code = main(train_args("--sync-every", "0", broker="127.0.0.1:1", fleet_key=fleet_key, boards="x"))
    assert code != 0
    assert "--sync-every 0: give a whole number of steps >= 1" in capsys.readouterr().err


def test_the_replica_takes_no_step_between_averages_and_checkpoints_the_last_average() -> None:
    """Exact step 0, local steps 1-2, sync step 3 (every 3 after 1): a StepLR halves the rate every 3 steps."""
    from edgefleet.coordinator.run.replica import Replica
    from tests.conformance.modules import StepSchedulerNet

    torch.manual_seed(SEED)
    replica = Replica(StepSchedulerNet(), batches_per_epoch=10, total_steps=6,
                      sync=SyncSchedule(every=3, warmup=1, steps_per_epoch=10, total_steps=6))
    try:
        size = replica.param_count
        replica.apply(np.full(size, 0.1, np.float32))  # exact: lr 0.1 x gradient 0.1
        after_exact = {k: v.clone() for k, v in replica.model.state_dict().items()}
        replica.apply(np.zeros(0, np.float32))  # local steps 1 and 2 (the scheduler halves the rate after step 2)
        replica.apply(np.zeros(0, np.float32))
        assert all(torch.equal(v, after_exact[k]) for k, v in replica.model.state_dict().items())
        saved = replica.state_dict()
        assert saved["step"] == 1 and saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1)
        assert replica.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # the run itself moved on
        delta = np.linspace(-1, 1, size, dtype=np.float32)
        replica.apply(delta)  # sync step 3: the model becomes itself minus the average delta
        flat = torch.cat([p.detach().reshape(-1) for p in replica.params])
        expected = torch.cat([v.reshape(-1) for v in after_exact.values()]) - torch.from_numpy(delta)
        assert torch.equal(flat, expected)
        assert replica.state_dict()["step"] == 4
    finally:
        replica.close()


# ------------------------------------------------------------------------------------------ hostile frames

ELEMENTS = 6


class _RawBoard(threading.Thread):
    """A board on a raw socket that sends, per step, a full vector or an empty one as told (a hostile one too)."""

    def __init__(self, port: int, board: str, plan: list[int]) -> None:
        super().__init__(daemon=True)
        self.port, self.board, self.plan = port, board, plan
        self.results: list[np.ndarray] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                send_frame(sock, Hello(job_id="job", board_id=self.board, token="secret", param_count=ELEMENTS).to_wire())
                decode_hello_reply(recv_frame(sock))
                for step, size in enumerate(self.plan):
                    vector = np.full(size, 0.5 if self.board == "b1" else 1.0, np.float32)
                    n = 16 if step == 2 else 8  # step 2 syncs steps 1 and 2 (8 samples each); step 3 only itself
                    send_frame(sock, Grad(step=step, n=n, loss=1.0, compute_s=0.01, g=encode_array(vector)).to_wire())
                    reply = recv_frame(sock)
                    elements = len(reply["g"]["data"]) // 4 if isinstance(reply.get("g"), dict) else 0
                    self.results.append(decode_step_reply(reply, elements=elements, dtype="float32").array.copy())
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_a_full_vector_on_a_local_step_or_an_empty_one_on_a_sync_step_is_refused_naming_board_and_step() -> None:
    sync = SyncSchedule(every=2, warmup=1, steps_per_epoch=100, total_steps=4)  # exact 0, local 1, sync 2, sync 3

    async def serve() -> tuple[list[Any], dict[str, list[str]]]:
        server = ExchangeServer(job_id="job", token="secret", boards=[("b0", 8), ("b1", 8)], param_count=ELEMENTS,
                                wire_dtype="float32", welcome_state=lambda: (0, encode_value({}), encode_value({})),
                                sync=sync)
        port = await server.start("127.0.0.1", 0)
        # b0 is hostile: a full vector at local step 1, an empty one at sync step 2.
        boards = [_RawBoard(port, "b0", [ELEMENTS, ELEMENTS, 0, ELEMENTS]), _RawBoard(port, "b1", [ELEMENTS, 0, ELEMENTS, ELEMENTS])]
        for board in boards:
            board.start()
        results = []
        try:
            await server.wait_for_boards(30, need={"b0", "b1"})
            for step in range(4):
                server.finished = step == 3
                results.append(await server.run_step(step, apply=lambda avg, result: None))
            flags = server.flags()
        finally:
            await server.close()
        for board in boards:
            board.join(10)
            assert board.error is None, board.error
        assert [len(r) for r in boards[1].results] == [ELEMENTS, 0, ELEMENTS, ELEMENTS]
        np.testing.assert_array_equal(boards[1].results[2], np.full(ELEMENTS, 0.5, np.float32))  # b1's delta alone
        return results, flags

    results, flags = asyncio.run(serve())
    assert [r.kind for r in results] == ["exact", "local", "sync", "sync"]
    assert results[0].contributors == results[3].contributors == ["b0", "b1"]
    assert results[1].contributors == ["b1"] and results[2].contributors == ["b1"]
    assert "board b0" in results[1].refused["b0"] and "step 1" in results[1].refused["b0"]
    assert "empty vector" in results[1].refused["b0"] and "local step" in results[1].refused["b0"]
    assert "board b0" in results[2].refused["b0"] and "step 2" in results[2].refused["b0"]
    assert f"full vector of {ELEMENTS} values" in results[2].refused["b0"]
    assert any("step 1: refused" in flag for flag in flags["b0"])
