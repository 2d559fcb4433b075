"""Ctrl-C, then ``--resume``, with BatchNorm's ``momentum=None``: its running statistics are a cumulative
average over ``num_batches_tracked`` batches, so the integer buffer must come back from the checkpoint with
the float ones. The resumed run ends where the uninterrupted one does under DDP's rule (``ddp_reference``):
floats within the suite's tolerance, integer buffers equal.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conformance.cases import CASES
from tests.conformance.fleet_cli import BATCHES, SEED, STEPS, TOLERANCE, interrupt_then_resume
from tests.conformance.reference import ddp_reference, integer_mismatches, relative_l2

CASE = next(case for case in CASES if case.name == "batchnorm_cumulative")


def test_cumulative_batchnorm_resumes_to_the_uninterrupted_result(fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    interrupt_then_resume(fleet, CASE, run_dir)
    reference = ddp_reference(CASE, steps=STEPS, batch_sizes=[int(b) for b in BATCHES.split(",")], seed=SEED)
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert relative_l2(model, reference) <= TOLERANCE
    assert integer_mismatches(model, reference) == []
    assert int(model["net.1.num_batches_tracked"]) == STEPS
