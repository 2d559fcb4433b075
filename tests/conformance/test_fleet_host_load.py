"""A training result does not depend on how busy the host is (issue 36, item 14).

The same run twice with one seed and one split: once on a quiet machine, once with two processes
spinning on its two cores. Everything a busy host could change is in it: BatchNorm normalises
each board's slice, dropout draws on every board, the replica validates at each epoch's end with
as many torch threads as the free CPU allows (fewer under load). The two runs end with the same
bits in every parameter and buffer, and the same losses and validation figures. (Re-balancing is
off: it follows the boards' measured speeds by design, and with BatchNorm or random draws the
result follows the split; docs/training.md says so.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.conformance.cases import CLASSIFICATION
from tests.conformance.reference import Case
from tests.conformance.test_fleet_conformance import _train_here

CASE = Case("host_load", "tests.conformance.modules:BatchNormDropoutNet", {"lr": 0.1, "p": 0.3}, dataset=CLASSIFICATION)


@contextmanager
def busy_cores(count: int = 2) -> Iterator[None]:
    """``count`` processes spinning on the CPU while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=10)


def _figures(run_dir: Path) -> tuple[list[tuple[float, list[str]]], dict]:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((run_dir / "result.json").read_text())
    return [(s["loss"], s["boards"]) for s in steps], result["val_metrics"]


def test_a_run_on_a_busy_host_ends_with_the_quiet_runs_bits(fleet, tmp_path: Path) -> None:
    quiet = _train_here(fleet, CASE, tmp_path / "quiet")
    with busy_cores():
        busy = _train_here(fleet, CASE, tmp_path / "busy")
    a, b = (torch.load(run / "model.pt", weights_only=True) for run in (quiet, busy))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert _figures(quiet) == _figures(busy)
    assert _figures(quiet)[1]  # it validated
