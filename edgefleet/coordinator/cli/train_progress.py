"""A training run on the terminal: the progress bar while it steps, then the summary and where the run is."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from edgefleet.coordinator.cli.render import make_console, summary_line, summary_table
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import TrainObserver, train

if TYPE_CHECKING:
    from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics
    from edgefleet.coordinator.run.training import StepView, TrainOutcome
    from edgefleet.transport.settings import BrokerSettings

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C


def board_words(text: str) -> str:
    """Text a board sent (a name its module logged), for a line that rich renders as markup: shown as
    the characters it is, never as markup or a terminal control sequence (ESC and the like become ``?``)."""
    return escape("".join(c if c.isprintable() else "?" for c in text))


class TrainProgress(TrainObserver):
    """A progress bar with each step's loss, validation accuracy, throughput and boards; notes above it.

    With ``metrics`` (``train --metrics-listen``), every step is also handed to the Prometheus page.
    """

    def __init__(self, console: Console, *, metrics: TrainingMetrics | None = None) -> None:
        self.console = console
        self.metrics = metrics
        self.run_dir: Path | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        self.run_dir = run_dir
        if self.metrics is not None:
            self.metrics.started(spec, run_dir, first_step)
        label = "train" if spec.sync_every <= 1 else f"train (local SGD, averaging every {spec.sync_every})"
        self._progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.description}"), console=self.console,
                                  transient=False)
        self._task = self._progress.add_task("", total=spec.total_steps, completed=first_step)
        self._progress.start()

    def step(self, view: StepView) -> None:
        if self.metrics is not None:
            self.metrics.step(view)
        if self._progress is None or self._task is None:
            return
        boards = escape(" ".join(f"{b}:{s * 1000:.0f}ms" for b, s in view.board_compute_s.items()))
        acc = "-" if view.val_accuracy is None else f"{view.val_accuracy:.1%}"
        loss = "-" if view.loss is None else f"{view.loss:.4f}"
        dropped = f" [yellow]late: {escape(','.join(view.late))}[/]" if view.late else ""
        shown = "".join(f" · {board_words(name)} {value:.4g}" for name, value in view.shown.items())
        self._progress.update(self._task, completed=view.step + 1,
                              description=f"loss {loss}{shown} · val acc {acc} · {view.samples_per_s:.0f} samples/s · "
                                          f"{boards}{dropped}")

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False)  # notes hold board-provided words
        else:
            self.console.print(text, markup=False, soft_wrap=True)

    def stopped(self) -> None:
        if self.metrics is not None:
            self.metrics.stopped()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def stopped_before_training(self) -> None:
        """Say that Ctrl-C came before the first step (so there is nothing to resume)."""
        where = f" Run directory: {self.run_dir}" if self.run_dir is not None else ""
        self.console.print(f"stopped before training began; nothing to resume.{where}", markup=False)


def print_outcome(console: Console, outcome: TrainOutcome) -> int:
    """The run's summary line and table, then how to resume it or where its model is. Returns the exit status."""
    console.print(summary_line(outcome.result), markup=False)
    console.print(summary_table(outcome.result))
    if outcome.interrupted:
        console.print(f"stopped at step {outcome.result['steps']} of {outcome.result['total_steps']}; checkpoint saved. "
                      f"Continue with: edge-coordinator train --resume {outcome.run_dir}", markup=False)
        return INTERRUPTED
    console.print(f"run directory: {outcome.run_dir}  (model: {outcome.run_dir / 'model.pt'})", markup=False)
    return 0


def run_training_ui(spec: JobSpec, run_dir: Path, *, broker: BrokerSettings, fleet_key: bytes, resume: bool,
                    metrics: TrainingMetrics | None = None) -> int:
    """Train ``spec`` with a progress bar (and ``metrics``, if given, for Prometheus) and print its summary.
    Returns the exit status."""
    console = make_console()
    display = TrainProgress(console, metrics=metrics)
    try:
        outcome = train(spec, broker=broker, fleet_key=fleet_key, run_dir=run_dir, resume=resume, observer=display)
    except KeyboardInterrupt:
        display.run_dir = run_dir
        display.stopped_before_training()
        return INTERRUPTED
    return print_outcome(console, outcome)


__all__ = ["INTERRUPTED", "TrainProgress", "print_outcome", "run_training_ui"]
