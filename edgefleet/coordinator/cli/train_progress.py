"""A training run as people watch it: a progress bar on a terminal, plain lines everywhere else, then the
summary and where the run is (or, with ``--json``, the result as one JSON document on stdout).

On a terminal the bar says which boards have joined while they load (a Pi takes tens of seconds),
then each step's epoch, loss, validation accuracy, throughput and boards. Under ``nohup``, systemd or
``| tee`` a bar would print nothing until the run ends: there each board's joining is a line, and
every ``--progress-every`` seconds one line gives the time, epoch, step, samples/s, loss and ETA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.outer_optimizer import AVERAGE, DILOCO, SGD
from edgefleet.workloads.quiet_lightning import quiet_lightning

if TYPE_CHECKING:
    from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics
    from edgefleet.coordinator.run.training import StepView, TrainOutcome
    from edgefleet.transport.settings import BrokerSettings

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C
DEFAULT_PROGRESS_EVERY_S = 30.0  # a plain progress line this often when the output is not a terminal


@dataclass(frozen=True, slots=True, kw_only=True)
class DisplayOptions:
    """How ``train`` shows a run (its ``--progress-every``, ``--json`` and ``-v``)."""

    every_s: float = DEFAULT_PROGRESS_EVERY_S  # seconds between plain progress lines (0: every step)
    json: bool = False                         # the result as JSON on stdout; progress and notes on stderr
    verbose: bool = False                      # Lightning's INFO lines too (at DEBUG)


def display_options(args: argparse.Namespace) -> DisplayOptions:
    """How ``train`` shows the run: ``--progress-every``, ``--json`` and ``-v``.

    Raises:
        ConfigError: a negative ``--progress-every``.
    """
    every = getattr(args, "progress_every", DEFAULT_PROGRESS_EVERY_S)
    if not every >= 0:
        raise ConfigError(f"--progress-every {every:g}: give the seconds between progress lines, 0 or more")
    return DisplayOptions(every_s=every, json=getattr(args, "json", False), verbose=getattr(args, "verbose", False))


def printable(text: str) -> str:
    """Text a board sent, with control characters (ESC and the like) shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def board_words(text: str) -> str:
    """Text a board sent (a name its module logged), for a line that rich renders as markup: shown as
    the characters it is, never as markup or a terminal control sequence (ESC and the like become ``?``)."""
    return escape(printable(text))


