"""``power.jsonl``: every board's power, CPU load and temperature while a run trains, for the run's report.

``metrics.jsonl`` holds what the exchange sees (loss, compute times, batch sizes); power comes from
the boards' telemetry over MQTT, which only a :class:`~edgefleet.coordinator.control.fleet.FleetView`
sees. :class:`PowerLog` appends one line per new sample (by ``seq``, from a
:class:`~edgefleet.coordinator.control.sample_poller.SamplePoller` on such a view) of the boards it follows::

    {"board_id": "pi-1", "seen_s": 12.48, "ts": 1763720112.3, "seq": 41, "power_w": 6.1,
     "power_source": "estimated", "cpu_percent": 87.5, "temp_c": 61.2}

``seen_s`` counts seconds on the coordinator's clock from when the log was opened (the boards'
``ts`` clocks need not agree with it or with each other); a resumed run's log continues the count
from its last line, so the time the run was stopped is left out. A line is written whole; the
report skips one a crash cut short. ``cpu_percent`` (all cores, 0-100) and ``temp_c`` (the hottest
sensor) are null where the board does not report them; logs written before they were added lack them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.control.sample_poller import SamplePoller
from edgefleet.protocol.messages import TelemetrySample

log = logging.getLogger(__name__)

POWER_FILE = "power.jsonl"
POLL_S = 0.1   # well below the shortest telemetry interval in use (1 s)


def _logged_s(path: Path) -> float:
    """The last ``seen_s`` of an existing log (a resumed run's), or 0."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            seen = json.loads(line).get("seen_s")
        except (ValueError, AttributeError):
            continue
        if isinstance(seen, (int, float)):
            return float(seen)
    return 0.0


class PowerLog:
    """Appends the followed boards' power samples to ``path`` until closed.

    Use as a context manager around the run::

        with monitor_fleet(broker) as view, PowerLog(view, spec.boards, run_dir / POWER_FILE):
            train(...)

    A failure to write stops the log with a warning; it never stops the run.

    ``on_sample(board, sample)`` is called with each sample written (the run's logger takes them), in the poller's
    thread; an exception it raises is logged and the log goes on.
    """

    def __init__(self, view: FleetView, boards: Iterable[str], path: Path, *, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_sample: Callable[[str, TelemetrySample], None] | None = None) -> None:
        self.view, self.boards, self.path, self.poll_s, self.clock = view, set(boards), path, poll_s, clock
        self.on_sample = on_sample
        self._started = clock() - _logged_s(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._poller = SamplePoller(view, self.boards, self._write, poll_s=poll_s, name="power-log", clock=clock)

    def __enter__(self) -> PowerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop polling, write what the view holds now, and close the file."""
        self._poller.close()
        if not self._file.closed:
            self._poller.collect()
            self._file.close()

    def _write(self, now: float, samples: list[tuple[str, TelemetrySample]]) -> None:
        if self._file.closed:
            return
        seen_s = round(now - self._started, 3)
        lines = [json.dumps({"board_id": board, "seen_s": seen_s, "ts": s.ts, "seq": s.seq, "power_w": s.power_w,
                             "power_source": s.power_source, "cpu_percent": s.cpu_percent, "temp_c": s.temp_c},
                            sort_keys=True) + "\n" for board, s in samples]
        try:
            self._file.write("".join(lines))
            self._file.flush()
        except OSError as exc:
            log.warning("%s: cannot write power readings (%s); the run's report will lack the rest", self.path, exc)
            self._file.close()
            return
        if self.on_sample is None:
            return
        for board, sample in samples:
            try:
                self.on_sample(board, sample)
            except Exception as exc:  # the run's logger failing (a full disk): the power log goes on
                log.warning("%s: a power sample of %s was not passed on: %s", self.path, board, exc)

__all__ = ["POWER_FILE", "PowerLog"]
