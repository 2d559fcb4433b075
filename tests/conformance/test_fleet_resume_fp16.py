"""16-mixed interrupted while its loss scale is still coming down, then ``--resume``: the scale continues.

The loss's gain makes steps 0-5 overflow on some board at 4/8/12 (DDP's rule skips each on every
board and halves the scale); the run is stopped after step 4 or a little later. A resumed run that
restarted the scale at 2**16 would skip steps the uninterrupted run takes, and land elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conformance.cases import CASES
from tests.conformance.fleet_cli import BATCHES, SEED, STEPS, TOLERANCE, interrupt_then_resume, steps_of
from tests.conformance.reference import ddp_amp_reference, relative_l2

CASE = next(case for case in CASES if case.name == "fp16_mixed")


def test_a_16_mixed_run_resumes_at_the_fleets_loss_scale(fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    checkpointed = interrupt_then_resume(fleet, CASE, run_dir)
    reference = ddp_amp_reference(CASE, steps=STEPS, batch_sizes=[int(b) for b in BATCHES.split(",")], seed=SEED)
    assert checkpointed["loss_scale"]["scale"] < 2.0 ** 16  # checkpointed after the scale came down
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference.state) <= TOLERANCE
    assert [s["step"] for s in steps_of(run_dir) if s.get("overflowed")] == reference.skipped
