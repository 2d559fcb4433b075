"""DiLoCo (``--sync-every H --outer-optimizer diloco``) through real agents and a real broker, the coordinator's
service called in-process (``train_job.train``, what ``edge-coordinator train`` runs).

The fleet's result is compared with a one-process simulation written here in torch, apart from the
fleet's own numpy code (``workloads.outer_step``): exact steps on the global batch, then each board
stepping on its own slice of every global batch; at each sync step the boards' sample-weighted
average change D is the gradient of an outer SGD with Nesterov momentum on the last average.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgefleet.coordinator.cli.main import build_parser
from edgefleet.coordinator.cli.train_args import job_from_args
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import TrainObserver, train
from edgefleet.coordinator.run.training import StepView
from edgefleet.protocol.errors import ConfigError, DecodeError
from edgefleet.protocol.exchange_frames import Welcome
from edgefleet.protocol.jobs import OUTER_TRAIN_SCHEMA_VERSION, TrainCommand
from edgefleet.protocol.outer_optimizer import OuterOptimizer
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.transport.fleet_key import load_fleet_key
from edgefleet.transport.settings import BrokerSettings
from edgefleet.workloads.outer_step import OuterStep
from tests.conftest import Fleet
from tests.helpers import status_json, train_args, wait_until
from tests.integration.periodic_reference import periodic_reference

SEED = 7
BATCHES = (8, 16)
EVERY, WARMUP = 3, 2  # exact 0-1, then sync steps 4, 7, 10, 13 (and the run's last)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
LENET = {"optimizer": "sgd", "lr": 0.05}

pytestmark = pytest.mark.fleet(boards=("d1", "d2"), agent_args=("--interval", "0.2"), wait="online", keep_worker=True)


class _Observer(TrainObserver):
    """Keeps the run's notes; with ``stop_after``, interrupts the run (as Ctrl-C does) once that step is applied."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.notes: list[str] = []
        self.stop_after = stop_after

    def note(self, text: str) -> None:
        self.notes.append(text)

    def step(self, view: StepView) -> None:
        if self.stop_after is not None and view.step == self.stop_after:
            self.stop_after = None
            os.kill(os.getpid(), signal.SIGINT)  # the run's own handler: it stops at the next step boundary


def _diloco_reference(steps: int, *, lr: float, momentum: float, options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """One process: post-local SGD on each board's slice, the averages taken by Nesterov outer SGD (torch, per tensor)."""
    return periodic_reference(steps, every=EVERY, warmup=WARMUP, batches=BATCHES, seed=SEED, options=options or LENET,
                              outer=(lr, momentum))


def _relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def _job(*flags: str, steps: int, model_options: dict[str, Any] | None = None) -> JobSpec:
    args = build_parser().parse_args(train_args(
        "--sync-every", str(EVERY), "--sync-warmup", str(WARMUP), *flags, boards="d1,d2", batch=BATCHES, model="lenet5",
        model_options=model_options or LENET, dataset="digits", seed=SEED, threads=1, no_rebalance=True, steps=steps))
    return job_from_args(args)


def _idle(fleet: Fleet, board: str) -> bool:
    return bool(status_json(fleet.broker.address).get(board, {}).get("state") == "online")


def _train(fleet: Fleet, spec: JobSpec, run_dir: Path, observer: TrainObserver, *, resume: bool = False) -> bool:
    """Run (or resume) ``spec`` in ``run_dir``; whether it was interrupted."""
    outcome = train(spec, broker=BrokerSettings(host=fleet.broker.host, port=fleet.broker.port),
                    fleet_key=load_fleet_key(fleet.key), run_dir=run_dir, observer=observer, resume=resume)
    return outcome.interrupted


def test_a_diloco_fleet_trains_what_the_diloco_mathematics_gives(tmp_path: Path, fleet: Fleet) -> None:
    steps = 8
    spec = _job("--outer-optimizer", "diloco", steps=steps)  # outer lr 0.7 (the paper's) and momentum 0.5 by default
    assert (spec.outer_optimizer, spec.outer_lr, spec.outer_momentum) == ("diloco", OUTER_LR, OUTER_MOMENTUM)
    observer = _Observer()
    assert not _train(fleet, spec, tmp_path / "run", observer)
    assert any("DiLoCo" in note and "changes the mathematics" in note for note in observer.notes)

    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert _relative_error(trained, _diloco_reference(steps, lr=OUTER_LR, momentum=OUTER_MOMENTUM)) <= 1e-5
    # not plain periodic averaging's model: the outer step did change it
    assert _relative_error(trained, _diloco_reference(steps, lr=1.0, momentum=0.0)) > 1e-4

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (result["outer_optimizer"], result["outer_lr"], result["outer_momentum"]) == ("diloco", OUTER_LR, OUTER_MOMENTUM)
    assert "DiLoCo" in result["mode"]
    # The wire carries what local SGD's does: 4 vectors (exact 0, 1; sync 4, 7) per board, nothing more.
    params = sum(t.numel() for t in trained.values() if t.is_floating_point())
    assert result["exchange_bytes_in"] == 4 * len(BATCHES) * params * 4
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert JobSpec.from_json(config).sync_schedule.outer == OuterOptimizer(name="diloco", lr=OUTER_LR, momentum=OUTER_MOMENTUM)


def test_an_interrupted_diloco_run_resumes_to_the_uninterrupted_model(tmp_path: Path, fleet: Fleet) -> None:
    """The checkpoint keeps the outer momentum with the last average; every board gets it back in its welcome.

    The inner optimizer is plain SGD: a board's own optimizer state (momentum, Adam's moments) is not in the
    checkpoint in any periodic averaging mode (the replica's, from the last exact step, is what boards resume with).
    """
    steps, stateless = 11, {**LENET, "momentum": 0.0}
    spec = _job("--outer-optimizer", "diloco", "--outer-lr", "0.5", "--outer-momentum", "0.8", steps=steps,
                model_options=stateless)

    run_dir = tmp_path / "interrupted"
    assert _train(fleet, spec, run_dir, _Observer(stop_after=5))  # after sync step 4: the momentum is not zero
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert 4 < checkpoint["replica"]["step"] < steps
    assert float(checkpoint["replica"]["outer"]["momentum"].abs().max()) > 0
    for board in ("d1", "d2"):  # the interrupted run's workers end on their own time: resume once the boards are idle
        wait_until(functools.partial(_idle, fleet, board), timeout_s=60, what=f"{board} idle again")
    assert not _train(fleet, JobSpec.from_json(json.loads((run_dir / "config.json").read_text())), run_dir, _Observer(),
                      resume=True)

    # the uninterrupted run's model: the fleet trains what this simulation gives (the test above)
    resumed = torch.load(run_dir / "model.pt", weights_only=True)
    assert _relative_error(resumed, _diloco_reference(steps, lr=0.5, momentum=0.8, options=stateless)) <= 1e-5
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))  # from the last average on, no step lost or doubled


