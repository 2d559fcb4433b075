"""Every conformance case on a real fleet: three agents, a real Mosquitto, the coordinator's training.

The trained cases run the coordinator's ``train`` (what the CLI calls) in this process, which has
imported torch and Lightning once (5 s a run saved); the refusals and the flags' own tests run the
real CLI.

Each case either trains, on three boards with unequal batches (4/8/12), the same parameters as
plain single-process Lightning on the same global batches of 24 (``reference.lightning_run``;
relative L2 difference <= 1e-5 after 20 steps over parameters and float buffers, integer buffers
equal; BatchNorm against DDP's rule; bf16-mixed within half of what bf16 changes at all), and
reports what Lightning logs, or is refused before any board starts, with a message that names the
feature. A case whose claim is reproducibility (dropout) gives the same bits twice with one seed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance.cases import CASES, REFUSED, SEEDED
from tests.conformance.conftest import BOARDS
from tests.conformance.fleet_cli import BATCHES, GLOBAL_BATCH, SEED, STEPS, TOLERANCE, cli_command
from tests.conformance.reference import (
    Case,
    ReferenceRun,
    ddp_amp_reference,
    ddp_reference,
    initial_state,
    integer_mismatches,
    lightning_reference,
    lightning_run,
    relative_l2,
)
from tests.conftest import Fleet

# Features the fleet cannot train exactly yet: refused before start, naming them.
NOT_YET: dict[str, tuple[str, ...]] = {}
# BatchNorm normalises with each board's own slice: the reference is DDP's rule, not one process.
DDP_RULE = ("batchnorm", "batchnorm_cumulative")
# What Lightning logs that result.json must report alike (train_metrics, or val_metrics for val_*), within a
# relative tolerance: an epoch's mean is the mean of the global batches' losses, not a board's or the last step's.
LOGGED: dict[str, dict[str, float]] = {
    "epoch_outputs": {"training_epoch_mean": 1e-6},
    "epoch_mean_log": {"train_loss": 1e-6},
    "datamodule_transfer_hooks": {"val_loss": 1e-5, "val_acc": 1e-6},  # validation batches go through the hooks
    "module_transfer_hooks": {"val_loss": 1e-5},
    "val_torchmetric": {"val_loss": 1e-5, "val_acc": 1e-6},
}
def _train_here(fleet: Fleet, case: Case, run_dir: Path, *, seed: int = SEED, steps_done: int = STEPS, **spec: Any) -> Path:
    """Train ``case`` with the coordinator's ``train`` in this process, as ``_train`` does with the CLI; its run directory.

    ``spec``: more of the job's fields (``JobSpec``'s names: ``sync_buffers="average"``, ``overlap=True``, ...).
    ``steps_done``: the steps the run ends after (fewer than ``STEPS`` where a target accuracy ends it).

    What a run sets process-wide (torch's threads, ``deterministic``'s global flag) is put back afterwards.
    """
    from edgefleet.coordinator.run.job_spec import JobSpec
    from edgefleet.coordinator.run.train_job import train
    from edgefleet.transport.fleet_key import load_fleet_key
    from edgefleet.transport.settings import BrokerSettings

    job = JobSpec(model=case.model, model_options=case.model_options, dataset=case.dataset or "",
                   dataset_options=case.dataset_options if case.dataset else {}, datamodule=case.datamodule or "",
                   datamodule_options=case.datamodule_options, boards=BOARDS,
                   batch_sizes=tuple(int(b) for b in BATCHES.split(",")), steps=STEPS, seed=seed, threads=1,
                   rebalance=False, **case.trainer, **spec)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        outcome = train(job, broker=BrokerSettings(host=fleet.broker.host, port=fleet.broker.port),
                        fleet_key=load_fleet_key(fleet.key), run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert not outcome.interrupted and outcome.result["steps"] == steps_done
    return run_dir


def _train(fleet: Fleet, case: Case, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(fleet, case, run_dir, *extra), capture_output=True, text=True, timeout=300)


TRAINED = [case for case in CASES if case.name not in NOT_YET]
REFUSED_NOW = [(case, words) for case, words in REFUSED] + [(case, NOT_YET[case.name]) for case in CASES
                                                             if case.name in NOT_YET]


def _ema_follows_lightning(fleet: dict[str, torch.Tensor], run: ReferenceRun, initial: dict[str, torch.Tensor]) -> None:
    ema = {k: v for k, v in run.state.items() if k.startswith("ema_")}
    assert ema and relative_l2(fleet, ema) <= TOLERANCE


def _frozen_layer_unchanged(fleet: dict[str, torch.Tensor], run: ReferenceRun, initial: dict[str, torch.Tensor]) -> None:
    frozen = [k for k in initial if k.startswith("backbone.")]
    assert frozen and all(torch.equal(fleet[k], initial[k]) for k in frozen)


def _weights_stay_tied(fleet: dict[str, torch.Tensor], run: ReferenceRun, initial: dict[str, torch.Tensor]) -> None:
    assert torch.equal(fleet["embed.weight"], fleet["head.weight"])


# Claims about one part of the final state, beyond the whole state's tolerance: (fleet, reference, initial).
STATE_CLAIMS: dict[str, Callable[[dict[str, torch.Tensor], ReferenceRun, dict[str, torch.Tensor]], None]] = {
    "ema": _ema_follows_lightning,
    "frozen_layer": _frozen_layer_unchanged,
    "tied_weights": _weights_stay_tied,
}


@pytest.mark.parametrize("case", TRAINED, ids=[case.name for case in TRAINED])
def test_the_fleet_trains_what_lightning_trains(fleet, case: Case, tmp_path: Path) -> None:
    run_dir = _train_here(fleet, case, tmp_path / case.name)
    fleet_model = torch.load(run_dir / "model.pt", weights_only=True)
    amp = None
    if case.name in DDP_RULE:
        run = ReferenceRun(ddp_reference(case, steps=STEPS, batch_sizes=[int(b) for b in BATCHES.split(",")], seed=SEED), {})
    elif case.trainer.get("precision") == "16-mixed":  # one loss scale, a step skipped on every board alike: DDP's rule
        amp = ddp_amp_reference(case, steps=STEPS, batch_sizes=[int(b) for b in BATCHES.split(",")], seed=SEED)
        run = ReferenceRun(amp.state, {})
    else:
        run = lightning_run(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    reference = run.state
    if case.trainer.get("precision") == "bf16-mixed":
        # bfloat16 rounds a slice's activations unlike the whole batch's: not fp32's 1e-5, but well within what
        # bf16 changes at all (and a board that ignored --precision would land on the fp32 result instead).
        fp32 = lightning_reference(dataclasses.replace(case, trainer={}), steps=STEPS, global_batch=GLOBAL_BATCH,
                                   seed=SEED)
        assert relative_l2(fleet_model, reference) <= 0.5 * relative_l2(reference, fp32)
    else:
        assert relative_l2(fleet_model, reference) <= TOLERANCE
    assert integer_mismatches(fleet_model, reference) == []  # num_batches_tracked, figures kept in int buffers
    if case.name in STATE_CLAIMS:
        STATE_CLAIMS[case.name](fleet_model, run, initial_state(case, seed=SEED))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS)) and all(s["boards"] == list(BOARDS) for s in steps)
    if amp is not None:  # the same steps skipped, the same scale at the end (checkpoint.pt keeps it for --resume)
        assert amp.skipped and [s["step"] for s in steps if s.get("overflowed")] == amp.skipped
        checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)["replica"]
        assert checkpoint["loss_scale"]["scale"] == amp.scaler["scale"]
    if case.name in LOGGED:
        result = json.loads((run_dir / "result.json").read_text())
        for name, rel in LOGGED[case.name].items():
            reported = result["val_metrics" if name.startswith("val_") else "train_metrics"]
            assert name in reported, (name, result)
            assert reported[name] == pytest.approx(run.metrics[name], rel=rel), name


@pytest.mark.parametrize(("case", "words"), REFUSED_NOW, ids=[case.name for case, _ in REFUSED_NOW])
def test_what_the_fleet_cannot_train_exactly_is_refused_before_start(fleet, case: Case, words: tuple[str, ...],
                                                                     tmp_path: Path) -> None:
    run_dir = tmp_path / case.name
    done = _train(fleet, case, run_dir)
    assert done.returncode == 1, done.stderr + done.stdout
    assert all(word in done.stderr for word in words) and "Traceback" not in done.stderr, done.stderr
    assert "waiting for" not in done.stdout  # no board was sent the job
    assert not (run_dir / "metrics.jsonl").exists()


def test_batchnorm_statistics_can_be_averaged_instead(fleet, tmp_path: Path) -> None:
    case = next(case for case in CASES if case.name == "batchnorm")
    broadcast = torch.load(_train_here(fleet, case, tmp_path / "broadcast") / "model.pt", weights_only=True)
    averaged = torch.load(_train_here(fleet, case, tmp_path / "average", sync_buffers="average") / "model.pt",
                          weights_only=True)
    weights = [k for k in broadcast if "running" not in k and broadcast[k].is_floating_point()]
    assert all(torch.equal(broadcast[k], averaged[k]) for k in weights)  # training does not use them
    assert not torch.allclose(broadcast["net.1.running_mean"], averaged["net.1.running_mean"])


def test_logged_metrics_reach_the_result_and_tensorboard(fleet, tmp_path: Path) -> None:
    case = next(case for case in CASES if case.name == "logged_metrics")
    run_dir = tmp_path / "logged"
    done = _train(fleet, case, run_dir, "--logger", "tensorboard", "--log-every-n-steps", "5")
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert {"val_loss", "val_acc"} <= set(result["val_metrics"]) and result["val_accuracy"] == result["val_metrics"]["val_acc"]
    assert "train_loss" not in result["val_metrics"]  # a training value, in train_metrics
    events = list((run_dir / "logs").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"val_loss", "val_acc", "fleet_loss", "train_loss"} <= set(scalars)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # training_step's self.log("train_loss", loss) on three boards, weighted by their samples: the fleet's loss
    assert all(s["logs"]["train_loss"] == pytest.approx(s["loss"], rel=1e-6) for s in steps)
    assert result["train_metrics"]["train_loss"] == pytest.approx(steps[-1]["loss"], rel=1e-6)


@pytest.mark.parametrize("case", SEEDED, ids=[case.name for case in SEEDED])
def test_one_seed_gives_the_same_bits_twice(fleet, case: Case, tmp_path: Path) -> None:
    """Dropout masks come from each board's generator: no single process draws them alike, but a run is
    reproducible: the same --seed and split give bit-identical weights, another seed other weights."""
    first, second = (torch.load(_train_here(fleet, case, tmp_path / name) / "model.pt", weights_only=True)
                     for name in ("first", "second"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # The masks took part: the same start without dropout (plain Lightning, p=0) ends elsewhere.
    without = dataclasses.replace(case, model_options={**case.model_options, "p": 0.0})
    assert relative_l2(first, lightning_reference(without, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)) > 1e-3
    other = torch.load(_train_here(fleet, case, tmp_path / "other", seed=SEED + 1) / "model.pt", weights_only=True)
    assert any(not torch.equal(first[k], other[k]) for k in first)
