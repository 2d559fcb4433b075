"""Which board of a later stage's group runs each micro-batch (issue 35): a function of the plan alone."""

from __future__ import annotations

import pytest

from edgefleet.protocol.stage_routes import micro_rows, stage_routes


def test_every_unit_goes_to_one_board_of_each_stage_the_group_s_samples_balanced() -> None:
    routes = stage_routes((2, 2, 1), (30, 34), 2)
    assert routes.units() == [(0, 0, 15), (0, 1, 15), (1, 0, 17), (1, 1, 17)]
    assert routes.units_of(0, 1) == [(1, 0, 17), (1, 1, 17)]  # stage 0: each board its own micro-batches
    assert routes.units_of(1, 0) == [(0, 0, 15), (1, 0, 17)] and routes.units_of(1, 1) == [(0, 1, 15), (1, 1, 17)]
    assert routes.rows_of(1, 0) == routes.rows_of(1, 1) == 32 and routes.rows_of(2, 0) == 64  # a stage of one: all
    assert [routes.member(1, src, micro) for src, micro, _ in routes.units()] == [0, 1, 0, 1]
    assert routes.member(1, 0, 2) is None  # no such micro-batch


def test_a_slice_smaller_than_m_makes_fewer_micro_batches_and_the_routes_follow() -> None:
    routes = stage_routes((2, 3), (2, 9), 4)
    assert micro_rows(2, 4) == [1, 1] and routes.micro_count(0) == 2 and routes.micro_count(1) == 4
    assert sum(routes.rows_of(1, m) for m in range(3)) == 11 and [routes.rows_of(1, m) for m in range(3)] == [5, 3, 3]
    assert routes == stage_routes([2, 3], [2, 9], 4)  # the coordinator and every board compute the same


@pytest.mark.parametrize(("sizes", "slices", "m", "fragment"), [
    ((1,), (8,), 2, "at least two stages"), ((1, 0), (8,), 2, "at least two stages"),
    ((2, 1), (8,), 2, "stage 0's 2 board"), ((1, 1), (0,), 2, "at least one sample"), ((1, 1), (8,), 0, "at least 1"),
])
def test_routes_that_cannot_be_are_refused(sizes: tuple[int, ...], slices: tuple[int, ...], m: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        stage_routes(sizes, slices, m)
