"""A training run's figures as Prometheus metrics, served by ``train --metrics-listen`` beside the boards.

:class:`TrainingMetrics` takes the same calls as a :class:`~edgefleet.coordinator.run.train_job.TrainObserver`
(``started``, ``step``, ``stopped``) from the training loop and renders them when Prometheus scrapes.
Every metric carries the run's ``run_id`` label, so runs stay apart in Grafana. What accumulates is a
counter (steps, late and dropped steps, from 0 at the start) or a histogram (step and compute times),
so ``rate()`` and ``histogram_quantile()`` see every step whatever the scrape interval; the last
loss, throughput and batch sizes are gauges.

The page closes with the run. So that Prometheus sees the end (``edgefleet_train_running`` 0),
``train`` calls :meth:`TrainingMetrics.linger` after the run: the final state stays on the page
until :data:`FINAL_SCRAPES` scrapes have read it or the grace period (``--metrics-grace``, default
:data:`DEFAULT_GRACE_S`: two 15 s scrape intervals) is over, whichever comes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from edgefleet.coordinator.exporter.step_histogram import StepHistogram

if TYPE_CHECKING:
    from edgefleet.coordinator.run.job_spec import JobSpec
    from edgefleet.coordinator.run.training import StepView

log = logging.getLogger(__name__)

PREFIX = "edgefleet_train_"
DEFAULT_GRACE_S = 30.0  # two scrape intervals of 15 s
FINAL_SCRAPES = 2       # scrapes of the final state after which lingering ends early


class TrainingMetrics(Collector):
    """One run's figures, updated by the training loop and read by the metrics server's thread."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Condition()
        self._run_id = ""
        self._running = False
        self._planned_steps = 0
        self._completed = 0
        self._last: StepView | None = None
        self._last_at: float | None = None
        self._step_s = StepHistogram()
        self._compute_s: dict[str, StepHistogram] = {}
        self._late: Counter[str] = Counter()      # steps each board was left out of (late)
        self._refused: Counter[str] = Counter()   # steps each board's gradients were refused
        self._late_steps = 0                      # steps with a late board
        self._dropped_steps = 0                   # steps with a board left out (late or refused)
        self._scrapes_since_stop = 0

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        """The run is about to step (``first_step``: where a resumed run continues)."""
        with self._lock:
            self._run_id, self._running, self._planned_steps = spec.run_id, True, spec.total_steps
            self._completed, self._last, self._last_at = first_step, None, None
            self._step_s = StepHistogram()
            self._compute_s = {board: StepHistogram() for board in spec.boards}
            self._late, self._refused = Counter(dict.fromkeys(spec.boards, 0)), Counter(dict.fromkeys(spec.boards, 0))
            self._late_steps = self._dropped_steps = self._scrapes_since_stop = 0

    def step(self, view: StepView) -> None:
        """A step was applied. The first step's time is not counted: it includes the boards' start."""
        now = self._clock()
        with self._lock:
            if self._last_at is not None:
                self._step_s.observe(now - self._last_at)
            self._last, self._last_at = view, now
            self._planned_steps, self._completed = view.total_steps, view.step + 1
            for board, seconds in view.board_compute_s.items():
                self._compute_s.setdefault(board, StepHistogram()).observe(seconds)
            for board in (*view.board_compute_s, *view.late, *view.refused):
                self._late.setdefault(board, 0)
                self._refused.setdefault(board, 0)
            self._late.update(view.late)
            self._refused.update(view.refused.keys())
            self._late_steps += 1 if view.late else 0
            self._dropped_steps += 1 if view.late or view.refused else 0

    def stopped(self) -> None:
        """The run ended; its final figures stay until the page closes (see :meth:`linger`)."""
        with self._lock:
            if self._running:
                self._running, self._scrapes_since_stop = False, 0

    def linger(self, grace_s: float) -> bool:
        """Keep the final state on the page until :data:`FINAL_SCRAPES` scrapes read it, or ``grace_s`` passed.

        Returns True if the scrapes came. Returns at once for a run that never started.
        """
        self.stopped()
        deadline = time.monotonic() + max(grace_s, 0.0)
        with self._lock:
            if not self._run_id:
                return True
            log.debug("metrics: serving the run's final state for up to %.0f s", grace_s)
            while self._scrapes_since_stop < FINAL_SCRAPES:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            run_id = self._run_id
            if not run_id:
                return
            running, planned, completed, last = self._running, self._planned_steps, self._completed, self._last
            step_s, compute_s = self._step_s.copy(), {b: h.copy() for b, h in self._compute_s.items()}
            late, refused = dict(self._late), dict(self._refused)
            late_steps, dropped_steps = self._late_steps, self._dropped_steps
            if not running:
                self._scrapes_since_stop += 1
                self._lock.notify_all()
        run = [run_id]
        yield _gauge("running", "1 while the run steps, 0 once it ended", run, 1.0 if running else 0.0)
        yield _gauge("planned_steps", "global steps the run is to make", run, planned)
        yield _counter("completed_steps", "global steps applied (a resumed run starts at its checkpoint)", run, completed)
        yield _counter("late_steps", "steps at least one board was left out of for being late", run, late_steps)
        yield _counter("dropped_steps", "steps at least one board was left out of (late, or its gradients refused)", run,
                       dropped_steps)
        yield step_s.family(f"{PREFIX}step_seconds", "wall time of each step at the coordinator (compute, exchange, "
                                                     "validation); the first step, with the boards' start, is left out",
                            ("run_id",), run)
        compute = HistogramMetricFamily(f"{PREFIX}board_compute_seconds", "each board's compute time of each step",
                                        labels=("run_id", "board_id"))
        for board_id, histogram in sorted(compute_s.items()):
            histogram.add_to(compute, [run_id, board_id])
        yield compute
        yield _per_board(CounterMetricFamily(f"{PREFIX}board_late_steps", "steps a board was left out of for being late",
                                             labels=("run_id", "board_id")), run_id, late)
        yield _per_board(CounterMetricFamily(f"{PREFIX}board_refused_steps", "steps a board's gradients were refused",
                                             labels=("run_id", "board_id")), run_id, refused)
        if last is None:
            return
        yield _gauge("samples_per_second", "samples over all boards per second since the run (or its resume) began", run,
                     last.samples_per_s)
        if last.loss is not None:
            yield _gauge("loss", "the fleet's training loss at the last step", run, last.loss)
        if last.val_accuracy is not None:
            yield _gauge("validation_accuracy_ratio", "validation accuracy of the last evaluation (0-1)", run,
                         last.val_accuracy)
        yield _per_board(GaugeMetricFamily(f"{PREFIX}board_batch_size", "each board's samples in the last step",
                                           labels=("run_id", "board_id")), run_id, last.batch_sizes)
        logged = GaugeMetricFamily(f"{PREFIX}logged_value", "what the model logs with prog_bar=True, by name",
                                   labels=("run_id", "name"))
        for name, value in sorted(last.shown.items()):
            logged.add_metric([run_id, name], value)
        yield logged


def _gauge(name: str, text: str, run: Sequence[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}{name}", text, labels=("run_id",))
    family.add_metric(run, value)
    return family


def _counter(name: str, text: str, run: Sequence[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}{name}", text, labels=("run_id",))
    family.add_metric(run, value)
    return family


def _per_board(family: GaugeMetricFamily | CounterMetricFamily, run_id: str,
               values: dict[str, int] | dict[str, float]) -> Metric:
    for board_id, value in sorted(values.items()):
        family.add_metric([run_id, board_id], float(value))
    return family


__all__ = ["DEFAULT_GRACE_S", "FINAL_SCRAPES", "TrainingMetrics"]
