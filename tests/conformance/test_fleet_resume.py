"""Ctrl-C mid-epoch, then ``--resume``: every board re-enters Lightning's loop where it stopped.

A per-step scheduler and gradient accumulation with a short last window make the position count:
the epoch, the batch within it, the accumulation window and the scheduler's state must all
continue as in one uninterrupted plain Lightning run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conformance.cases import CLASSIFICATION, SMALL
from tests.conformance.conftest import BOARDS
from tests.conformance.reference import Case, lightning_reference, relative_l2
from tests.conformance.test_fleet_conformance import BATCHES, GLOBAL_BATCH, SEED, STEPS, TOLERANCE
from tests.helpers import interrupt_after

CASE = Case("resume", "tests.conformance.modules:StepSchedulerNet", {"lr": 0.1}, dataset=CLASSIFICATION,
            dataset_options=SMALL, trainer={"accumulate_grad_batches": 2})


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_a_run_interrupted_mid_epoch_resumes_to_lightnings_result(fleet, tmp_path: Path) -> None:
    import torch

    broker, key = fleet
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", broker.address, "train", "--fleet-key", str(key),
           "--boards", ",".join(BOARDS), "--batch", BATCHES, "--steps", str(STEPS), "--seed", str(SEED),
           "--threads", "1", "--run-dir", str(run_dir), "--checkpoint-every", "1", "--model", CASE.model,
           "--model-options", "lr=0.1", "--dataset", str(CASE.dataset), "--dataset-options", "n=120,seed=0",
           "--accumulate-grad-batches", "2"]
    code, out, err = interrupt_after(cmd, lambda: len(_steps(run_dir)), 4, what="4 steps before the interruption")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 4 <= stopped_at < STEPS
    from tests.helpers import coordinator

    resumed = coordinator("--broker", broker.address, "train", "--fleet-key", str(key), "--resume", str(run_dir),
                          timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert [s["step"] for s in _steps(run_dir)] == list(range(STEPS))
    reference = lightning_reference(CASE, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference) <= TOLERANCE
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["replica"]["schedulers"][0]["last_epoch"] == STEPS  # StepLR stepped at every optimizer step
