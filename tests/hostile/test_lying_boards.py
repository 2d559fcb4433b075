"""Boards with valid keys that lie in their grad frames: a real coordinator-side exchange in its own process
(``exchange_proc.py``), real board clients (``ExchangeClient``) on threads, 127.0.0.1.

Issue 36, items 1 and 10: a board's sample count ``n`` must be the slice the split assigned it (times the
job's ``accumulate_grad_batches``), and its ``loss`` and ``compute_s`` finite numbers in range; a frame that
breaks either is refused for that step (left out of the average, flagged, logged), and the others' average
is exactly what it would have been without that board.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.worker_exchange import ExchangeClient
from tests.hostile.exchange_server import ServerProcess

BOARDS = "b0:16,b1:16,b2:32"   # b2 lies; b0 and b1 weigh the same, so their average is exact in float32
BATCH = {"b0": 16, "b1": 16, "b2": 32}
VALUE = {"b0": 1.0, "b1": 3.0, "b2": 100.0}  # the honest boards' average is exactly 2.0; b2 would pull it to 51 or 100
SIZE = 64
HONEST_AVERAGE = 2.0

Sends = Callable[[int, int], dict[str, Any]]  # (step, the batch size the board knows for it) -> n, loss, compute_s


def honest(accumulate: int = 1) -> Sends:
    return lambda step, batch: {"n": batch * accumulate, "loss": 1.0, "compute_s": 0.01}


class Board(threading.Thread):
    """A board client that sends a constant vector every step, with what ``sends`` says; it follows re-splits."""

    def __init__(self, board_id: str, port: int, steps: int, sends: Sends) -> None:
        super().__init__(daemon=True, name=f"board-{board_id}")
        self.board_id, self.port, self.steps, self.sends = board_id, port, steps, sends
        self.results: dict[int, np.ndarray] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            client = ExchangeClient("127.0.0.1", self.port, result_timeout_s=60)
            client.hello(job_id="job", board_id=self.board_id, token="secret", param_count=SIZE)
            index = int(self.board_id[1:])
            splits: list[tuple[int, int]] = [(0, BATCH[self.board_id])]  # (from step, this board's batch)
            grad = np.full(SIZE, VALUE[self.board_id], dtype=np.float32)
            for step in range(self.steps):
                batch = [b for start, b in splits if start <= step][-1]
                avg = client.exchange(step=step, grad=grad, **self.sends(step, batch))
                self.results[step] = np.array(avg)
                if client.split is not None:
                    splits.append((client.split.from_step, client.split.batch_sizes[index]))
            client.close()
        except Exception as exc:  # recorded for the assertions, which name it
            self.error = exc


def run_fleet(servers: Callable[..., ServerProcess], steps: int, sends: dict[str, Sends], *args: str,
              ) -> tuple[ServerProcess, dict[int, dict[str, Any]], dict[str, Board]]:
    server = servers("--boards", BOARDS, "--param-count", str(SIZE), "--steps", str(steps), *args)
    boards = {b: Board(b, server.port, steps, sends.get(b, honest())) for b in BATCH}
    for board in boards.values():
        board.start()
    for board in boards.values():
        board.join(90)
        assert not board.is_alive(), f"board {board.board_id} did not finish\n{server.log()[-3000:]}"
        assert board.error is None, f"board {board.board_id} failed: {board.error!r}\n{server.log()[-3000:]}"
    server.finish()
    return server, server.steps(), boards


def assert_refused_exactly(server: ServerProcess, steps: dict[int, dict[str, Any]], boards: dict[str, Board],
                           step: int, why: str) -> None:
    """b2's gradient for ``step`` is refused (``why`` in the reason) and the result is b0 and b1's average, exactly."""
    record = steps[step]
    assert record["contributors"] == ["b0", "b1"], record
    assert "b2" in record["refused"] and why in record["refused"]["b2"], record
    assert record["n_total"] == 32 and record["batch_sizes"] == {"b0": 16, "b1": 16}, record
    assert math.isfinite(record["loss"]) and record["loss"] == 1.0, record
    for board in boards.values():  # every board got the honest boards' average, bit for bit
        assert np.array_equal(board.results[step], np.full(SIZE, HONEST_AVERAGE, dtype=np.float32)), \
            (board.board_id, step, board.results[step][:4])
    assert "refused board b2's gradient" in server.log()


@pytest.mark.parametrize("lie", [1_000_000, 0, 33, 31, -32])
def test_a_board_claiming_another_sample_count_is_refused_for_that_step(servers: Callable[..., ServerProcess],
                                                                       lie: int) -> None:
    """n=1,000,000 (weight 0.99994 before the check), n=0, n=assigned+1: refused; the average is the honest boards'."""
    sends = {"b2": lambda step, batch: {"n": lie if step == 1 else batch, "loss": 1.0, "compute_s": 0.01}}
    server, steps, boards = run_fleet(servers, 3, sends)
    assert steps[0]["contributors"] == steps[2]["contributors"] == ["b0", "b1", "b2"]  # honest at steps 0 and 2
    assert steps[0]["batch_sizes"]["b2"] == 32
    assert_refused_exactly(server, steps, boards, 1, "n=" if lie > 0 else "")
    if lie > 0:  # a positive count decodes; the exchange names the board, the step, what it sent and what it was assigned
        assert f"board b2 sent n={lie} for step 1; the split assigned it n=32" in steps[1]["refused"]["b2"]
        assert f"board b2 sent n={lie} for step 1; the split assigned it n=32" in server.log()
    flags = server.lines()[-1]["flags"]
    assert any(flag.startswith("step 1: refused") for flag in flags["b2"]), flags


