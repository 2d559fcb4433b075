"""Average each board's power draw from its live telemetry over a time window.

The agents publish ``power_w`` (with its ``power_source``) every ``interval_s``; a
:class:`FleetView` keeps only the latest sample per board, so :class:`PowerMeter` polls the view
on a small thread and keeps every new sample (by ``seq``) with the local time it was seen. A window
is then the samples seen between two local times. Samples are evenly spaced, so the window's
average is the plain mean of its samples.

A window shorter than a board's interval may hold no sample of that board; :meth:`PowerMeter.stop`
then waits (at most 1.5 intervals) for the next one, which covers the window's end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.control.sample_poller import SamplePoller
from edgefleet.protocol.messages import TelemetrySample, is_measured

log = logging.getLogger(__name__)

POLL_S = 0.05          # how often the view is read; well below the shortest telemetry interval in use
LATE_SAMPLE_WAIT = 1.5  # intervals stop() waits for a board that sent nothing inside the window


@dataclass(frozen=True, slots=True)
class PowerReading:
    """One board's average power over a window."""

    board_id: str
    mean_power_w: float | None   # None: no sample with a power figure
    samples: int                 # samples averaged
    power_source: str            # "estimated", a sensor name, or "none"

    @property
    def measured(self) -> bool:
        """True when the figure came from a sensor, not from the agent's CPU-load estimate."""
        return self.mean_power_w is not None and is_measured(self.power_source)


@dataclass(frozen=True, slots=True)
class _Seen:
    at: float            # local monotonic time the sample was first seen
    seq: int
    power_w: float | None
    power_source: str
    interval_s: float


class PowerMeter:
    """Keeps every telemetry sample of some boards while running; averages them over windows.

    Use as a context manager (or call :meth:`close`)::

        with monitor_fleet(broker) as view, PowerMeter(view, ["pi-1", "pi-2"]) as meter:
            meter.start()
            ...                                  # the work being measured
            readings = meter.stop()              # {board_id: PowerReading}
    """

    def __init__(self, view: FleetView, boards: Iterable[str], *, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view, self.boards, self.poll_s, self.clock = view, list(boards), poll_s, clock
        self._seen: dict[str, list[_Seen]] = {b: [] for b in self.boards}
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._poller = SamplePoller(view, self.boards, self._keep, poll_s=poll_s, name="power-meter", clock=clock)
        self._poller.collect()  # what the view holds already, seen now

    def __enter__(self) -> PowerMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._poller.close()

    def _keep(self, now: float, samples: list[tuple[str, TelemetrySample]]) -> None:
        with self._lock:
            for board, s in samples:
                self._seen[board].append(_Seen(now, s.seq, s.power_w, s.power_source, s.interval_s))

    def start(self) -> float:
        """Open a window now; returns its start (local monotonic seconds)."""
        self._window_start = self.clock()
        return self._window_start

    def stop(self, *, wait_for_late: bool = True) -> dict[str, PowerReading]:
        """Close the window opened by :meth:`start` and average each board's samples in it.

        Args:
            wait_for_late: For a board with no sample inside the window, wait up to 1.5 of its
                intervals for the next one (it covers the window's end) instead of reporting none.
        """
        if self._window_start is None:
            raise RuntimeError("PowerMeter.stop() without start()")
        start, end = self._window_start, self.clock()
        self._window_start = None
        return self.average(start, end, wait_for_late=wait_for_late)

    def average(self, start: float, end: float, *, wait_for_late: bool = True) -> dict[str, PowerReading]:
        """Each board's mean power over samples seen between ``start`` and ``end`` (local monotonic s)."""
        readings = {b: self._average(b, start, end) for b in self.boards}
        late = [b for b, r in readings.items() if r.samples == 0 and self._interval(b) is not None]
        if wait_for_late and late:  # a real wait, whatever clock stamps the samples
            deadline = time.monotonic() + LATE_SAMPLE_WAIT * max(self._interval(b) or 0.0 for b in late)
            while late and time.monotonic() < deadline:
                self._poller.collect()
                for board in list(late):
                    reading = self._average(board, start, float("inf"), first_only=True)
                    if reading.samples:
                        readings[board] = reading
                        late.remove(board)
                if late:
                    time.sleep(self.poll_s)
        for board, reading in readings.items():
            log.debug("power %s: %s W over %d samples (%s)", board, reading.mean_power_w, reading.samples,
                      reading.power_source)
        return readings

    def seen(self, board: str) -> int:
        """How many samples of ``board`` the meter has kept so far."""
        with self._lock:
            return len(self._seen.get(board, ()))

    def _interval(self, board: str) -> float | None:
        with self._lock:
            seen = self._seen[board]
            return seen[-1].interval_s if seen else None

    def _average(self, board: str, start: float, end: float, *, first_only: bool = False) -> PowerReading:
        with self._lock:
            inside = [s for s in self._seen[board] if start <= s.at <= end]
        if first_only:
            inside = inside[:1]
        figures = [s.power_w for s in inside if s.power_w is not None]
        sources = sorted({s.power_source for s in inside if s.power_w is not None})
        source = sources[0] if len(sources) == 1 else ("+".join(sources) if sources else "none")
        return PowerReading(board_id=board, mean_power_w=sum(figures) / len(figures) if figures else None,
                            samples=len(figures), power_source=source)


__all__ = ["PowerMeter", "PowerReading"]
