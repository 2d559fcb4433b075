"""Validation off the critical path (issue 38): the boards go on with the next epoch while the replica validates.

A module whose validation takes 0.8 s trains 20 steps of 10 an epoch on three boards. The step after
an epoch's end no longer waits for the validation (its result was in within a fraction of it), the
validation's figures still land in that epoch's last record, and the model is Lightning's (the
conformance cases run the same path). With ``--target-accuracy`` the boards go on too; the run ends after
the validation that reaches the target, and the steps the boards ran meanwhile are dropped: the model is
Lightning's stopped at that epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from tests.conformance.cases import CLASSIFICATION
from tests.conformance.fleet_cli import GLOBAL_BATCH, SEED, STEPS, TOLERANCE
from tests.conformance.reference import Case, fit_reference, lightning_reference, relative_l2, state_of
from tests.conformance.test_fleet_conformance import _train_here

CASE = Case("slow_validation", "tests.conformance.modules:SlowValidationNet", {"lr": 0.1, "val_s": 0.8},
            dataset=CLASSIFICATION)
EPOCH_STEPS = 10  # 240 samples in global batches of 24
# 120 samples: 5 steps an epoch (resnet_small on digits at 256 has 5 too), each validation longer than the 4 steps after it
SHORT = Case("slow_validation_short", CASE.model, CASE.model_options, dataset=CLASSIFICATION,
             dataset_options={"n": 120, "seed": 0})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_boards_do_not_wait_for_the_replicas_validation(fleet, tmp_path: Path) -> None:
    records = _records(_train_here(fleet, CASE, tmp_path / "run"))
    epoch_end = records[EPOCH_STEPS - 1]
    assert "val_metrics" in epoch_end and epoch_end["val_s"] >= 0.8  # validated, its figures in the epoch's record
    gaps = [records[i + 1]["elapsed_s"] - records[i]["elapsed_s"] for i in range(EPOCH_STEPS - 2, EPOCH_STEPS + 1)]
    assert max(gaps) < 0.4, gaps  # neither the epoch's last step nor the next waited for the 0.8 s validation
    assert [r["step"] for r in records] == list(range(len(records)))


def test_a_target_reached_while_the_boards_go_on_ends_the_run_at_that_epoch_with_lightnings_model(fleet, tmp_path: Path) -> None:
    # any accuracy reaches 1%: the first epoch's validation (0.8 s) ends the run, the boards having gone on meanwhile
    run_dir = _train_here(fleet, CASE, tmp_path / "run", target_accuracy=0.01, steps_done=EPOCH_STEPS)
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(EPOCH_STEPS))  # nothing recorded past the epoch that ended it
    epoch_end = records[-1]
    assert epoch_end["validated_s"] - epoch_end["elapsed_s"] >= 0.7, epoch_end  # its figures came after the step
    result = json.loads((run_dir / "result.json").read_text())
    assert result["target_reached"]["step"] == EPOCH_STEPS - 1 and not result["interrupted"]
    assert result["target_reached"]["elapsed_s"] == epoch_end["validated_s"]  # reached when it was known
    fleet_model = torch.load(run_dir / "model.pt", weights_only=True)
    reference = lightning_reference(CASE, steps=EPOCH_STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(fleet_model, reference) <= TOLERANCE  # the steps run past it never reached the model


# The module's own on_validation_end takes 1 s, after the replica's callback decided the stop: the run's steps go on
# meanwhile, their queue far from full (the validation itself is instant)
LATE_END = Case("slow_validation_end", CASE.model, {"lr": 0.1, "val_s": 0.0, "end_s": 1.0}, dataset=CLASSIFICATION)


def test_steps_run_while_the_replica_ends_after_reaching_the_target_are_dropped_not_run_twice(fleet, tmp_path: Path) -> None:
    """A step the run gave the replica after its Trainer stopped was not counted, and the run ran that step's number
    again: the boards, a step ahead, were refused (a grad for step 12 while the exchange is at step 11), and the run
    failed (one CI run). Now the run ends at the stop, with Lightning's model of that epoch."""
    run_dir = _train_here(fleet, LATE_END, tmp_path / "run", target_accuracy=0.01, steps_done=EPOCH_STEPS)
    assert [r["step"] for r in _records(run_dir)] == list(range(EPOCH_STEPS))
    result = json.loads((run_dir / "result.json").read_text())
    assert result["target_reached"]["step"] == EPOCH_STEPS - 1 and not result["interrupted"]
    fleet_model = torch.load(run_dir / "model.pt", weights_only=True)
    reference = lightning_reference(LATE_END, steps=EPOCH_STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(fleet_model, reference) <= TOLERANCE


class _ValidationFigures(pl.Callback):
    """Each validation's accuracy, as plain Lightning reports it."""

    def __init__(self) -> None:
        self.accuracies: list[float] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.accuracies.append(float(trainer.callback_metrics["val_acc"]))


def test_short_epochs_validate_one_at_a_time_off_the_steps_with_lightnings_figures(fleet, tmp_path: Path) -> None:
    records = _records(_train_here(fleet, SHORT, tmp_path / "run"))
    assert [r["step"] for r in records] == list(range(STEPS))
    ends = [r for r in records if "val_metrics" in r]
    assert [r["step"] for r in ends] == [4, 9, 14, 19]
    assert ends[0]["validated_s"] - ends[0]["elapsed_s"] >= 0.7  # the boards went on while the replica validated
    seen = _ValidationFigures()
    model, _ = fit_reference(SHORT, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, callbacks=[seen])
    # each epoch's own figures: the next epoch's end waited for the validation before it, never overtook it
    assert [r["val_metrics"]["val_acc"] for r in ends] == pytest.approx(seen.accuracies, abs=1e-6)
    fleet_model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert relative_l2(fleet_model, state_of(model)) <= TOLERANCE
