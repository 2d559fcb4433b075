"""When a later pipeline stage's board sends its gradient, its state or nothing (``protocol.stage_sync``)."""

from __future__ import annotations

import pytest

from edgefleet.protocol.stage_sync import GRAD, NOTHING, STATE, StageSync


def test_every_step_by_default() -> None:
    sync = StageSync(every=0, steps_per_epoch=5, total_steps=12)
    assert not sync.sparse
    assert {sync.kind(s) for s in range(12)} == {GRAD}
    assert all(sync.whole_after(s) for s in range(12))


def test_at_checkpoints_epoch_ends_and_the_last_step_the_state_the_first_step_its_gradient_else_nothing() -> None:
    sync = StageSync(every=4, steps_per_epoch=6, total_steps=14, start=1)
    kinds = [sync.kind(s) for s in range(1, 14)]
    #        1        2        3      4        5      6        7      8        9        10       11     12       13
    assert kinds == [GRAD, NOTHING, STATE, NOTHING, STATE, NOTHING, STATE, NOTHING, NOTHING, NOTHING, STATE, NOTHING,
                     STATE]
    assert [s for s in range(1, 14) if sync.whole_after(s)] == [3, 5, 7, 11, 13]


def test_a_first_step_that_is_a_state_step_sends_the_state() -> None:
    assert StageSync(every=4, steps_per_epoch=100, total_steps=100, start=3).kind(3) == STATE


@pytest.mark.parametrize("fields", [dict(every=-1), dict(steps_per_epoch=0), dict(total_steps=0), dict(start=-2)])
def test_a_schedule_out_of_range_is_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="stage sync schedule needs"):
        StageSync(**{"every": 4, "steps_per_epoch": 5, "total_steps": 10, **fields})
