"""Re-balancing batch sizes during training when a board's speed drifts (thermal throttling, a co-tenant).

The training driver feeds every step's per-board compute times (``StepResult.compute_s``) to a
:class:`Rebalancer`. Per board it keeps the time per sample, ``compute_s / batch_size``:

* reference: the median over the first ``window`` steps after the start or after a change;
* recent: the median over the last ``window`` steps (a median, so one slow step is not a trend).

A board drifts when ``|recent / reference - 1| > threshold``. The rebalancer then proposes
new batch sizes with the same sum, proportional to each board's current throughput (the integer
split minimising the slowest board's predicted time, capped by ``max_batch``), and applies them
only if the predicted compute time of a step falls by at least ``min_gain``. A drifting board's
current time per sample is the median of its newest steps past the threshold (the steps since the
change), not of the whole window: when the window's median only just turns, it is half old steps,
and a split from it would leave the board far too many samples.

After a change, the fresh reference at the new sizes is itself checked: a split that still leaves
one board the slowest by more than ``min_gain`` (the drift was misjudged, or a board's time per
sample depends on its batch size) is corrected at once, instead of becoming the new normal.

Hysteresis, so that it does not oscillate:

* noise inside the threshold never triggers (the medians absorb single outliers);
* after a change it measures a fresh reference at the new sizes before judging again;
* drift that no split can help (every board slowed alike) becomes the new reference.

The caller applies a decision at the next step boundary; the global batch never changes, so
the training semantics do not either.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgefleet.coordinator.planning.cost_model import min_max_split

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RebalanceDecision:
    """New batch sizes for the next step, and why."""

    step: int | None                  # the step whose times triggered it (as passed to observe)
    old_batch_sizes: dict[str, int]
    new_batch_sizes: dict[str, int]   # same boards, same sum
    drift: dict[str, float]           # boards past the threshold: recent / reference time per sample - 1
    current_step_s: float             # predicted compute time of a step at current speeds, old sizes
    predicted_step_s: float           # ... with the new sizes
    message: str                      # the log line, e.g. "pi4-1 slowed 38% (thermal?): batches 16,16,48 -> 10,18,52"


class Rebalancer:
    """Watches per-board step times and proposes new batch sizes when a board drifts (module doc).

    Args:
        batch_sizes: Each participating board's current batch size (the order is kept in messages).
        threshold: Relative change of a board's time per sample that counts as drift.
        window: Steps in the reference and in the recent median.
        max_batch: Optional per-board caps (e.g. the planner's memory limits).
        min_gain: Smallest predicted fall of the step's compute time worth a change
            (default ``threshold / 3``).
    """

    def __init__(self, batch_sizes: Mapping[str, int], *, threshold: float = 0.15, window: int = 5,
                 max_batch: Mapping[str, int] | None = None, min_gain: float | None = None) -> None:
        if not batch_sizes or min(batch_sizes.values()) < 1:
            raise ValueError(f"batch sizes must be positive for at least one board, got {dict(batch_sizes)}")
        if not threshold > 0 or window < 1:
            raise ValueError(f"threshold = {threshold} must be > 0 and window = {window} >= 1")
        self.threshold, self.window = threshold, window
        self.min_gain = threshold / 3 if min_gain is None else min_gain
        self._batches = dict(batch_sizes)
        self._caps = {b: (max_batch or {}).get(b, sum(batch_sizes.values())) for b in batch_sizes}
        self._recent: dict[str, deque[float]] = {b: deque(maxlen=window) for b in batch_sizes}
        self._reference: dict[str, float] = {}
        self._check_split = False     # the next reference is at sizes this rebalancer chose: judge them
        self.decisions: list[RebalanceDecision] = []

    @property
    def batch_sizes(self) -> dict[str, int]:
        return dict(self._batches)

    @property
    def global_batch(self) -> int:
        return sum(self._batches.values())

    def observe(self, compute_s: Mapping[str, float], *, step: int | None = None,
                batch_sizes: Mapping[str, int] | None = None) -> RebalanceDecision | None:
        """Take one step's per-board compute times (s); return a decision when the sizes should change.

        Args:
            compute_s: Board id to its forward+backward time of this step. Boards that did not
                answer may be missing; unknown boards are ignored.
            step: The step number, only for the decision record.
            batch_sizes: The sizes this step actually ran with, if known; a step that ran with
                other sizes than the current ones (a decision still in flight) is skipped.
        """
        if batch_sizes is not None and any(self._batches.get(b) != n for b, n in batch_sizes.items()):
            return None
        for board, seconds in compute_s.items():
            if board in self._batches and math.isfinite(seconds) and seconds > 0:
                self._recent[board].append(seconds / self._batches[board])
        if any(len(q) < self.window for q in self._recent.values()):
            return None
        recent = {b: statistics.median(q) for b, q in self._recent.items()}
        if not self._reference:
            self._reference = recent
            log.debug("rebalancer reference (s/sample): %s", recent)
            if self._check_split:
                self._check_split = False
                return self._propose(recent, {}, step)
            return None
        drift = {b: recent[b] / self._reference[b] - 1.0 for b in self._batches}
        drift = {b: d for b, d in drift.items() if abs(d) > self.threshold}
        if not drift:
            return None
        return self._propose({**recent, **{b: self._since_change(b, d) for b, d in drift.items()}}, drift, step)

    def _since_change(self, board: str, drift: float) -> float:
        """The median of ``board``'s newest run of steps past the threshold on ``drift``'s side (>= 2 steps),
        else of the whole window."""
        reference, q = self._reference[board], list(self._recent[board])
        run: list[float] = []
        for seconds in reversed(q):
            if (seconds / reference - 1.0) * math.copysign(1.0, drift) <= self.threshold:
                break
            run.append(seconds)
        return statistics.median(run if len(run) >= 2 else q)

    def _propose(self, recent: dict[str, float], drift: dict[str, float], step: int | None) -> RebalanceDecision | None:
        boards = list(self._batches)
        per_sample_s = np.array([recent[b] for b in boards])
        caps = np.maximum(np.array([self._caps[b] for b in boards], dtype=np.int64), 1)
        old = np.array([self._batches[b] for b in boards], dtype=np.int64)
        total = int(old.sum())
        if caps.sum() < total:  # the caps allow no other split
            return None
        new = min_max_split(np.zeros(len(boards)), per_sample_s, np.ones((1, len(boards)), dtype=bool), caps, total)[0]
        current, predicted = float(np.max(per_sample_s * old)), float(np.max(per_sample_s * new))
        if np.array_equal(new, old) or predicted > current * (1 - self.min_gain):
            # Nothing a split can fix (every board slowed alike, or too little to gain): the drift
            # becomes the new normal, so it is not reported again on every step.
            for b in drift:
                self._reference[b] = recent[b]
            log.debug("drift %s needs no re-balance (predicted %.4f s vs %.4f s)", drift, predicted, current)
            return None
        decision = RebalanceDecision(
            step=step, old_batch_sizes=dict(self._batches), new_batch_sizes=dict(zip(boards, map(int, new))),
            drift=drift, current_step_s=current, predicted_step_s=predicted,
            message=f"{_describe(drift) if drift else _describe_imbalance(boards, per_sample_s * old)}: batches {','.join(map(str, old))} "
                    f"-> {','.join(map(str, new))}")
        self._batches = decision.new_batch_sizes
        for q in self._recent.values():
            q.clear()
        self._reference = {}
        self._check_split = True
        self.decisions.append(decision)
        log.info("re-balance%s: %s (predicted step %.3f s -> %.3f s)",
                 f" at step {step}" if step is not None else "", decision.message, current, predicted)
        return decision


def _describe_imbalance(boards: list[str], step_s: np.ndarray) -> str:
    slowest = int(np.argmax(step_s))
    others = np.delete(step_s, slowest)
    return (f"{boards[slowest]} still the slowest at the new sizes "
            f"({step_s[slowest]:.3f} s a step, the others {others.max() if len(others) else 0.0:.3f} s)")


def _describe(drift: Mapping[str, float]) -> str:
    parts = []
    for board, d in sorted(drift.items(), key=lambda item: -abs(item[1])):
        if d > 0:
            parts.append(f"{board} slowed {d:.0%} (thermal?)")
        else:
            parts.append(f"{board} sped up ({d:+.0%} time per sample)")
    return ", ".join(parts)
