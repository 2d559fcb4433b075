"""A board joining over a slow link does not hold up the fleet's steps, and joins with the replica's state
(issue 36, item 4).

A real ExchangeServer stepping as the coordinator does, real board clients on threads (``stepping_exchange``):
two boards step while a third joins and reads its welcome (24 MB, larger than the sockets' buffers take) at
about 8 MB/s. The steps go on while it reads, and while it then catches up on the results of the steps it
missed (computing each: it is faster than the fleet's step, as a board must be to catch up); it
holds, at every step, exactly the replica's state, and takes part in the steps once it caught up.
"""

from __future__ import annotations

import numpy as np

from tests.helpers import wait_until
from tests.hostile.stepping_exchange import Board, SteppingExchange, started

PAD = 24 * 1024 * 1024   # the welcome's size: more than the kernel's socket buffers take at once
SLOW = (256 * 1024, 0.03)  # the joining board reads 256 KiB every 30 ms: about 3 s for its welcome
DEADLINE_S = 0.5


def test_a_slow_welcome_does_not_hold_up_the_steps() -> None:
    exchange = SteppingExchange([("b0", 8), ("b1", 8), ("b2", 16)], need={"b0", "b1"}, deadline_s=DEADLINE_S,
                                welcome_pad_bytes=PAD)
    b0, b1 = Board(exchange, "b0", 8, 1.0, compute_s=0.005), Board(exchange, "b1", 8, 2.0, compute_s=0.005)
    b2 = Board(exchange, "b2", 16, 4.0, slow=SLOW, compute_s=0.001)  # faster than the fleet's step: it can catch up
    check = started(exchange, b0, b1)
    try:
        wait_until(lambda: len(exchange.results) >= 20, timeout_s=10, what="20 steps of the first two boards")
        b2.start()
        wait_until(lambda: b2.joins and len([s for s in exchange.steps_with("b2") if s > b2.joins[0]]) >= 5,
                   timeout_s=20, what="b2 to join and take part in 5 steps")
    finally:
        exchange.stop()
    check()
    hello, welcomed = b2.welcome_s[0]
    assert welcomed - hello > 1.5, "the welcome was read faster than the test means to read it"
    times = [t for t, _ in exchange.results]
    during = [t for t in times if hello <= t <= welcomed]
    assert len(during) >= 50, len(during)  # today: none, the fleet froze while the welcome was written
    gaps = np.diff([t for t in times if t >= hello])
    assert gaps.max() < DEADLINE_S, float(gaps.max())  # nor did it wait for the board while it caught up
    assert b2.joins == [exchange.welcomes[-1]]  # one welcome: never cut off, never dropped
    assert not any("b2" in r.late for _, r in exchange.results), "the steps waited for b2 in vain"
    for board in (b0, b1, b2):  # at every step, b2's catch-up included, a board holds the replica's state
        for step, held in board.held.items():
            assert np.array_equal(held, exchange.states[step]), (board.board_id, step)
    assert len(b2.held) > 5
