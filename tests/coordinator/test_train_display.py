"""What ``train`` shows as it runs, on a terminal and off one (the real rich display, a clock the test moves)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from edgefleet.coordinator.cli.train_progress import TrainProgress, clock_text
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.training import StepView

SPEC = JobSpec(model="mlp", dataset="synthetic", boards=("pi-1", "pi-2"), batch_sizes=(8, 8), total_steps=40,
               steps_per_epoch=10, run_id="mlp-synthetic-1", steps=40)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _view(step: int, *, loss: float = 0.5) -> StepView:
    return StepView(step=step, total_steps=40, loss=loss, val_accuracy=None, samples_per_s=320.0,
                    board_compute_s={"pi-1": 0.01, "pi-2": 0.02}, late=[], refused={})


def test_off_a_terminal_a_plain_line_comes_every_n_seconds_with_epoch_step_rate_loss_and_eta() -> None:
    # Prepare: a console that is not a terminal (a pipe, a file, journald), a line every 10 s
    out, clock = io.StringIO(), Clock()
    display = TrainProgress(Console(file=out, width=100, force_terminal=False), every_s=10.0, clock=clock)

    # Execute: the boards join, then 40 steps of 1 s each
    display.started(SPEC, Path("runs/x"), 0)
    display.joined("pi-2", 1, 2)
    display.joined("pi-1", 2, 2)
    for step in range(40):
        clock.now += 1.0
        display.step(_view(step, loss=1.0 / (step + 1)))
    display.stopped()

    # Assert: the joins, then steps 1, 11, 21, 31 (10 s apart) and the last, each whole on one line
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["run mlp-synthetic-1: 40 steps in 4 epoch(s); a progress line every 10 s (--progress-every)",
                         "board pi-2 joined (1/2)", "board pi-1 joined (2/2)"]
    progress = lines[3:]
    assert [re.search(r"step (\d+)/40", line).group(1) for line in progress] == ["1", "11", "21", "31", "40"], progress
    assert re.fullmatch(r"\d\d:\d\d:\d\d · epoch 2/4 · step 11/40 · 320 samples/s · loss 0\.0909 · ETA 0:00:29",
                        progress[1]), progress[1]
    assert progress[-1].endswith("epoch 4/4 · step 40/40 · 320 samples/s · loss 0.0250 · ETA 0:00:00")


def test_on_a_terminal_the_bar_says_which_boards_joined_and_the_epoch() -> None:
    out = io.StringIO()
    display = TrainProgress(Console(file=out, width=200, force_terminal=True, color_system=None))

    display.started(SPEC, Path("runs/x"), 0)
    waiting = display._progress.tasks[0].description if display._progress else ""
    display.joined("pi-1", 1, 2)
    one = display._progress.tasks[0].description if display._progress else ""
    display.step(_view(12))
    stepping = display._progress.tasks[0].description if display._progress else ""
    display.stopped()

    assert waiting == "waiting for 2 board(s) to join"
    assert one == "1/2 boards joined, waiting for the rest"
    assert stepping.startswith("epoch 2/4 · loss 0.5000")
    assert "board pi-1 joined (1/2)" in out.getvalue()


def test_clock_text() -> None:
    assert (clock_text(0), clock_text(245.4), clock_text(3 * 3600 + 61)) == ("0:00:00", "0:04:05", "3:01:01")
