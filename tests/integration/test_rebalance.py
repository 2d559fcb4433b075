"""Re-splitting the global batch during a run, through real agents, a real broker and the real CLI.

The global batch of every step stays the same samples however it is divided, so a run whose split
changes at step 8 trains the same model as one process on the whole batch (fp32 wire, SGD,
relative error <= 1e-5 after 20 steps, as in test_training.py). The split is forced with the
train command's test hook ``--force-split STEP:B,B,…`` and ``--no-rebalance`` keeps the timing-driven
re-balancer out, so that the schedule is known in advance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from edgefleet.coordinator.exchange.server import SPLIT_LEAD_STEPS
from tests.conftest import Fleet
from tests.helpers import interrupt_after, max_relative_error, plain_lenet_training
from tests.integration.test_training import LENET_JOB, SEED

BOARDS = ("r1", "r2", "r3")

pytestmark = pytest.mark.fleet(boards=BOARDS, keep_worker=True)  # three training boards, shared; a job skips the worker's start


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_a_forced_resplit_at_step_8_trains_the_same_model_as_one_process(fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "resplit"

    done = fleet.train("--force-split", "8:20,20,8", boards=BOARDS, batch="8,16,24", steps=20, no_rebalance=True,
                       run_dir=run_dir, **LENET_JOB)

    assert done.returncode == 0, done.stderr + done.stdout
    reference = plain_lenet_training(20, 48, seed=SEED)
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert max_relative_error(model, reference) <= 1e-5
    lines = _lines(run_dir)
    assert [line["step"] for line in lines] == list(range(20))      # still one line per step
    announced_at = 8 - SPLIT_LEAD_STEPS - 1                          # the result of step 6 carried it
    assert [line["step"] for line in lines if "rebalance" in line] == [announced_at]
    rebalance = lines[announced_at]["rebalance"]
    assert rebalance["from_step"] == 8
    assert rebalance["old_batch_sizes"] == {"r1": 8, "r2": 16, "r3": 24}
    assert rebalance["new_batch_sizes"] == {"r1": 20, "r2": 20, "r3": 8}
    for line in lines:   # every board switched exactly at step 8, and every step had all 48 samples
        expected = {"r1": 8, "r2": 16, "r3": 24} if line["step"] < 8 else {"r1": 20, "r2": 20, "r3": 8}
        assert line["batch_sizes"] == expected and line["n"] == 48, line
    assert "step 5: re-balancing from step 8: forced re-split" in done.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert {b: r["batch_size"] for b, r in result["boards"].items()} == {"r1": 20, "r2": 20, "r3": 8}
    assert [r["from_step"] for r in result["rebalances"]] == [8]


def test_a_resumed_run_continues_with_the_split_in_force_at_its_checkpoint(fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    cmd = fleet.train_command("--force-split", "6:40,8", boards="r1,r2", batch="16,32", steps=30, checkpoint_every=5,
                              no_rebalance=True, run_dir=run_dir, **LENET_JOB)
    code, out, err = interrupt_after(cmd, lambda: len(_lines(run_dir)), 10, what="10 steps of the interrupted run")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 10 <= stopped_at < 30

    resumed = fleet.train(resume=run_dir, run_dir=run_dir, **LENET_JOB)

    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert "continuing with batch sizes 40,8" in resumed.stdout
    lines = _lines(run_dir)
    assert [line["step"] for line in lines] == list(range(30))
    assert all(line["batch_sizes"] == ({"r1": 16, "r2": 32} if line["step"] < 6 else {"r1": 40, "r2": 8})
               for line in lines), [line["batch_sizes"] for line in lines]
    assert [line["step"] for line in lines if "rebalance" in line] == [6 - SPLIT_LEAD_STEPS - 1]  # not announced twice
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert max_relative_error(model, plain_lenet_training(30, 48, seed=SEED)) <= 1e-5
