"""A rate limit for warnings that a peer can trigger at will (junk on a topic, a malformed message).

Whoever sends junk a thousand times a second must not fill the log: the first warnings go through,
the rest of the window is counted, and the next warning that goes through says how many were not shown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 60.0


@dataclass
class LogLimiter:
    """Lets at most ``burst`` warnings through per ``window_s``; counts the others. Thread-safe."""

    window_s: float = DEFAULT_WINDOW_S
    burst: int = 1
    clock: Callable[[], float] = time.monotonic
    _window_start: float = field(default=float("-inf"), repr=False)
    _passed: int = field(default=0, repr=False)
    _suppressed: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def allow(self) -> int | None:
        """None: stay quiet (this one is counted). Otherwise log now: the number not shown since the last one."""
        with self._lock:
            now = self.clock()
            if now - self._window_start >= self.window_s:
                self._window_start, self._passed = now, 0
            if self._passed >= self.burst:
                self._suppressed += 1
                return None
            self._passed += 1
            suppressed, self._suppressed = self._suppressed, 0
            return suppressed


def suppressed_text(count: int, window_s: float = DEFAULT_WINDOW_S) -> str:
    """`` (N more not shown …)`` for a warning that follows suppressed ones; empty when there were none."""
    return f" ({count} more like it not shown in the last {window_s:.0f} s)" if count else ""


__all__ = ["DEFAULT_WINDOW_S", "LogLimiter", "suppressed_text"]
