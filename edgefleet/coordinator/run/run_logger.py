"""The run's Lightning logger (``train --logger``): what the module logs with ``self.log`` in its
``validation_step`` (run by the coordinator's replica), and the fleet's loss at every step,
written by Lightning's own CSVLogger or TensorBoardLogger into the run directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.lightning_api import package_of

log = logging.getLogger(__name__)

LOGGERS = ("none", "csv", "tensorboard")


def make_logger(kind: str, model: Any, run_dir: Path) -> Any:
    """Lightning's logger of ``kind`` from the module's own package, writing under ``run_dir/logs``; False for none.

    Raises:
        ConfigError: an unknown kind, or TensorBoard's writer is not installed.
    """
    if kind == "none":
        return False
    loggers = package_of(model).loggers
    if kind == "csv":
        return loggers.CSVLogger(save_dir=str(run_dir), name="logs", version="")
    if kind == "tensorboard":
        try:
            return loggers.TensorBoardLogger(save_dir=str(run_dir), name="logs", version="", default_hp_metric=False)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"--logger tensorboard needs TensorBoard's writer ({exc}): pip install tensorboard") from None
    raise ConfigError(f"--logger {kind!r} is not one of {', '.join(LOGGERS)}")


__all__ = ["LOGGERS", "make_logger"]
