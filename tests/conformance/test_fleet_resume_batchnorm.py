"""Ctrl-C, then ``--resume``, with BatchNorm's ``momentum=None``: its running statistics are a cumulative
average over ``num_batches_tracked`` batches, so the integer buffer must come back from the checkpoint with
the float ones. The resumed run ends where the uninterrupted one does under DDP's rule (``ddp_reference``):
floats within the suite's tolerance, integer buffers equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.conformance.cases import CASES
from tests.conformance.conftest import BOARDS
from tests.conformance.reference import ddp_reference, integer_mismatches, relative_l2
from tests.conformance.test_fleet_conformance import BATCHES, SEED, STEPS, TOLERANCE, _options
from tests.helpers import coordinator, interrupt_after

CASE = next(case for case in CASES if case.name == "batchnorm_cumulative")


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_cumulative_batchnorm_resumes_to_the_uninterrupted_result(fleet, tmp_path: Path) -> None:
    broker, key = fleet
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", broker.address, "train", "--fleet-key", str(key),
           "--boards", ",".join(BOARDS), "--batch", BATCHES, "--steps", str(STEPS), "--seed", str(SEED),
           "--threads", "1", "--no-rebalance", "--run-dir", str(run_dir), "--checkpoint-every", "1",
           "--model", CASE.model, "--model-options", _options(CASE.model_options),
           "--dataset", str(CASE.dataset), "--dataset-options", _options(CASE.dataset_options)]
    code, out, err = interrupt_after(cmd, lambda: len(_steps(run_dir)), 4, what="4 steps before the interruption")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 4 <= stopped_at < STEPS
    resumed = coordinator("--broker", broker.address, "train", "--fleet-key", str(key), "--resume", str(run_dir),
                          timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert [s["step"] for s in _steps(run_dir)] == list(range(STEPS))
    reference = ddp_reference(CASE, steps=STEPS, batch_sizes=[int(b) for b in BATCHES.split(",")], seed=SEED)
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert relative_l2(model, reference) <= TOLERANCE
    assert integer_mismatches(model, reference) == []
    assert int(model["net.1.num_batches_tracked"]) == STEPS
