"""Audits by recomputation, and robust aggregation, through real agents, a real broker and the real CLI (issue 36, item 2).

A board holding valid keys sends, from step 3 on, a gradient 2,000 times the honest one, or the honest one
turned around (the same norm; its reported loss stays honest). The coordinator audits each board at least
once every 2 steps, finds it, leaves it out and rolls the run back to step 0: the model the run ends with
is the one the honest boards train alone, which is single-process training on the same global batches
(within 1e-5). Honest boards pass every audit: a run audited at every step equals single-process training.

With local data the boards cannot be audited; ``--aggregate median`` keeps the 2,000x board from wrecking the
model, which it takes to chance with the mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import Fleet
from tests.helpers import max_relative_error, plain_lenet_training

SEED = 5
STEPS = 10
JOB = {"model": "tests.hostile.lying_module:LyingLeNet", "model_options": "optimizer=sgd,lr=0.05", "dataset": "digits",
       "seed": SEED, "threads": 1}
LIARS = {"scaler": "scale:2000:3", "flipper": "flip::3"}

pytestmark = pytest.mark.fleet(boards={"h1": {}, "h2": {}, **{b: {"env": {"EDGEFLEET_TEST_LIE": lie}} for b, lie in LIARS.items()}},
                               keep_worker=True)


def _train(fleet: Fleet, run_dir: Path, boards: str, batch: str, *args: str) -> tuple[str, dict]:
    run = fleet.train("--boards", boards, "--batch", batch, "--steps", str(STEPS), "--no-rebalance", *args,
                      run_dir=run_dir, timeout_s=240, **JOB)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in out, out
    return out, json.loads((run_dir / "result.json").read_text())


# The turned-around gradient only: the 2,000x one takes the same audit and rollback (the median test below runs its
# board, and tests/coordinator/test_audit_parts.py checks that an audit finds both), for 28 s more of the suite.
@pytest.mark.parametrize("liar", ["flipper"])
def test_a_board_that_lies_in_its_gradient_is_found_and_changes_the_model_by_nothing(fleet: Fleet, tmp_path: Path,
                                                                                    liar: str) -> None:
    run_dir = tmp_path / liar
    out, result = _train(fleet, run_dir, f"h1,h2,{liar}", "8,8,16", "--audit-every", "2")
    assert f"board {liar} failed its audit at step" in out, out
    assert "rolled the run back to step 0" in out, out
    assert out.count("\naudits:") == 1, out  # the attempt after the rollback does not say it again
    rollback = result["audits"]["rollbacks"][0]
    assert rollback["boards_left"] == ["h1", "h2"] and rollback["batch_sizes"] == [16, 16], rollback
    failure = rollback["failures"][0]
    assert failure["board_id"] == liar and 3 <= failure["step"] <= 4 and failure["part"] == "gradient", failure
    if liar == "scaler":
        assert failure["scale"] > 1000, failure
    else:
        assert failure["distance"] > 1.5 and abs(failure["scale"] - 1) < 1e-3, failure
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert max_relative_error(model, plain_lenet_training(STEPS, 32, seed=SEED)) <= 1e-5
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS)) and all(s["boards"] == ["h1", "h2"] for s in steps)
    assert json.loads((run_dir / "config.json").read_text())["boards"] == ["h1", "h2"]  # a later --resume leaves it out


def test_honest_boards_audited_at_every_step_train_the_single_process_model(fleet: Fleet, tmp_path: Path) -> None:
    out, result = _train(fleet, tmp_path / "honest", "h1,h2", "8,24", "--audit-every", "1")
    assert "failed its audit" not in out, out
    audits = result["audits"]
    assert audits["audited"] and audits["passed"] == {"h1": STEPS, "h2": STEPS} and audits["rollbacks"] == [], audits
    model = torch.load(tmp_path / "honest" / "model.pt", weights_only=True)
    assert max_relative_error(model, plain_lenet_training(STEPS, 32, seed=SEED)) <= 1e-5




LOCAL_STEPS = 90


def _local(fleet: Fleet, run_dir: Path, *args: str) -> tuple[str, float | None]:
    """A run with local data on h1, h2 and the 2,000x board: its output, and its validation accuracy if it ended."""
    run = fleet.train("--boards", "h1,h2,scaler", "--batch", "32", "--steps", str(LOCAL_STEPS), "--data-mode", "local",
                      *args, run_dir=run_dir, timeout_s=240, **JOB)
    out = run.stdout + run.stderr
    assert "Traceback" not in out and "the boards' gradients are not audited: in --data-mode local" in out, out
    result = run_dir / "result.json"
    return out, float(json.loads(result.read_text())["val_accuracy"]) if run.returncode == 0 and result.exists() else None


def test_with_local_data_the_median_keeps_a_lying_board_from_wrecking_the_model(fleet: Fleet, tmp_path: Path) -> None:
    """Not audited (local data): with the mean the 2,000x board throws the model off until no board's gradient is
    plausible and the run stops; with the median it trains (docs/security.md has the rules' accuracy against runs
    without the liar)."""
    out, mean = _local(fleet, tmp_path / "mean")
    assert mean is None or mean < 0.3, (mean, out)
    out, median = _local(fleet, tmp_path / "median", "--aggregate", "median")
    assert "robust aggregation: each step's gradient is the boards' median" in out, out
    assert median is not None and median > 0.6, (median, out)
