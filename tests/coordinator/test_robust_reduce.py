"""The robust aggregates (``--aggregate``): what one lying board can do to a step under each rule, and the mode's
place in the exchange (the reducer's refusals and buffers stand; no folding)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.coordinator.exchange.board_state import ExchangeError
from edgefleet.coordinator.exchange.gradient_reduce import GradientReducer
from edgefleet.coordinator.exchange.modes import RobustAggregate, select_mode
from edgefleet.coordinator.exchange.robust_reduce import CLIP_FACTOR, aggregate, stacked, trimmed_count
from edgefleet.protocol.split_schedule import SplitSchedule

RNG = np.random.default_rng(3)
HONEST = [(RNG.standard_normal(1000) * 0.1 + 1.0).astype(np.float32) for _ in range(4)]  # four honest boards, alike


def _rule(rule: str, rows: list[np.ndarray], counts: list[int] | None = None) -> np.ndarray:
    out = np.zeros(rows[0].size, dtype=np.float32)
    aggregate(rule, stacked(rows, rows[0].size), counts or [16] * len(rows), out)
    return out


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
@pytest.mark.parametrize("lie", [2000.0, -1.0, 1e5])
def test_one_liar_in_five_moves_no_coordinate_outside_the_honest_range(rule: str, lie: float) -> None:
    result = _rule(rule, [*HONEST, HONEST[0] * lie])
    honest = np.stack(HONEST)
    assert np.all(result >= honest.min(axis=0) - 1e-6) and np.all(result <= honest.max(axis=0) + 1e-6)
    plain = np.mean(honest, axis=0)
    assert np.linalg.norm(result - plain) / np.linalg.norm(plain) < 0.1


def test_clip_bounds_a_huge_gradient_to_the_median_norm() -> None:
    liar = HONEST[0] * 2000
    result = _rule("clip", [*HONEST, liar])
    norms = [np.linalg.norm(v) for v in HONEST]
    assert np.linalg.norm(result) <= (4 * max(norms) + CLIP_FACTOR * np.median([*norms, np.linalg.norm(liar)])) / 5 + 1e-3
    median = float(np.median(norms))
    clipped = [v * min(1.0, CLIP_FACTOR * median / float(np.linalg.norm(v))) for v in HONEST]
    assert np.allclose(_rule("clip", HONEST, [8, 8, 16, 32]), np.average(np.stack(clipped), axis=0, weights=[8, 8, 16, 32]),
                       rtol=1e-5)  # honest boards: those above the median norm cut to it, then the sample-weighted mean


def test_trimming_needs_three_boards() -> None:
    assert [trimmed_count(k) for k in (1, 2, 3, 5, 10)] == [0, 0, 1, 1, 2]
    assert np.allclose(_rule("trimmed-mean", HONEST[:2]), np.mean(np.stack(HONEST[:2]), axis=0))


def test_the_mode_keeps_the_reducers_refusals_and_buffers() -> None:
    reducer = GradientReducer(1002, buffer_elements=2)
    mode = select_mode(reducer, SplitSchedule([16] * 4), aggregate="median")
    assert isinstance(mode, RobustAggregate) and not mode.folds(0)
    vectors = [np.concatenate([v[:1000], np.float32([i, i])]) for i, v in enumerate(HONEST[:3])]
    vectors.append(np.full(1002, np.nan, dtype=np.float32))
    outcome = mode.reduce(0, [(v, 16) for v in vectors], None)
    assert outcome.kept == [0, 1, 2] and [i for i, _ in outcome.refused] == [3]
    assert np.array_equal(reducer.sum[:1000], np.median(np.stack([v[:1000] for v in vectors[:3]]), axis=0))
    assert list(reducer.sum[1000:]) == [0.0, 0.0]  # the first kept board's buffers (broadcast)
    with pytest.raises(ExchangeError, match="--sync-every or --overlap"):
        select_mode(reducer, SplitSchedule([16] * 4), aggregate="median", overlap=True)
