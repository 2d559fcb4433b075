"""What a worker tells the agent: JSON lines on its stdout (``phase``, ``message`` and the phase's fields)."""

from __future__ import annotations

import json
import time
from typing import IO, Any

PROGRESS_EVERY_S = 1.0


class EventWriter:
    """JSON lines for the agent, at most one progress line per second."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._last_progress = 0.0

    def emit(self, phase: str, message: str = "", **fields: Any) -> None:
        self.stream.write(json.dumps({"phase": phase, "message": message, **fields}) + "\n")
        self.stream.flush()

    def progress(self, step: int, loss: float | None, compute_s: float) -> None:
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.emit("progress", step=step, loss=loss, compute_s=round(compute_s, 6))


__all__ = ["PROGRESS_EVERY_S", "EventWriter"]
