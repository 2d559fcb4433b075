"""What a module's ``on_save_checkpoint`` adds is kept in ``checkpoint.pt`` and handed back on ``--resume``.

The module counts its steps in a plain attribute (not a buffer) and scales its gradients by it:
interrupted and resumed, the fleet must end where one uninterrupted plain Lightning run ends, which
it does only if the count came back to the replica and to every board.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.conformance.cases import CLASSIFICATION
from tests.conformance.conftest import BOARDS
from tests.conformance.reference import Case, lightning_reference, relative_l2
from tests.conformance.test_fleet_conformance import BATCHES, GLOBAL_BATCH, SEED, STEPS, TOLERANCE
from tests.helpers import coordinator, interrupt_after

CASE = Case("checkpoint_hooks", "tests.conformance.checkpoint_modules:WarmupCounterNet", {"lr": 0.1},
            dataset=CLASSIFICATION)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_what_on_save_checkpoint_keeps_comes_back_on_resume(fleet, tmp_path: Path) -> None:
    broker, key = fleet
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", broker.address, "train", "--fleet-key", str(key),
           "--boards", ",".join(BOARDS), "--batch", BATCHES, "--steps", str(STEPS), "--seed", str(SEED),
           "--threads", "1", "--no-rebalance", "--run-dir", str(run_dir), "--checkpoint-every", "1",
           "--model", CASE.model, "--model-options", "lr=0.1", "--dataset", str(CASE.dataset)]
    code, out, err = interrupt_after(cmd, lambda: _steps(run_dir), 4, what="4 steps before the interruption")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 4 <= stopped_at < STEPS
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert saved["replica"]["module"] == {"updates": saved["replica"]["step"]}

    resumed = coordinator("--broker", broker.address, "train", "--fleet-key", str(key), "--resume", str(run_dir),
                          timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    reference = lightning_reference(CASE, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference) <= TOLERANCE
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["replica"]["module"] == {"updates": STEPS}
