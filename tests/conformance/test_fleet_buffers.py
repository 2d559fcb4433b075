"""Integer buffers on a real fleet: DDP's rule, every board and the replica hold the first board's, every step.

BatchNorm's ``num_batches_tracked`` and a user's counter must reach ``model.pt`` and the checkpoint
as the first contributing board (batch 4) advanced them; with ``momentum=None`` BatchNorm divides
by that count, so a resumed run that lost it would drift from an uninterrupted one
(``test_fleet_resume_batchnorm.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance.cases import CLASSIFICATION, SMALL
from tests.conformance.fleet_cli import BATCHES, STEPS
from tests.conformance.reference import Case
from tests.conformance.test_fleet_conformance import _train_here

CASE = Case("int_buffers", "tests.conformance.buffer_modules:CountingBatchNormNet", {"lr": 0.1},
            dataset=CLASSIFICATION, dataset_options=SMALL)
FIRST_BATCH = int(BATCHES.split(",")[0])


def _assert_counted_as_the_first_board(state: dict[str, torch.Tensor], steps: int, count_by: int = 1) -> None:
    assert state["net.1.num_batches_tracked"].item() == steps
    assert state["seen"].item() == steps * FIRST_BATCH * count_by
    assert state["seen"].dtype == torch.long and state["net.1.num_batches_tracked"].dtype == torch.long


# Every buffer-sync mode, training mode and a wire dtype that holds integers exactly only up to 256
# (the job's fields, as train's flags set them: --sync-buffers, --sync-every/--sync-warmup, --overlap, --wire-dtype).
MODES: dict[str, tuple[dict[str, Any], int]] = {
    "broadcast": ({}, 1),
    "average": ({"sync_buffers": "average"}, 1),
    "periodic": ({"sync_every": 4, "sync_warmup": 2}, 1),
    "overlap": ({"overlap": True}, 1),
    "bfloat16": ({"wire_dtype": "bfloat16"}, 1000),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_integer_buffers_reach_the_model_and_checkpoint_as_the_first_board_counted(fleet, tmp_path: Path,
                                                                                   mode: str) -> None:
    flags, count_by = MODES[mode]
    case = dataclasses.replace(CASE, model_options={**CASE.model_options, "count_by": count_by})
    run_dir = _train_here(fleet, case, tmp_path / mode, checkpoint_every=5, **flags)
    _assert_counted_as_the_first_board(torch.load(run_dir / "model.pt", weights_only=True), STEPS, count_by)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    _assert_counted_as_the_first_board(checkpoint["replica"]["model"], checkpoint["replica"]["step"], count_by)
