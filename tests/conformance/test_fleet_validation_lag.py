"""Validation off the critical path (issue 38): the boards go on with the next epoch while the replica validates.

A module whose validation takes 0.8 s trains 20 steps of 10 an epoch on three boards. The step after
an epoch's end no longer waits for the validation (its result was in within a fraction of it), the
validation's figures still land in that epoch's last record, and the model is Lightning's (the
conformance cases run the same path). With ``--target-accuracy`` the decision needs the figures,
so the run waits for them as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conformance.cases import CLASSIFICATION
from tests.conformance.reference import Case
from tests.conformance.test_fleet_conformance import _train_here

CASE = Case("slow_validation", "tests.conformance.modules:SlowValidationNet", {"lr": 0.1, "val_s": 0.8},
            dataset=CLASSIFICATION)
EPOCH_STEPS = 10  # 240 samples in global batches of 24


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_boards_do_not_wait_for_the_replicas_validation(fleet, tmp_path: Path) -> None:
    records = _records(_train_here(fleet, CASE, tmp_path / "run"))
    epoch_end = records[EPOCH_STEPS - 1]
    assert "val_metrics" in epoch_end and epoch_end["val_s"] >= 0.8  # validated, its figures in the epoch's record
    gaps = [records[i + 1]["elapsed_s"] - records[i]["elapsed_s"] for i in range(EPOCH_STEPS - 2, EPOCH_STEPS + 1)]
    assert max(gaps) < 0.4, gaps  # neither the epoch's last step nor the next waited for the 0.8 s validation
    assert [r["step"] for r in records] == list(range(len(records)))


def test_a_target_accuracy_waits_for_the_validation_it_decides_on(fleet, tmp_path: Path) -> None:
    records = _records(_train_here(fleet, CASE, tmp_path / "run", target_accuracy=0.999))
    gap = records[EPOCH_STEPS - 1]["elapsed_s"] - records[EPOCH_STEPS - 2]["elapsed_s"]
    assert gap >= 0.8, gap  # the epoch's last step waited for its validation
