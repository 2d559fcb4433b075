"""16-mixed: a board that alone overflows again and again is refused instead of skipping every step."""

from __future__ import annotations

from edgefleet.coordinator.exchange.overflow_watch import OverflowWatch


def test_lone_overflows_within_the_budget_skip_the_step_beyond_it_refuse_the_board() -> None:
    watch = OverflowWatch(window=100, limit=3)
    assert [watch.lone("b1", step) for step in range(3)] == [None, None, None]
    why = watch.lone("b1", 3)
    assert why is not None and "alone overflowed at 3 of the last 100 steps" in why
    assert watch.lone("b2", 3) is None  # each board has its own budget


def test_the_budget_comes_back_as_old_overflows_leave_the_window() -> None:
    watch = OverflowWatch(window=10, limit=2)
    assert watch.lone("b1", 0) is None and watch.lone("b1", 1) is None
    assert watch.lone("b1", 5) is not None
    assert watch.lone("b1", 11) is None  # steps 0 and 1 are out of the window
