"""The run's Lightning logger (``train --logger``) and what the coordinator writes into it.

The logger is Lightning's own CSVLogger or TensorBoardLogger, writing into ``RUN_DIR/logs``. Three
writers share it: the replica's Trainer (what the module logs with ``self.log``, in the replica's
thread), the run's event loop (each step's fleet figures: :func:`step_scalars`) and the power log's
thread (each board's power, CPU and temperature: :func:`board_scalars`). Lightning's loggers are
not made for that: TensorBoardLogger's ``finalize``, which the Trainer calls when ``fit`` (and again
when a last ``validate``) ends, closes its SummaryWriter, and the next value logged opens another
event file in the same folder; a run's ``fleet_loss`` ended up split over two files. The logger
made here is the same class with a lock around every write, and a ``finalize`` that only flushes:
the run closes it once, at its very end (:func:`close_logger`), so a run has one event file.

``metrics.jsonl`` lines carry the learning rates each step was taken with (``lr``, one per param
group), which the replica's Trainer knows once it has taken the step; :class:`PendingLines` holds a
line until then (the replica may trail the exchange by a few steps).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edgefleet.protocol.errors import ConfigError, EdgeTrainError
from edgefleet.workloads.lightning_api import package_of

log = logging.getLogger(__name__)

LOGGERS = ("none", "csv", "tensorboard")
MAX_PENDING_LINES = 8   # beyond the replica's lag (replica.LAG_STEPS): a step whose rates never come is written without


class _SharedWriter:
    """Mixed in before a Lightning logger class: one lock around its writes, and no close before the run's end.

    Its ``super()`` is that logger class, chosen at run time from the module's Lightning package
    (``make_logger``): mypy sees ``object`` there, hence the ``type: ignore[misc]`` on each call into it.
    Typing the base as Lightning's abstract ``Logger`` instead is refused too (its abstract methods).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._edgefleet_lock = threading.RLock()
        self._edgefleet_closed = False  # after the run's end a value would open a second event file: dropped

    @property
    def experiment(self) -> Any:
        with self._edgefleet_lock:  # made on first use: by one thread only
            return super().experiment  # type: ignore[misc]

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        with self._edgefleet_lock:
            if self._edgefleet_closed:
                log.debug("after the run's end, not logged: %s", sorted(metrics))
                return
            super().log_metrics(metrics, step)  # type: ignore[misc]

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        with self._edgefleet_lock:
            super().log_hyperparams(*args, **kwargs)  # type: ignore[misc]

    def save(self) -> None:
        with self._edgefleet_lock:
            super().save()  # type: ignore[misc]

    def finalize(self, status: str) -> None:
        """The Trainer's end (of ``fit``, of a ``validate``): write out what is buffered, keep the writer open."""
        with self._edgefleet_lock:
            self.save()
            writer = getattr(self, "_experiment", None)  # TensorBoard's SummaryWriter, once made
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()

    def close_run(self) -> None:
        """The run's end: Lightning's own finalize (TensorBoard's closes its writer)."""
        with self._edgefleet_lock:
            if not self._edgefleet_closed:
                self._edgefleet_closed = True
                super().finalize("success")  # type: ignore[misc]


def make_logger(kind: str, model: Any, run_dir: Path) -> Any:
    """Lightning's logger of ``kind`` from the module's own package, writing under ``run_dir/logs``; False for none.

    Raises:
        ConfigError: an unknown kind, or TensorBoard's writer is not installed.
    """
    if kind == "none":
        return False
    loggers = package_of(model).loggers
    if kind == "csv":
        return _shared(loggers.CSVLogger)(save_dir=str(run_dir), name="logs", version="")
    if kind == "tensorboard":
        try:
            return _shared(loggers.TensorBoardLogger)(save_dir=str(run_dir), name="logs", version="",
                                                      default_hp_metric=False)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"--logger tensorboard needs TensorBoard's writer ({exc}): pip install tensorboard") from None
    raise ConfigError(f"--logger {kind!r} is not one of {', '.join(LOGGERS)}")


