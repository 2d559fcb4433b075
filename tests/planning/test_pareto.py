from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgefleet.coordinator.planning.cost_model import Candidate, estimate
from edgefleet.coordinator.planning.pareto import pareto_front, write_pareto_png
from edgefleet.coordinator.planning.search import plan
from tests.planning import board, fleet, random_variants


def _points(*pairs: tuple[float, float]):
    base = estimate(Candidate(boards=("a",), batch_sizes=(8,), variant={}), fleet(board("a")))
    return [replace(base, epoch_time_s=t, energy_per_epoch_j=e) for t, e in pairs]


def test_the_front_keeps_only_what_nothing_beats_on_both() -> None:
    points = _points((10, 500), (12, 300), (11, 600), (20, 300), (30, 100), (12, 300))
    front = pareto_front(points)
    assert [(e.epoch_time_s, e.energy_per_epoch_j) for e in front] == [(10, 500), (12, 300), (30, 100)]
    assert pareto_front([]) == []


def test_the_png_is_written(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("matplotlib is not installed: pip install matplotlib (it belongs to the coordinator extra)")
    result = plan(random_variants(np.random.default_rng(4), 8), objective="edp", global_batches=(32, 128))
    path = write_pareto_png(tmp_path / "pareto.png", result.ranked + result.front, result.chosen)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        write_pareto_png(tmp_path / "x.png", _points((1, 1)))
