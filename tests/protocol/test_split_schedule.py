"""Which batch split applies from which step: the one schedule of the coordinator and the boards."""

from __future__ import annotations

import pytest

from edgefleet.coordinator.exchange.server import SPLIT_LEAD_STEPS as REEXPORTED
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.split_schedule import SPLIT_LEAD_STEPS, SplitRefused, SplitSchedule, split_step


def test_the_sizes_in_force_follow_each_split_from_its_step() -> None:
    schedule = SplitSchedule([8, 16, 24], [BatchSplit(4, (16, 16, 16)), BatchSplit(9, (4, 20, 24))])
    assert [schedule.batch_sizes_at(s) for s in (0, 3, 4, 8, 9, 100)] == [
        [8, 16, 24], [8, 16, 24], [16, 16, 16], [16, 16, 16], [4, 20, 24], [4, 20, 24]]
    assert schedule.splits == [BatchSplit(4, (16, 16, 16)), BatchSplit(9, (4, 20, 24))]
    assert schedule.splits_from(0) == schedule.splits_from(4) == schedule.splits_from(8) == schedule.splits
    assert schedule.splits_from(9) == schedule.splits_from(50) == [BatchSplit(9, (4, 20, 24))]
    assert SplitSchedule([8, 8]).splits_from(3) == []


def test_a_split_announced_twice_for_one_step_replaces_the_first() -> None:
    schedule = SplitSchedule([8, 8])
    assert schedule.add(5, [4, 12]) == BatchSplit(5, (4, 12))
    schedule.add(5, [6, 10])
    assert schedule.splits == [BatchSplit(5, (6, 10))]


@pytest.mark.parametrize("from_step, sizes, message", [
    (5, [8, 9], r"\(sum 17\) must .* keep the global batch of 16"),
    (5, [16, 0], "at least one sample"),
    (5, [4, 4, 8], "each of the 2 boards"),
    (2, [4, 12], "a re-split from step 2 would come before the one from step 3: splits must come in step order"),
])
def test_a_split_that_breaks_the_rules_is_refused(from_step: int, sizes: list[int], message: str) -> None:
    schedule = SplitSchedule([8, 8], [BatchSplit(3, (10, 6))])
    with pytest.raises(SplitRefused, match=message):
        schedule.add(from_step, sizes)
    assert schedule.splits == [BatchSplit(3, (10, 6))]


def test_a_split_starts_the_lead_after_the_result_that_carries_it() -> None:
    assert split_step(7) == 7 + SPLIT_LEAD_STEPS and REEXPORTED == SPLIT_LEAD_STEPS == 2


def test_a_known_split_again_is_a_no_op_and_a_drawn_step_cannot_be_re_split() -> None:
    schedule = SplitSchedule([8, 16, 24])
    for step in range(5):
        schedule.mark_drawn(step)
    with pytest.raises(SplitRefused, match="from step 4 arrived after this board drew the samples of step 4"):
        schedule.add(4, [16, 16, 16])
    assert schedule.add(7, [16, 16, 16]) == BatchSplit(7, (16, 16, 16))
    schedule.mark_drawn(7)
    assert schedule.add(7, [16, 16, 16]) == BatchSplit(7, (16, 16, 16))  # the same split twice (welcome + result): no-op
    assert schedule.splits == [BatchSplit(7, (16, 16, 16))]
    with pytest.raises(SplitRefused, match="from step 7 arrived after"):
        schedule.add(7, [10, 20, 18])

