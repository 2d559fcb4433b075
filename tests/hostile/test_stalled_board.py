"""A board whose worker stops (SIGSTOP, swapping, a hung SD card) cannot stall the fleet (issue 36, item 3).

A real ExchangeServer stepping as the coordinator does, real board clients on threads (``stepping_exchange``):
one board stops answering. It costs the fleet :data:`MISSES_TO_DROP` deadlines, not one every step for ever: it
is dropped, named and flagged with why, the others step at full speed, and once it is live again it joins
again (its old connection is gone) and holds the replica's state, step for step.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgefleet.coordinator.exchange.step_round import MISSES_TO_DROP
from tests.helpers import wait_until
from tests.hostile.stepping_exchange import Board, SteppingExchange, started

DEADLINE_S = 0.5
STALL_AT = 3


def test_a_stalled_board_is_dropped_and_taken_back_when_live(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edgefleet.coordinator.exchange")
    exchange = SteppingExchange([("b0", 8), ("b1", 8), ("b2", 16)], need={"b0", "b1", "b2"}, deadline_s=DEADLINE_S)
    b0, b1 = Board(exchange, "b0", 8, 1.0), Board(exchange, "b1", 8, 2.0)
    b2 = Board(exchange, "b2", 16, 4.0, stall_at=STALL_AT)
    check = started(exchange, b0, b1, b2)
    try:
        dropped = STALL_AT + MISSES_TO_DROP - 1  # the last step it missed
        # 30 steps without it come quickly: the stopped board no longer costs every step its deadline
        wait_until(lambda: len(exchange.results) >= dropped + 31, timeout_s=10 + MISSES_TO_DROP * DEADLINE_S,
                   what="30 steps after the board was dropped")
        records = [r for _, r in list(exchange.results)]
        assert [r.late for r in records[STALL_AT:dropped + 1]] == [["b2"]] * MISSES_TO_DROP
        after = records[dropped + 1:dropped + 31]
        assert all(r.late == [] and r.contributors == ["b0", "b1"] for r in after), after[:3]
        times = [t for t, _ in list(exchange.results)]
        assert times[dropped + 30] - times[dropped] < 30 * DEADLINE_S / 2  # today: 30 deadlines, 15 s
        why = f"missed {MISSES_TO_DROP} step deadlines in a row (steps {STALL_AT} to {dropped})"
        assert any("board b2 left: dropped from the job's steps" in m and why in m for m in caplog.messages), \
            caplog.messages[-5:]

        b2.resume.set()  # live again: its old connection is closed; it joins again at a step boundary
        wait_until(lambda: len(b2.joins) == 2 and len([s for s in exchange.steps_with("b2") if s > b2.joins[1]]) >= 5,
                   timeout_s=15, what="b2 to join again and take part in 5 steps")
        assert b2.after_stall is not None  # the exchange had closed the stopped board's connection
        assert b2.joins[1] > dropped
    finally:
        exchange.stop()
    check()
    flags = exchange.flags["b2"]
    assert any(f.startswith("left: dropped from the job's steps") and why in f for f in flags), flags
    for board in (b0, b1, b2):  # every state a board held, rejoined one included, is the replica's at that step
        for step, held in board.held.items():
            assert np.array_equal(held, exchange.states[step]), (board.board_id, step)