def _shared(base: type) -> type:
    return type(base.__name__, (_SharedWriter, base), {"__module__": __name__})


def close_logger(logger: Any) -> None:
    """Close the run's logger at its end (once; a logger not made by :func:`make_logger` is finalized as Lightning does)."""
    if not logger:
        return
    try:
        if isinstance(logger, _SharedWriter):
            logger.close_run()
        else:
            logger.finalize("success")
    except OSError as exc:
        log.warning("the run's logger could not write its last values: %s", exc)


def lr_scalars(optimizer_name: str, lrs: list[float]) -> dict[str, float]:
    """Learning rates under LearningRateMonitor's names: ``lr-SGD``, or ``lr-SGD/pg1``... for several param groups."""
    if len(lrs) == 1:
        return {f"lr-{optimizer_name}": lrs[0]}
    return {f"lr-{optimizer_name}/pg{i + 1}": lr for i, lr in enumerate(lrs)}


def step_scalars(*, loss: float | None, samples: int, interval_s: float | None, compute_s: Mapping[str, float],
                 batch_sizes: Mapping[str, int], lrs: dict[str, float]) -> dict[str, float]:
    """One step's figures for the logger: the fleet's loss and samples/s, each board's compute time and samples/s,
    and the learning rates (:func:`lr_scalars`)."""
    scalars = dict(lrs)
    if loss is not None:
        scalars["fleet_loss"] = loss
    if interval_s is not None and interval_s > 0:
        scalars["fleet_samples_per_s"] = samples / interval_s
    for board, seconds in compute_s.items():
        scalars[f"compute_s/{board}"] = seconds
        if seconds > 0 and board in batch_sizes:
            scalars[f"samples_per_s/{board}"] = batch_sizes[board] / seconds
    return scalars


def board_scalars(board: str, *, power_w: float | None, cpu_percent: float | None,
                  temp_c: float | None) -> dict[str, float]:
    """One telemetry sample of ``board`` for the logger: ``power_w/<board>``, ``cpu_percent/<board>``, ``temp_c/<board>``."""
    figures = {"power_w": power_w, "cpu_percent": cpu_percent, "temp_c": temp_c}
    return {f"{name}/{board}": float(value) for name, value in figures.items() if value is not None}


class PendingLines:
    """``metrics.jsonl`` lines waiting for the learning rates of their step (``lr``).

    Args:
        write: Appends one line (``MetricsLog.write``).
        learning_rates_at: The rates a step was taken with, once the replica has taken it (``Replica.learning_rates_at``).
    """

    def __init__(self, write: Callable[[dict[str, Any]], None],
                 learning_rates_at: Callable[[int], list[float] | None]) -> None:
        self.write, self.learning_rates_at = write, learning_rates_at
        self._lines: deque[dict[str, Any]] = deque()

    def add(self, record: dict[str, Any]) -> None:
        """Queue the line of a step and write every line whose rates are known now, in step order."""
        self._lines.append(record)
        self.flush(every=False)

    def flush(self, *, every: bool = True) -> None:
        """Write the lines whose rates are known; with ``every`` (the replica has taken every step) all of them.

        Raises:
            RunDirError: a line could not be written (it stays queued).
        """
        while self._lines:
            record = self._lines[0]
            lrs = self.learning_rates_at(record["step"])
            if lrs is None and not every and len(self._lines) <= MAX_PENDING_LINES:
                return
            if lrs is not None:
                record["lr"] = lrs
            self.write(record)
            self._lines.popleft()

    def close(self) -> None:
        """Write what is queued (the run is ending, perhaps on another error: a failure is logged, not raised)."""
        try:
            self.flush(every=True)
        except (EdgeTrainError, OSError) as exc:
            log.warning("%d line(s) of metrics.jsonl could not be written: %s", len(self._lines), exc)


__all__ = ["LOGGERS", "PendingLines", "board_scalars", "close_logger", "lr_scalars", "make_logger", "step_scalars"]
