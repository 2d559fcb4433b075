"""Which board of a pipelined run slowed down for good, from its busy time per step (issue 35).

A stage's board reports, each step, the time it spent on its own stage's forward and backward, its
waits on its neighbours left out (``agent.stage_runtime``): a slow neighbour does not make it look
slow. :class:`StageWatch` judges each board on its own, as the data-parallel rebalancer does
(``run.rebalance``), in windows of steps that do not overlap:

* the first ``warmup`` steps of the plan are left out (a new plan's first steps build its graphs);
* the **reference** is the median of the next ``reference_steps``;
* then each window's median is compared with it: it is past the bar when it is off by more than
  ``threshold`` and by more than ``NOISE_Z`` standard errors of a difference of medians (from the
  board's own step-to-step noise), and a board has **drifted** when two windows in a row are past
  the bar on the same side. A window spans at least ``MIN_WINDOW_S`` of the board's time, so a
  blip of a busy host is no drift.

On a drift the caller revises the plan (``pipeline.revision``); when no revision pays,
:meth:`StageWatch.settle` makes the drift the new normal, so it is not reported again each step.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edgefleet.coordinator.run.rebalance import (
    MAX_WINDOW,
    MEDIAN_SE,
    MIN_WINDOW_S,
    NOISE_HISTORY,
    NOISE_Z,
    PERSIST_JUDGEMENTS,
    noise_sigma,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drift:
    """Boards whose busy time changed for good: recent / reference - 1 each, and their recent medians (s)."""

    step: int
    change: dict[str, float]
    recent_s: dict[str, float]


class StageWatch:
    """Each board's busy time per step, judged for a lasting change (module doc).

    Args:
        boards: the pipeline's boards.
        threshold: the relative change of a board's busy time that counts (0.3: 30% slower or faster).
        window: steps in a judged window, at least.
        warmup: the plan's first steps, left out.
    """

    def __init__(self, boards: Iterable[str], *, threshold: float = 0.3, window: int = 5, warmup: int = 3) -> None:
        if not threshold > 0 or window < 1 or warmup < 0:
            raise ValueError(f"threshold {threshold} must be > 0, window {window} >= 1 and warmup {warmup} >= 0")
        self.threshold, self.window, self.warmup = threshold, window, warmup
        self.reference_steps = 2 * window
        self._seen = 0
        # each board's newest busy times (the reference's, then a window's at most: a long run keeps no more) and how
        # many it has taken since its reference began
        keep = max(self.reference_steps, MAX_WINDOW)
        self._times: dict[str, deque[float]] = {b: deque(maxlen=keep) for b in boards}
        self._count: dict[str, int] = dict.fromkeys(self._times, 0)
        self._logs: dict[str, deque[float]] = {b: deque(maxlen=NOISE_HISTORY) for b in self._times}
        self._reference: dict[str, float] = {}
        self._judged_to: dict[str, int] = {}  # the index of each board's times up to which windows were judged
        self._past: dict[str, int] = dict.fromkeys(self._times, 0)  # consecutive windows past the bar (signed)

    def observe(self, step: int, busy_s: Mapping[str, float]) -> Drift | None:
        """Take one step's busy times; a :class:`Drift` when a board's changed for good."""
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        change: dict[str, float] = {}
        recent: dict[str, float] = {}
        for board, seconds in busy_s.items():
            if board not in self._times or not (math.isfinite(seconds) and seconds > 0):
                continue
            times = self._times[board]
            times.append(seconds)
            self._count[board] += 1
            self._logs[board].append(math.log(seconds))
            d = self._judge(board)
            if d is not None:
                change[board] = d
                recent[board] = _median_of_last(times, self._window_for(times))
        if not change:
            return None
        return Drift(step=step, change=change, recent_s=recent)

    def recent_s(self) -> dict[str, float]:
        """Each board's median busy time over its last window (boards without one left out)."""
        return {b: _median_of_last(t, self._window_for(t)) for b, t in self._times.items() if t}

    def settle(self, boards: Iterable[str]) -> None:
        """A drift no revision pays for becomes the new normal: the reference builds again from now."""
        for board in boards:
            if board in self._times:
                self._times[board].clear()
                self._count[board] = 0
                self._reference.pop(board, None)
                self._judged_to.pop(board, None)
                self._past[board] = 0

    def _judge(self, board: str) -> float | None:
        times, count = self._times[board], self._count[board]
        if board not in self._reference:
            if count < self.reference_steps:
                return None
            self._reference[board] = statistics.median(times)
            self._judged_to[board] = count
            return None
        window = self._window_for(times)
        if count - self._judged_to[board] < window:
            return None
        self._judged_to[board] = count
        recent = _median_of_last(times, window)
        d = recent / self._reference[board] - 1.0
        se = MEDIAN_SE * noise_sigma(self._logs[board]) * math.sqrt(1.0 / window + 1.0 / self.reference_steps)
        past = abs(d) > self.threshold and abs(math.log1p(d)) > NOISE_Z * se
        side = int(math.copysign(1, d)) if past else 0
        self._past[board] = self._past[board] + side if side and self._past[board] * side > 0 else side
        if abs(self._past[board]) >= PERSIST_JUDGEMENTS:
            log.info("board %s: busy %.4f s a step against %.4f s (%+.0f%%)", board, recent, self._reference[board],
                     100 * d)
            return d
        return None

    def _window_for(self, times: deque[float]) -> int:
        """A judged window's steps: ``window``, or enough to span MIN_WINDOW_S of the board's steps (MAX_WINDOW at most)."""
        step_s = _median_of_last(times, self.window) if times else 0.0
        steps = math.ceil(MIN_WINDOW_S / step_s) if step_s > 0 else self.window
        return max(self.window, min(MAX_WINDOW, steps))


def _median_of_last(times: deque[float], n: int) -> float:
    return statistics.median(list(times)[-n:])


__all__ = ["Drift", "StageWatch"]
