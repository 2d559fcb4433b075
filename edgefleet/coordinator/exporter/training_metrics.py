"""A training run's figures as Prometheus metrics, served by ``train --metrics-listen`` beside the boards.

:class:`TrainingMetrics` takes the same calls as a :class:`~edgefleet.coordinator.run.train_job.TrainObserver`
(``started``, ``step``, ``stopped``) from the training loop and renders the latest figures when
Prometheus scrapes. Every metric carries the run's ``run_id`` label, so runs stay apart in Grafana.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from edgefleet.coordinator.run.job_spec import JobSpec
    from edgefleet.coordinator.run.training import StepView

PREFIX = "edgefleet_train_"


class TrainingMetrics(Collector):
    """The latest step of one run, updated by the training loop and read by the metrics server's thread."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._run_id = ""
        self._running = False
        self._planned_steps = 0
        self._last: StepView | None = None
        self._last_at: float | None = None
        self._step_s: float | None = None      # between the last two steps, as the coordinator saw them
        self._late: Counter[str] = Counter()   # steps each board was left out of (late)

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        """The run is about to step (``first_step``: where a resumed run continues)."""
        with self._lock:
            self._run_id, self._running, self._planned_steps = spec.run_id, True, spec.total_steps
            self._last, self._last_at, self._step_s = None, None, None
            self._late.clear()

    def step(self, view: StepView) -> None:
        """A step was applied. The first step's time is not shown: it includes the boards' start."""
        now = self._clock()
        with self._lock:
            if self._last_at is not None:
                self._step_s = now - self._last_at
            self._last, self._last_at = view, now
            self._planned_steps = view.total_steps
            self._late.update(view.late)

    def stopped(self) -> None:
        """The run ended; its last figures stay until the process exits."""
        with self._lock:
            self._running = False

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            run_id, running, planned, last, step_s = self._run_id, self._running, self._planned_steps, self._last, self._step_s
            late = dict(self._late)
        if not run_id:
            return
        run = [run_id]

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}{name}", text, labels=("run_id",))
            family.add_metric(run, value)
            return family

        yield gauge("running", "1 while the run steps, 0 once it ended", 1.0 if running else 0.0)
        yield gauge("planned_steps", "global steps the run is to make", planned)
        if last is None:
            return
        yield gauge("completed_steps", "global steps applied so far", last.step + 1)
        yield gauge("samples_per_second", "samples over all boards per second since the run (or its resume) began",
                    last.samples_per_s)
        if step_s is not None:
            yield gauge("step_seconds", "wall time of the last step at the coordinator (compute, exchange, validation)", step_s)
        if last.loss is not None:
            yield gauge("loss", "the fleet's training loss at the last step", last.loss)
        if last.val_accuracy is not None:
            yield gauge("validation_accuracy_ratio", "validation accuracy of the last evaluation (0-1)", last.val_accuracy)
        per_board = (("board_compute_seconds", "each board's compute time of the last step", last.board_compute_s),
                     ("board_batch_size", "each board's samples in the last step", last.batch_sizes))
        for name, text, values in per_board:
            family = GaugeMetricFamily(f"{PREFIX}{name}", text, labels=("run_id", "board_id"))
            for board_id, value in sorted(values.items()):
                family.add_metric([run_id, board_id], float(value))
            yield family
        late_steps = CounterMetricFamily(f"{PREFIX}board_late_steps", "steps a board was left out of for being late",
                                         labels=("run_id", "board_id"))
        for board_id, n in sorted(late.items()):
            late_steps.add_metric([run_id, board_id], n)
        yield late_steps
        logged = GaugeMetricFamily(f"{PREFIX}logged_value", "what the model logs with prog_bar=True, by name",
                                   labels=("run_id", "name"))
        for name, value in sorted(last.shown.items()):
            logged.add_metric([run_id, name], value)
        yield logged


__all__ = ["TrainingMetrics"]
