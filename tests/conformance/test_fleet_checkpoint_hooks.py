"""What a module's ``on_save_checkpoint`` adds is kept in ``checkpoint.pt`` and handed back on ``--resume``.

The module counts its steps in a plain attribute (not a buffer) and scales its gradients by it:
interrupted and resumed, the fleet must end where one uninterrupted plain Lightning run ends, which
it does only if the count came back to the replica and to every board.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conformance.cases import CLASSIFICATION
from tests.conformance.fleet_cli import GLOBAL_BATCH, SEED, STEPS, TOLERANCE, interrupt_then_resume
from tests.conformance.reference import Case, lightning_reference, relative_l2

CASE = Case("checkpoint_hooks", "tests.conformance.checkpoint_modules:WarmupCounterNet", {"lr": 0.1},
            dataset=CLASSIFICATION)


def test_what_on_save_checkpoint_keeps_comes_back_on_resume(fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    interrupted = interrupt_then_resume(fleet, CASE, run_dir)
    assert interrupted["module"] == {"updates": interrupted["step"]} and interrupted["step"] > 0
    reference = lightning_reference(CASE, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference) <= TOLERANCE
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["replica"]["module"] == {"updates": STEPS}
