"""Re-balancing batch sizes during training when a board's speed drifts (thermal throttling, a co-tenant).

The training driver feeds every step's per-board compute times (``StepResult.compute_s``) to a
:class:`Rebalancer`. Per board it keeps the time per sample, ``compute_s / batch_size``, of the
steps since the last change of sizes, and judges them in windows that do not overlap:

* recent: the median over the board's last window of steps (a median, so one slow step is not a
  trend). A window is ``window`` steps, or more for a noisy board (enough that a board at half its
  speed stands out of the noise) or for short steps (a window spans at least ``MIN_WINDOW_S`` of
  the board's compute: a blip of a busy host is no drift), at most ``MAX_WINDOW``;
* reference: the median of the up to ``NOISE_HISTORY`` steps before the window before that one
  (at least ``reference_steps`` = 2 x ``window``). It rolls on, so one unlucky reference does not
  bias every later judgement, and it leaves out the last window and any window already past the
  bar, so it does not take in a drift while the drift is being confirmed.

A board drifts when its recent median is off the reference by more than ``threshold`` and by more
than ``NOISE_Z`` (3) standard errors of that difference, in two judgements in a row
(``PERSIST_JUDGEMENTS``). The standard error comes from the board's own step-to-step noise: the
robust standard deviation of the differences of successive log times over its last
``NOISE_HISTORY`` steps (a level shift is one outlier among them, not spread), times 1.253 x
sqrt(1/n_recent + 1/n_reference) for a difference of medians. Three equal boards sharing two busy
cores (the demo) swing by +-40% a step; without this they were re-balanced some 30 times a run.

On a drift the rebalancer proposes new batch sizes with the same sum, proportional to each
board's current throughput (the integer split minimising the slowest board's predicted time,
capped by ``max_batch``), and applies them only if the predicted compute time of a step falls by
at least ``min_gain`` and, when the caller says how many steps are left after it would apply
(``steps_left``), the compute it saves over them exceeds ``CHANGE_COST_STEPS`` (2) steps of
compute (the new batch shapes' first steps and the fresh reference cost about that): none is
proposed for a step past the end. A drifting board's current time per sample is the median of
its newest steps past the threshold (the steps since the change), not of the whole window.

After a change, the first ``reference_steps`` at the new sizes are checked: a split that still
leaves one board the slowest by more than ``min_gain`` and by more than the noise of those
medians (the drift was misjudged, or a board's time per sample depends on its batch size) is
corrected at once, instead of becoming the new normal.

Hysteresis, so that it does not oscillate:

* noise never triggers (the bar above; the medians absorb single outliers);
* after a change it measures a fresh reference at the new sizes before judging again;
* drift that no split can help (every board slowed alike) becomes the new reference.

The caller applies a decision at the next step boundary; the global batch never changes, so
the training semantics do not either.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from edgefleet.coordinator.planning.cost_model import min_max_split

log = logging.getLogger(__name__)

NOISE_Z = 3.0             # how many standard errors of the compared medians a drift or a gain must exceed
PERSIST_JUDGEMENTS = 2    # ... in this many judgements in a row (each of a fresh window of steps)
NOISE_HISTORY = 60        # steps of each board's times its noise is estimated from (and its reference, at most)
MAX_WINDOW = 40           # the recent median's steps at most, however noisy or short the board's steps
MIN_WINDOW_S = 0.5        # a window spans at least this much of the board's compute: a blip is no drift
CHANGE_COST_STEPS = 2.0   # what a change costs, in steps of compute: it must save more before the run ends
_NORMAL_MAD = 0.6745      # the median absolute value of a standard normal variable
MEDIAN_SE = 1.2533       # the standard error of a median of n samples is about this x sigma / sqrt(n)


@dataclass(frozen=True, slots=True, kw_only=True)
class RebalanceDecision:
    """New batch sizes for the next step, and why."""

    step: int | None                  # the step whose times triggered it (as passed to observe)
    old_batch_sizes: dict[str, int]
    new_batch_sizes: dict[str, int]   # same boards, same sum
    drift: dict[str, float]           # boards past the threshold: recent / reference time per sample - 1
    current_step_s: float             # predicted compute time of a step at current speeds, old sizes
    predicted_step_s: float           # ... with the new sizes
    message: str                      # the log line, e.g. "pi4-1 slowed 38% (hot: 84 °C): batches 16,16,48 -> 10,18,52"


class Rebalancer:
    """Watches per-board step times and proposes new batch sizes when a board drifts (module doc).

    Args:
        batch_sizes: Each participating board's current batch size (the order is kept in messages).
        threshold: Relative change of a board's time per sample that counts as drift.
        window: Steps in the reference and in the recent median.
        max_batch: Optional per-board caps (e.g. the planner's memory limits).
        min_gain: Smallest predicted fall of the step's compute time worth a change
            (default ``threshold / 3``).
        explain: The likely cause of a board's slowdown, for the message (``run.slowdown.slowdown_cause``
            over the board's telemetry); without it the message names none.
    """

    def __init__(self, batch_sizes: Mapping[str, int], *, threshold: float = 0.15, window: int = 5,
                 max_batch: Mapping[str, int] | None = None, min_gain: float | None = None,
                 explain: Callable[[str], str] | None = None) -> None:
        if not batch_sizes or min(batch_sizes.values()) < 1:
            raise ValueError(f"batch sizes must be positive for at least one board, got {dict(batch_sizes)}")
        if not threshold > 0 or window < 1:
            raise ValueError(f"threshold = {threshold} must be > 0 and window = {window} >= 1")
        self.threshold, self.window = threshold, window
        self._explain = explain
        self.min_gain = threshold / 3 if min_gain is None else min_gain
        self._batches = dict(batch_sizes)
        self._caps = {b: (max_batch or {}).get(b, sum(batch_sizes.values())) for b in batch_sizes}
        self.reference_steps = 2 * window  # steps before the recent window that make a reference, at least
        # Per board, its time per sample at the current sizes, oldest first: the newest ``window`` are
        # the recent ones, the up to NOISE_HISTORY before them the reference (it rolls on, so one
        # unlucky reference does not bias every later judgement).
        self._since: dict[str, deque[float]] = {b: deque(maxlen=NOISE_HISTORY + 4 * MAX_WINDOW) for b in batch_sizes}
        self._history: dict[str, deque[float]] = {b: deque(maxlen=NOISE_HISTORY) for b in batch_sizes}  # log times
        self._past_bar: dict[str, int] = dict.fromkeys(batch_sizes, 0)  # consecutive judgements past the bar (signed)
        # Steps since the board's last judgement (a window's worth at first: judged as soon as it can be).
        self._unjudged: dict[str, int] = dict.fromkeys(batch_sizes, MAX_WINDOW)
        self._check_split = False     # the next reference is at sizes this rebalancer chose: judge them
        self.decisions: list[RebalanceDecision] = []

    @property
    def batch_sizes(self) -> dict[str, int]:
        return dict(self._batches)

    @property
    def global_batch(self) -> int:
        return sum(self._batches.values())

    def observe(self, compute_s: Mapping[str, float], *, step: int | None = None,
                batch_sizes: Mapping[str, int] | None = None, steps_left: int | None = None) -> RebalanceDecision | None:
        """Take one step's per-board compute times (s); return a decision when the sizes should change.

        Args:
            compute_s: Board id to its forward+backward time of this step. Boards that did not
                answer may be missing; unknown boards are ignored.
            step: The step number, only for the decision record.
            batch_sizes: The sizes this step actually ran with, if known; a step that ran with
                other sizes than the current ones (a decision still in flight) is skipped.
            steps_left: Steps of the run from the one a decision would apply at, if known: a
                change that cannot save more than it costs before the end is not proposed.
        """
        if batch_sizes is not None and any(self._batches.get(b) != n for b, n in batch_sizes.items()):
            return None
        for board, seconds in compute_s.items():
            if board in self._batches and math.isfinite(seconds) and seconds > 0:
                per_sample = seconds / self._batches[board]
                self._since[board].append(per_sample)
                self._history[board].append(math.log(per_sample))
        if self._check_split:  # the sizes this rebalancer chose: once measured, does one board still finish last?
            if any(len(q) < self.reference_steps for q in self._since.values()):
                return None
            self._check_split = False
            measured = {b: statistics.median(q) for b, q in self._since.items()}
            return self._propose(measured, {}, step, self._standard_errors(2.0 / self.reference_steps), steps_left)
        se: dict[str, float] = {}
        windows: dict[str, int] = {}
        drift: dict[str, float] = {}
        recent: dict[str, float] = {}
        for b, q in self._since.items():
            sigma = noise_sigma(self._history[b])
            step_s = statistics.median(list(q)[-self.window:]) * self._batches[b] if q else 0.0
            window = windows[b] = self._window_for(sigma, step_s)
            if len(q) < window + self.reference_steps:
                recent[b] = statistics.median(q) if q else math.nan
                continue
            times = list(q)
            recent[b] = statistics.median(times[-window:])
            self._unjudged[b] += 1
            if self._unjudged[b] < window:  # windows judged do not overlap: each judgement is fresh evidence
                continue
            # The reference ends a window before this one, and before the windows already past the bar:
            # a drift that began in the last window or is being confirmed is not taken in as the norm.
            skip = min(window * (2 + abs(self._past_bar[b])), len(times) - self.reference_steps)
            self._unjudged[b] = 0
            reference = times[-skip - NOISE_HISTORY:-skip]
            d = recent[b] / statistics.median(reference) - 1.0
            se[b] = MEDIAN_SE * sigma * math.sqrt(1.0 / window + 1.0 / len(reference))
            past = abs(d) > self.threshold and abs(math.log1p(d)) > NOISE_Z * se[b]
            side = int(math.copysign(1, d)) if past else 0
            self._past_bar[b] = self._past_bar[b] + side if side and self._past_bar[b] * side > 0 else side
            if abs(self._past_bar[b]) >= PERSIST_JUDGEMENTS:
                drift[b] = d
        if not drift or any(math.isnan(t) for t in recent.values()):
            return None
        return self._propose({**recent, **{b: self._since_change(b, d, windows[b]) for b, d in drift.items()}}, drift, step, se,
                             steps_left)

    def _window_for(self, sigma: float, step_s: float) -> int:
        """Steps in the recent median for a board with step-to-step noise ``sigma`` and steps of ``step_s``:
        ``window``, or more when that is too few to tell a board at half its speed (a log drift of ln 2)
        from noise or spans less than MIN_WINDOW_S, up to MAX_WINDOW."""
        room = (math.log(2.0) / (NOISE_Z * MEDIAN_SE * sigma)) ** 2 - 1.0 / self.reference_steps if sigma > 0 else math.inf
        steps = MAX_WINDOW if room <= 1.0 / MAX_WINDOW else math.ceil(1.0 / room)
        if step_s > 0:
            steps = max(steps, math.ceil(MIN_WINDOW_S / step_s))
        return max(self.window, min(MAX_WINDOW, steps))

    def _standard_errors(self, inverse_counts: float) -> dict[str, float]:
        """Per board, the standard error (in log time) of a difference of medians of n1 and n2 steps,
        ``inverse_counts`` = 1/n1 + 1/n2, from the board's step-to-step noise."""
        return {b: MEDIAN_SE * noise_sigma(self._history[b]) * math.sqrt(inverse_counts) for b in self._batches}

    def _since_change(self, board: str, drift: float, window: int) -> float:
        """The median of ``board``'s newest run of steps past the threshold on ``drift``'s side (>= 2 steps),
        else of its recent ``window``."""
        times = list(self._since[board])
        reference, q = statistics.median(times[-window - NOISE_HISTORY:-window]), times[-window:]
        run: list[float] = []
        for seconds in reversed(q):
            if (seconds / reference - 1.0) * math.copysign(1.0, drift) <= self.threshold:
                break
            run.append(seconds)
        return statistics.median(run if len(run) >= 2 else q)

    def _propose(self, recent: dict[str, float], drift: dict[str, float], step: int | None, se: Mapping[str, float],
                 steps_left: int | None) -> RebalanceDecision | None:
        boards = list(self._batches)
        per_sample_s = np.array([recent[b] for b in boards])
        caps = np.maximum(np.array([self._caps[b] for b in boards], dtype=np.int64), 1)
        old = np.array([self._batches[b] for b in boards], dtype=np.int64)
        total = int(old.sum())
        if caps.sum() < total:  # the caps allow no other split
            return None
        new = min_max_split(np.zeros(len(boards)), per_sample_s, np.ones((1, len(boards)), dtype=bool), caps, total)[0]
        current, predicted = float(np.max(per_sample_s * old)), float(np.max(per_sample_s * new))
        slowest = boards[int(np.argmax(per_sample_s * old))]
        needed = self.min_gain if drift else max(self.min_gain, -math.expm1(-NOISE_Z * se[slowest]))  # a check: beyond noise
        pays = steps_left is None or (current - predicted) * steps_left > CHANGE_COST_STEPS * current
        if np.array_equal(new, old) or predicted > current * (1 - needed) or not pays:
            # Nothing a split can fix (every board slowed alike, or too little to gain): the drift
            # becomes the new normal, so it is not reported again on every step.
            for b in drift:  # only its newest steps stay: the reference builds again from them
                keep = list(self._since[b])[-self.window:]
                self._since[b].clear()
                self._since[b].extend(keep)
                self._past_bar[b] = 0
                self._unjudged[b] = MAX_WINDOW
            log.debug("drift %s needs no re-balance (predicted %.4f s vs %.4f s, %s steps left)", drift, predicted, current,
                      steps_left)
            return None
        why = _describe(drift, self._explain) if drift else _describe_imbalance(boards, per_sample_s * old)
        decision = RebalanceDecision(
            step=step, old_batch_sizes=dict(self._batches), new_batch_sizes=dict(zip(boards, map(int, new))),
            drift=drift, current_step_s=current, predicted_step_s=predicted,
            message=f"{why}: batches {','.join(map(str, old))} -> {','.join(map(str, new))}")
        self._batches = decision.new_batch_sizes
        for q in self._since.values():
            q.clear()
        self._past_bar = dict.fromkeys(boards, 0)
        self._unjudged = dict.fromkeys(boards, MAX_WINDOW)
        self._check_split = True
        self.decisions.append(decision)
        log.info("re-balance%s: %s (predicted step %.3f s -> %.3f s)",
                 f" at step {step}" if step is not None else "", decision.message, current, predicted)
        return decision


def noise_sigma(log_times: deque[float]) -> float:
    """A board's step-to-step noise: the robust standard deviation of its log time per sample, from the
    differences of successive steps (a level shift is one outlier among them, not spread)."""
    if len(log_times) < 3:
        return math.inf
    values = list(log_times)
    steps = [abs(b - a) for a, b in itertools.pairwise(values)]
    return statistics.median(steps) / (_NORMAL_MAD * math.sqrt(2.0))


def _describe_imbalance(boards: list[str], step_s: np.ndarray) -> str:
    slowest = int(np.argmax(step_s))
    others = np.delete(step_s, slowest)
    return (f"{boards[slowest]} still the slowest at the new sizes "
            f"({step_s[slowest]:.3f} s a step, the others {others.max() if len(others) else 0.0:.3f} s)")


def _describe(drift: Mapping[str, float], explain: Callable[[str], str] | None) -> str:
    parts = []
    for board, d in sorted(drift.items(), key=lambda item: -abs(item[1])):
        if d > 0:
            parts.append(f"{board} slowed {d:.0%}" + (f" ({explain(board)})" if explain is not None else ""))
        else:
            parts.append(f"{board} sped up ({d:+.0%} time per sample)")
    return ", ".join(parts)