def clock_text(seconds: float) -> str:
    """``0:04:05`` for 245 s."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class TrainProgress(TrainObserver):
    """A run's progress: a bar on a terminal, a plain line every ``every_s`` seconds on anything else; notes
    and each board's joining as lines.

    With ``metrics`` (``train --metrics-listen``), every step is also handed to the Prometheus page.
    """

    def __init__(self, console: Console, *, metrics: TrainingMetrics | None = None,
                 every_s: float = DEFAULT_PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.metrics = metrics
        self.every_s = every_s
        self.clock = clock
        self.plain = not console.is_terminal
        self.run_dir: Path | None = None
        self._spec: JobSpec | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._first: tuple[int, float] | None = None  # the first step seen and when it ended: the ETA's origin
        self._printed_at = -math.inf

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        self.run_dir, self._spec = run_dir, spec
        if self.metrics is not None:
            self.metrics.started(spec, run_dir, first_step)
        if self.plain:  # the boards' joining and the steps follow as lines
            epochs = self._epochs()
            self._line(f"run {spec.run_id}: {spec.total_steps} steps" + (f" in {epochs} epoch(s)" if epochs else "")
                       + f"; a progress line every {self.every_s:g} s (--progress-every)")
            return
        waiting = f"waiting for {len(spec.boards)} board(s) to join" if spec.boards else ""
        label = "train" if spec.sync_every <= 1 else f"train ({_periodic_name(spec.outer_optimizer)}, averaging every {spec.sync_every})"
        self._progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.description}"), console=self.console,
                                  transient=False)
        self._task = self._progress.add_task(waiting, total=spec.total_steps, completed=first_step)
        self._progress.start()

    def joined(self, board: str, joined: int, boards: int) -> None:
        self.note(f"board {board} joined ({joined}/{boards})")
        if self._progress is not None and self._task is not None and joined < boards:
            self._progress.update(self._task, description=f"{joined}/{boards} boards joined, waiting for the rest")
        elif self._progress is not None and self._task is not None:
            self._progress.update(self._task, description="every board joined; the first step runs")

    def _epochs(self) -> int:
        spec = self._spec
        return math.ceil(spec.total_steps / spec.steps_per_epoch) if spec and spec.steps_per_epoch > 0 else 0

    def _epoch(self, step: int) -> str:
        epochs, spec = self._epochs(), self._spec
        return f"epoch {min(step // spec.steps_per_epoch + 1, epochs)}/{epochs}" if epochs and spec else ""

    def step(self, view: StepView) -> None:
        if self.metrics is not None:
            self.metrics.step(view)
        if self.plain:
            self._plain_step(view)
            return
        if self._progress is None or self._task is None:
            return
        boards = escape(" ".join(f"{b}:{s * 1000:.0f}ms" for b, s in view.board_compute_s.items()))
        acc = "-" if view.val_accuracy is None else f"{view.val_accuracy:.1%}"
        loss = "-" if view.loss is None else f"{view.loss:.4f}"
        dropped = f" [yellow]late: {escape(','.join(view.late))}[/]" if view.late else ""
        shown = "".join(f" · {board_words(name)} {value:.4g}" for name, value in view.shown.items())
        epoch = self._epoch(view.step)
        self._progress.update(self._task, completed=view.step + 1,
                              description=f"{epoch + ' · ' if epoch else ''}loss {loss}{shown} · val acc {acc} · "
                                          f"{view.samples_per_s:.0f} samples/s · {boards}{dropped}")

    def _plain_step(self, view: StepView) -> None:
        """One line on the first step, every ``every_s`` seconds and on the last step."""
        now = self.clock()
        if self._first is None:
            self._first = (view.step, now)
        last = view.step + 1 >= view.total_steps
        if now - self._printed_at < self.every_s and not last and view.step != self._first[0]:
            return
        self._printed_at = now
        first_step, first_at = self._first
        done = view.step - first_step
        eta = clock_text((now - first_at) / done * (view.total_steps - view.step - 1)) if done > 0 else "-"
        parts = [time.strftime("%H:%M:%S"), self._epoch(view.step), f"step {view.step + 1}/{view.total_steps}",
                 f"{view.samples_per_s:.0f} samples/s", "loss -" if view.loss is None else f"loss {view.loss:.4f}"]
        if view.val_accuracy is not None:
            parts.append(f"val acc {view.val_accuracy:.1%}")
        parts += [f"{printable(name)} {value:.4g}" for name, value in view.shown.items()]
        if view.late:
            parts.append(f"late: {printable(','.join(view.late))}")
        parts.append(f"ETA {eta}")
        self._line(" · ".join(p for p in parts if p))

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)  # notes hold board-provided words
        else:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

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


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def outcome_json(outcome: TrainOutcome, **extra: Any) -> str:
    """``train --json``'s document: result.json's fields, the run directory and the model file (None if
    interrupted), and ``extra``."""
    document = {**outcome.result, "run_dir": str(outcome.run_dir),
                "model": None if outcome.interrupted else str(outcome.run_dir / "model.pt"), **extra}
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def print_json_outcome(outcome: TrainOutcome, **extra: Any) -> int:
    """Print :func:`outcome_json` on stdout; returns the exit status."""
    sys.stdout.write(outcome_json(outcome, **extra) + "\n")
    sys.stdout.flush()
    return INTERRUPTED if outcome.interrupted else 0


def run_training_ui(spec: JobSpec, run_dir: Path, *, broker: BrokerSettings, fleet_key: bytes, resume: bool,
                    metrics: TrainingMetrics | None = None, options: DisplayOptions | None = None) -> int:
    """Train ``spec`` showing its progress (and feeding ``metrics``, if given, for Prometheus), then print its
    summary, or with ``options.json`` its result as JSON. Returns the exit status."""
    options = options or DisplayOptions()
    quiet_lightning(verbose=options.verbose)
    console = make_console(stderr=options.json)
    display = TrainProgress(console, metrics=metrics, every_s=options.every_s)
    try:
        outcome = train(spec, broker=broker, fleet_key=fleet_key, run_dir=run_dir, resume=resume, observer=display)
    except KeyboardInterrupt:
        display.run_dir = run_dir
        display.stopped_before_training()
        return INTERRUPTED
    if options.json:
        return print_json_outcome(outcome)
    return print_outcome(console, outcome)



def _periodic_name(outer_optimizer: str) -> str:
    """How the progress bar names a periodic-averaging run: local SGD (plain averages) or its outer optimizer."""
    names = {AVERAGE: "local SGD", DILOCO: "DiLoCo", SGD: "local SGD, outer SGD"}
    return names.get(outer_optimizer, outer_optimizer)

__all__ = [
    "DEFAULT_PROGRESS_EVERY_S",
    "INTERRUPTED",
    "DisplayOptions",
    "TrainProgress",
    "clock_text",
    "display_options",
    "outcome_json",
    "print_json_outcome",
    "print_outcome",
    "printable",
    "run_training_ui",
]