# ------------------------------------------------------------------------------------------ the maths, without a fleet


def test_outer_lr_1_and_momentum_0_is_periodic_averaging_bit_for_bit() -> None:
    from edgefleet.agent.local_sgd import ParameterAnchor
    from edgefleet.coordinator.run.replica import Replica
    from tests.conformance.modules import StepSchedulerNet

    rng = np.random.default_rng(0)
    anchor, delta = rng.standard_normal(50, dtype=np.float32), rng.standard_normal(58, dtype=np.float32)
    plain = anchor - delta[:50]
    stepped = anchor.copy()
    step = OuterStep(OuterOptimizer(name="diloco", lr=1.0, momentum=0.0), 40)  # 40 parameters, then 10 float buffers
    for _ in range(3):  # the momentum buffer (mu = 0) keeps nothing from one average to the next
        stepped, plain = stepped.copy(), plain.copy()
        step.apply(stepped, delta)
        assert np.array_equal(stepped, plain)
        plain -= delta[:50]

    # the board's anchor
    def board(outer: OuterStep | None) -> torch.Tensor:
        torch.manual_seed(SEED)
        tensors = [torch.randn(4, 5), torch.randn(3)]
        held = ParameterAnchor(tensors, outer=outer)
        held.take()
        for _ in range(2):
            held.apply(np.full(23, 0.25, np.float32))
        return torch.cat([t.reshape(-1) for t in tensors])

    assert torch.equal(board(OuterStep(OuterOptimizer(name="diloco", lr=1.0, momentum=0.0), 23)), board(None))

    # the coordinator's replica: exact step 0, local 1-2, sync 3, local 4, sync 5
    def replica(outer: OuterOptimizer) -> dict[str, torch.Tensor]:
        torch.manual_seed(SEED)
        held = Replica(StepSchedulerNet(), batches_per_epoch=10, total_steps=6,
                       sync=SyncSchedule(every=3, warmup=1, steps_per_epoch=10, total_steps=6, outer=outer))
        try:
            size = held.param_count
            for vector in (np.full(size, 0.1, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32),
                           np.linspace(-1, 1, size, dtype=np.float32), np.zeros(0, np.float32),
                           np.linspace(1, -0.5, size, dtype=np.float32)):
                held.apply(vector)
            return {k: v.clone() for k, v in held.model.state_dict().items()}
        finally:
            held.close()

    averaged = replica(OuterOptimizer())
    unit = replica(OuterOptimizer(name="diloco", lr=1.0, momentum=0.0))
    assert all(torch.equal(unit[k], averaged[k]) for k in averaged)
    assert any(not torch.equal(replica(OuterOptimizer(name="diloco"))[k], averaged[k]) for k in averaged)


