"""The conformance fleet's job as the real CLI runs it: one command line per case, and a run interrupted and resumed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from edgefleet.brokers.local_broker import LocalBroker
from tests.conformance.conftest import BOARDS
from tests.conformance.reference import Case
from tests.helpers import coordinator, interrupt_after

BATCHES = "4,8,12"
GLOBAL_BATCH = 24
STEPS = 20
SEED = 3
TOLERANCE = 1e-5
INTERRUPT_AFTER = 4  # steps before Ctrl-C: mid-run, mid-epoch for the small data sets
_FLAGS = {"gradient_clip_val": "--gradient-clip-val", "gradient_clip_algorithm": "--gradient-clip-algorithm",
          "accumulate_grad_batches": "--accumulate-grad-batches", "precision": "--precision"}


def options(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def cli_command(fleet: tuple[LocalBroker, Path], case: Case, run_dir: Path) -> list[str]:
    """``edge-coordinator train`` for ``case`` on the three boards at 4/8/12, ``STEPS`` steps, one torch thread."""
    broker, key = fleet
    cmd = [sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", broker.address, "train", "--fleet-key", str(key),
           "--boards", ",".join(BOARDS), "--batch", BATCHES, "--steps", str(STEPS), "--seed", str(SEED),
           "--threads", "1", "--no-rebalance", "--run-dir", str(run_dir), "--model", case.model,
           "--model-options", options(case.model_options)]
    if case.datamodule:
        cmd += ["--datamodule", case.datamodule, "--datamodule-options", options(case.datamodule_options)]
    else:
        cmd += ["--dataset", str(case.dataset), "--dataset-options", options(case.dataset_options)]
    for name, value in case.trainer.items():
        cmd += ["--deterministic"] if name == "deterministic" else [_FLAGS[name], str(value)]
    return cmd


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` records (none yet: [])."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def interrupt_then_resume(fleet: tuple[LocalBroker, Path], case: Case, run_dir: Path) -> dict[str, Any]:
    """Train ``case`` with a checkpoint every step, Ctrl-C it mid-run, then ``--resume`` it to the end.

    Returns the replica's state the interrupted run's ``checkpoint.pt`` held (``step``, ``model``, ``module``, ...).
    """
    import torch

    broker, key = fleet
    cmd = [*cli_command(fleet, case, run_dir), "--checkpoint-every", "1"]
    code, out, err = interrupt_after(cmd, lambda: len(steps_of(run_dir)), INTERRUPT_AFTER,
                                     what=f"{INTERRUPT_AFTER} steps before the interruption")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert INTERRUPT_AFTER <= stopped_at < STEPS
    checkpointed: dict[str, Any] = torch.load(run_dir / "checkpoint.pt", weights_only=True)["replica"]
    resumed = coordinator("--broker", broker.address, "train", "--fleet-key", str(key), "--resume", str(run_dir),
                          timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert [s["step"] for s in steps_of(run_dir)] == list(range(STEPS))
    return checkpointed
