"""Checkpoints and the run directory: nothing is lost on a crash, nothing is half-written.

Every file is written to a temporary name in the same folder, flushed to disk and renamed over
the old one, so a crash leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
KEEP_PREVIOUS = "checkpoint.prev.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def atomic_torch_save(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as the run's checkpoint, keeping the previous one beside it."""
    path = run_dir / CHECKPOINT
    if path.exists():
        os.replace(path, run_dir / KEEP_PREVIOUS)
    atomic_torch_save(path, state)
    log.debug("checkpoint at step %s written to %s", state.get("replica", {}).get("step"), path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The run's newest readable checkpoint.

    Raises:
        ConfigError: no checkpoint, or none that can be read.
    """
    for name in (CHECKPOINT, KEEP_PREVIOUS):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
        except Exception as exc:  # a damaged file: fall back to the previous checkpoint
            log.warning("checkpoint %s cannot be read (%s); trying the previous one", path, exc)
    raise ConfigError(f"{run_dir} has no readable checkpoint ({CHECKPOINT}); it cannot be resumed. Start a new run instead.")


class MetricsLog:
    """``metrics.jsonl``: one line per applied step, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        """Drop lines for steps >= ``step`` (written after the checkpoint a resume starts from)."""
        if not path.exists():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", -1) < step]
        atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")