def test_the_outer_step_is_nesterov_sgd_and_heavy_ball_on_request() -> None:
    anchor = np.array([1.0, 2.0, 5.0], np.float32)  # two parameters, one float buffer
    step = OuterStep(OuterOptimizer(name="diloco", lr=0.5, momentum=0.9), 2)
    step.apply(anchor, np.array([0.2, -0.4, 1.0], np.float32))    # m = D; update = D + 0.9 D = 1.9 D
    np.testing.assert_allclose(anchor, [1.0 - 0.5 * 0.38, 2.0 + 0.5 * 0.76, 4.0], rtol=1e-6)
    step.apply(anchor, np.array([0.1, 0.0, 0.0], np.float32))     # m = 0.9 m + D; update = D + 0.9 m
    m = 0.9 * 0.2 + 0.1
    np.testing.assert_allclose(anchor[0], 1.0 - 0.5 * 0.38 - 0.5 * (0.1 + 0.9 * m), rtol=1e-6)

    heavy = OuterStep(OuterOptimizer(name="sgd", lr=1.0, momentum=0.5), 1)
    value = np.array([0.0], np.float32)
    heavy.apply(value, np.array([1.0], np.float32))  # m = 1 -> -1
    heavy.apply(value, np.array([1.0], np.float32))  # m = 1.5 -> -2.5
    assert value[0] == pytest.approx(-2.5)


def test_the_outer_state_travels_in_the_welcome_and_is_checked() -> None:
    from edgefleet.protocol.codec import decode_value, encode_value

    step = OuterStep(OuterOptimizer(name="diloco"), 3)
    step.apply(np.zeros(3, np.float32), np.array([1.0, 2.0, 3.0], np.float32))
    welcome = Welcome(step=9, model={}, optimizer={}).with_fields({"outer_state": encode_value(step.state())})
    back = Welcome.from_wire(welcome.to_wire())
    joined = OuterStep(OuterOptimizer(name="diloco"), 3)
    joined.load_state(decode_value(back.outer_state))
    assert np.array_equal(joined.momentum, step.momentum)
    assert "outer_state" not in Welcome(step=0, model={}, optimizer={}).to_wire()  # other jobs' welcomes are unchanged

    with pytest.raises(DecodeError, match="momentum buffer of 3 values"):
        joined.load_state({"momentum": np.zeros(4, np.float32)})
    with pytest.raises(DecodeError, match="non-finite"):
        joined.load_state({"momentum": np.array([0.0, np.nan, 0.0], np.float32)})
    with pytest.raises(DecodeError, match="outer_state is a list"):
        Welcome.from_wire({**welcome.to_wire(), "outer_state": [1, 2]})


# ------------------------------------------------------------------------------------------ refused requests


@pytest.mark.parametrize(("options", "message"), [
    ({"outer_optimizer": "diloco"}, r"--outer-optimizer diloco steps on the boards' averaged change every H steps: add "
                                    r"--sync-every H"),
    ({"sync_every": 4, "outer_optimizer": "adam"}, r"--outer-optimizer 'adam': choose one of average, diloco, sgd"),
    ({"sync_every": 4, "outer_optimizer": "diloco", "outer_lr": 0.0}, r"--outer-lr 0.0: give a finite learning rate"),
    ({"sync_every": 4, "outer_optimizer": "diloco", "outer_lr": float("nan")}, r"--outer-lr nan"),
    ({"sync_every": 4, "outer_optimizer": "diloco", "outer_lr": 11.0}, r"--outer-lr 11.0"),
    ({"sync_every": 4, "outer_optimizer": "diloco", "outer_momentum": 1.0}, r"--outer-momentum 1.0: give a momentum in"),
    ({"sync_every": 4, "outer_optimizer": "diloco", "outer_momentum": -0.1}, r"--outer-momentum -0.1"),
])
def test_outer_settings_that_cannot_run_are_refused_naming_the_flag(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobSpec(model="lenet5", dataset="digits", **options)


def test_the_cli_refuses_diloco_without_sync_every_in_one_line(fleet_key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgefleet.coordinator.cli.main import main

    code = main(train_args("--outer-optimizer", "diloco", broker="127.0.0.1:1", fleet_key=fleet_key, boards="x"))
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "--outer-optimizer diloco steps on the boards' averaged change every H steps: add --sync-every H" in err


@pytest.mark.parametrize(("fields", "message"), [
    ({"outer_lr": float("inf")}, "outer_lr"),
    ({"outer_lr": -0.7}, "outer_lr -0.7"),
    ({"outer_momentum": 1.5}, "outer_momentum 1.5"),
    ({"outer_optimizer": "lamb"}, "outer_optimizer 'lamb'"),
    ({"sync_every": 1}, "needs sync_every > 1"),
    ({"schema_version": OUTER_TRAIN_SCHEMA_VERSION - 1}, f"needs schema_version {OUTER_TRAIN_SCHEMA_VERSION}"),
])
def test_the_agent_refuses_a_command_with_outer_settings_out_of_range(fields: dict[str, Any], message: str) -> None:
    base = TrainCommand(job_id="j", board_id="b", exchange_host="h", exchange_port=1, token="", model="lenet5",
                        dataset="digits", board_index=0, batch_sizes=[8], seed=0, total_steps=10, sync_every=4,
                        outer_optimizer="diloco").to_dict()
    with pytest.raises(DecodeError, match=message):
        TrainCommand.from_dict({**base, **fields})
