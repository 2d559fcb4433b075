"""A re-split with ``--accumulate-grad-batches``: the global batch is unchanged, so the model is too.

With accumulation an optimizer step is a window of batches on every board; a re-split announced for
step s must start with s's window on every board (the boards count batches, the coordinator steps).
A short last window per epoch (5 batches, windows of 2) makes the translation count.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from edgefleet.protocol.exchange_frames import BatchSplit
from tests.conformance.cases import CASES
from tests.conformance.fleet_cli import GLOBAL_BATCH, SEED, STEPS, TOLERANCE
from tests.conformance.reference import lightning_reference, relative_l2
from tests.conformance.test_fleet_conformance import _train_here

CASE = next(case for case in CASES if case.name == "accumulate")
SPLIT_FROM = 4  # epoch 1's second window: 5 batches an epoch are windows of 2, 2 and 1


def test_a_re_split_with_accumulation_trains_lightnings_model(fleet, tmp_path: Path) -> None:
    run_dir = _train_here(fleet, CASE, tmp_path / "resplit", force_split=BatchSplit(SPLIT_FROM, (12, 8, 4)))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    accumulate = CASE.trainer["accumulate_grad_batches"]
    assert steps[SPLIT_FROM - 1]["batch_sizes"] == {"c1": 4 * accumulate, "c2": 8 * accumulate, "c3": 12 * accumulate}
    assert steps[SPLIT_FROM]["batch_sizes"] == {"c1": 12 * accumulate, "c2": 8 * accumulate, "c3": 4 * accumulate}
    reference = lightning_reference(CASE, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert relative_l2(torch.load(run_dir / "model.pt", weights_only=True), reference) <= TOLERANCE