def test_after_a_resplit_the_new_count_is_required(servers: Callable[..., ServerProcess]) -> None:
    """A split announced with step 0's result takes effect at step 2: from then on b2 must send its new batch (48)."""
    stale = {"b2": lambda step, batch: {"n": 32, "loss": 1.0, "compute_s": 0.01}}  # ignores the split
    server, steps, boards = run_fleet(servers, 4, stale, "--split-at", "0", "--split", "8,8,48")
    assert server.wait_for("split_from", timeout_s=5)["split_from"] == 2
    assert steps[0]["contributors"] == steps[1]["contributors"] == ["b0", "b1", "b2"]  # 32 is right before the split
    for step in (2, 3):
        record = steps[step]
        assert record["contributors"] == ["b0", "b1"], record
        assert f"board b2 sent n=32 for step {step}; the split assigned it n=48" in record["refused"]["b2"], record
        assert record["batch_sizes"] == {"b0": 8, "b1": 8}, record  # the honest boards' new counts are the ones kept
        for board in boards.values():
            assert np.array_equal(board.results[step], np.full(SIZE, HONEST_AVERAGE, dtype=np.float32))
    # following the split, every board is kept
    _, steps2, _ = run_fleet(servers, 4, {}, "--split-at", "0", "--split", "8,8,48")
    assert all(steps2[s]["contributors"] == ["b0", "b1", "b2"] for s in range(4)), steps2
    assert steps2[3]["batch_sizes"] == {"b0": 8, "b1": 8, "b2": 48}


def test_with_accumulation_the_count_is_the_batch_times_the_window(servers: Callable[..., ServerProcess]) -> None:
    """accumulate_grad_batches=2: n = 2 x batch is kept; the batch alone is refused."""
    sends = {b: honest(2) for b in BATCH}
    sends["b2"] = lambda step, batch: {"n": batch * (1 if step == 1 else 2), "loss": 1.0, "compute_s": 0.01}
    _, steps, boards = run_fleet(servers, 3, sends, "--accumulate", "2")
    assert steps[0]["contributors"] == steps[2]["contributors"] == ["b0", "b1", "b2"]
    assert steps[0]["batch_sizes"] == {"b0": 32, "b1": 32, "b2": 64}
    record = steps[1]
    assert record["contributors"] == ["b0", "b1"], record
    assert "board b2 sent n=32 for step 1; the split assigned it n=64" in record["refused"]["b2"], record
    for board in boards.values():
        assert np.array_equal(board.results[1], np.full(SIZE, HONEST_AVERAGE, dtype=np.float32))


@pytest.mark.parametrize(("field", "value"), [
    ("loss", math.nan), ("loss", math.inf), ("loss", -math.inf), ("loss", 1e300),
    ("compute_s", math.nan), ("compute_s", math.inf), ("compute_s", -1e9), ("compute_s", 1e300),
    ("compute_s", -0.5), ("compute_s", 86401.0),
])
def test_a_non_finite_or_out_of_range_signal_is_refused(servers: Callable[..., ServerProcess], field: str,
                                                        value: float) -> None:
    """NaN, Inf, -1e9, 1e300 as loss or compute_s: refused for that step; nothing of it reaches the step's record."""
    def sends(step: int, batch: int) -> dict[str, Any]:
        frame: dict[str, Any] = {"n": batch, "loss": 1.0, "compute_s": 0.01}
        if step == 1:
            frame[field] = value
        return frame

    server, steps, boards = run_fleet(servers, 3, {"b2": sends})
    assert steps[0]["contributors"] == steps[2]["contributors"] == ["b0", "b1", "b2"]
    assert_refused_exactly(server, steps, boards, 1, field)
    for record in steps.values():
        assert math.isfinite(record["loss"]), record


def test_a_loss_of_none_is_still_kept(servers: Callable[..., ServerProcess]) -> None:
    """None: training_step skipped every batch; the frame is kept (its loss counts as 0 in the mean)."""
    sends = {"b2": lambda step, batch: {"n": batch, "loss": None, "compute_s": 0.01}}
    _, steps, _ = run_fleet(servers, 2, sends)
    assert all(steps[s]["contributors"] == ["b0", "b1", "b2"] for s in range(2)), steps
