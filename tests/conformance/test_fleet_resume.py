"""Ctrl-C mid-epoch, then ``--resume``: every board re-enters Lightning's loop where it stopped.

A per-step scheduler and gradient accumulation with a short last window make the position count:
the epoch, the batch within it, the accumulation window and the scheduler's state must all
continue as in one uninterrupted plain Lightning run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conformance.cases import CLASSIFICATION, SMALL
from tests.conformance.fleet_cli import GLOBAL_BATCH, SEED, STEPS, TOLERANCE, interrupt_then_resume
from tests.conformance.reference import Case, lightning_reference, relative_l2

CASE = Case("resume", "tests.conformance.modules:StepSchedulerNet", {"lr": 0.1}, dataset=CLASSIFICATION,
            dataset_options=SMALL, trainer={"accumulate_grad_batches": 2})


def test_a_run_interrupted_mid_epoch_resumes_to_lightnings_result(fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    interrupt_then_resume(fleet, CASE, run_dir)
    reference = lightning_reference(CASE, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference) <= TOLERANCE
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["replica"]["schedulers"][0]["last_epoch"] == STEPS  # StepLR stepped at every optimizer step
