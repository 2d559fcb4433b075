"""bench/placement.py's comparison: data-parallel against placement per board count, whether the planner's
predicted faster mode is the measured faster one, and its pick among the measured configurations."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    # bench/ is a folder of scripts: its modules import each other by name, from the script's folder
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("placement_bench", BENCH / "placement.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


pb = _load()


def _row(mode: str, boards: int, *, predicted: float, target: float | None, rate: float, up: float | None,
         kib: float) -> dict[str, Any]:
    run = {"fleet": "fleet8", "model": "lenet5", "mode": mode, "boards": [f"b{i}" for i in range(boards)],
           "batch_sizes": [128 // boards] * boards, "predicted_step_s": predicted, "time_to_target_s": target,
           "samples_per_s": rate, "median_period_s": predicted, "kb_per_step_board": kib}
    return {"run": run, "speed_up_target": up}


def test_agreement_counts_multi_board_cases_and_the_pick_is_the_least_predicted() -> None:
    rows = [_row("exact", 1, predicted=0.080, target=6.0, rate=1600, up=1.0, kib=485),
            _row("placed", 1, predicted=0.085, target=6.5, rate=1500, up=0.92, kib=433),
            _row("exact", 2, predicted=0.070, target=5.5, rate=1800, up=1.09, kib=485),
            _row("placed", 2, predicted=0.050, target=4.2, rate=2500, up=1.43, kib=228),   # predicted and measured: placed
            _row("exact", 3, predicted=0.060, target=4.0, rate=2600, up=1.50, kib=485),
            _row("placed", 3, predicted=0.055, target=4.8, rate=2290, up=1.25, kib=160)]   # predicted placed, measured exact
    cells, agree, cases, ties, picks = pb.comparison(rows)

    assert (agree, cases, ties) == (1, 2, 0)  # one-board runs are not a choice; 4.8 s against 4.0 is no tie
    assert [c[2] for c in cells] == ["1", "2", "3"]
    assert cells[1][3:5] == ["485 / 228", "0.47"] and cells[1][-1] == "placed / placed"
    assert cells[2][-2:] == ["+20", "placed / exact"]
    [pick] = picks
    assert "placed on 2 board(s) (64,64): measured 1.43x" in pick
