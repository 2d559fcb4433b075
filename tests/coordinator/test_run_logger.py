"""The run's Lightning logger as three threads share it (the replica's Trainer, the run's event loop, the power
log), and ``metrics.jsonl`` lines that wait for their step's learning rates.

The logger is Lightning's own (TensorBoard's event files read back with TensorBoard's EventAccumulator, the
CSV file with the csv module); the Trainer's part is played by what it calls: ``log_metrics`` and
``finalize("success")`` at the end of ``fit`` and again after a last ``validate``.
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from edgefleet.coordinator.run.run_logger import (
    MAX_PENDING_LINES,
    PendingLines,
    board_scalars,
    close_logger,
    lr_scalars,
    make_logger,
    step_scalars,
)


class Boring(LightningModule):  # Lightning's BoringModel: the logger only asks which package the module is from
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)


def _log_from_threads(logger: Any, steps: int) -> None:
    """What a run does: the replica's thread and the event loop log at once, the Trainer finalizes, more follows."""
    def replica() -> None:
        for step in range(steps):
            logger.log_metrics({"val_loss": 1.0 / (step + 1)}, step=step)

    thread = threading.Thread(target=replica)
    thread.start()
    for step in range(steps):
        logger.log_metrics(step_scalars(loss=2.0 - step / steps, samples=64, interval_s=0.5, compute_s={"pi-1": 0.2},
                                        batch_sizes={"pi-1": 64}, lrs=lr_scalars("SGD", [0.1])), step=step)
    thread.join(timeout=30)
    assert not thread.is_alive()
    logger.finalize("success")  # the replica's Trainer: fit has ended
    logger.log_metrics(step_scalars(loss=0.5, samples=64, interval_s=0.5, compute_s={"pi-1": 0.2}, batch_sizes={"pi-1": 64},
                                    lrs={}), step=steps)  # the run's last step, logged after
    logger.log_metrics(board_scalars("pi-1", power_w=5.0, cpu_percent=97.5, temp_c=None), step=steps)
    logger.finalize("success")  # a last validate
    close_logger(logger)
    logger.log_metrics({"fleet_loss": 9.0}, step=steps + 1)  # the power log's last sample, after the run's end


def test_tensorboard_run_writes_one_event_file_with_every_value(tmp_path: Path) -> None:
    logger = make_logger("tensorboard", Boring(), tmp_path)

    _log_from_threads(logger, steps=20)

    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert len(events) == 1, [e.name for e in events]
    scalars = EventAccumulator(str(events[0].parent)).Reload()
    assert [e.step for e in scalars.Scalars("fleet_loss")] == list(range(21))  # not the one after close
    assert [e.step for e in scalars.Scalars("val_loss")] == list(range(20))
    assert {"compute_s/pi-1", "samples_per_s/pi-1", "fleet_samples_per_s", "lr-SGD", "power_w/pi-1",
            "cpu_percent/pi-1"} <= set(scalars.Tags()["scalars"])
    assert scalars.Scalars("samples_per_s/pi-1")[0].value == pytest.approx(320.0)  # 64 samples in 0.2 s
    assert scalars.Scalars("fleet_samples_per_s")[0].value == pytest.approx(128.0)
    assert "temp_c/pi-1" not in scalars.Tags()["scalars"]  # not reported: not logged


def test_csv_run_writes_every_value(tmp_path: Path) -> None:
    logger = make_logger("csv", Boring(), tmp_path)

    _log_from_threads(logger, steps=20)

    with (tmp_path / "logs" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["step"]) for r in rows if r["fleet_loss"]) == list(range(21))
    assert sum(1 for r in rows if r["val_loss"]) == 20
    assert [r["cpu_percent/pi-1"] for r in rows if r["cpu_percent/pi-1"]] == ["97.5"]
    assert [float(r["lr-SGD"]) for r in rows if r["lr-SGD"]] == [0.1] * 20


def test_lr_scalars_follow_learning_rate_monitors_names() -> None:
    assert lr_scalars("Adam", [0.001]) == {"lr-Adam": 0.001}
    assert lr_scalars("SGD", [0.1, 0.01]) == {"lr-SGD/pg1": 0.1, "lr-SGD/pg2": 0.01}


def test_lines_wait_for_their_steps_learning_rates_and_keep_their_order() -> None:
    written: list[dict[str, Any]] = []
    taken: dict[int, list[float]] = {}
    lines = PendingLines(written.append, lambda step: taken.pop(step, None))

    lines.add({"step": 0})
    lines.add({"step": 1})
    assert written == []  # the replica has not taken step 0 yet
    taken[0], taken[1] = [0.1], [0.05]
    lines.add({"step": 2})
    assert written == [{"step": 0, "lr": [0.1]}, {"step": 1, "lr": [0.05]}]
    lines.flush()  # a checkpoint: every line out, step 2's without rates if they never came
    assert written[-1] == {"step": 2}


def test_a_line_whose_rates_never_come_is_written_without_them() -> None:
    written: list[dict[str, Any]] = []
    lines = PendingLines(written.append, lambda step: None)

    for step in range(MAX_PENDING_LINES + 1):
        lines.add({"step": step})

    assert written == [{"step": 0}]
    lines.close()
    assert [r["step"] for r in written] == list(range(MAX_PENDING_LINES + 1))
