"""New telemetry samples of some boards, as they reach a fleet view.

A :class:`~edgefleet.coordinator.control.fleet.FleetView` keeps only each board's latest sample.
What must see every sample (the power meter's windows, the run's ``power.jsonl``) polls the view on
a small thread: :class:`SamplePoller` does that once for all of them and hands each poll's new
samples (new by ``seq``) of the boards it follows to its callback, each with its board's id (as the
view keys it) and the local time they were seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.protocol.messages import TelemetrySample

NewSamples = Callable[[float, list[tuple[str, TelemetrySample]]], None]  # (seen at, (board id, sample) in view order)


class SamplePoller:
    """Polls ``view`` every ``poll_s`` on a daemon thread named ``name`` until :meth:`close`.

    :meth:`collect` may also be called from other threads (a last read before closing, a wait for a
    late sample): polls never overlap, and no sample is handed over twice.
    """

    def __init__(self, view: FleetView, boards: Iterable[str], on_new: NewSamples, *, poll_s: float, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view, self.boards, self.poll_s, self.clock = view, frozenset(boards), poll_s, clock
        self._on_new = on_new
        self._last_seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=name, daemon=True)
        self._thread.start()

    def collect(self) -> None:
        """Read the view once and hand over what is new."""
        with self._lock:
            now = self.clock()
            new = []
            for row in self.view.rows():
                sample = row.sample
                if sample is None or row.board_id not in self.boards or self._last_seq.get(row.board_id) == sample.seq:
                    continue
                self._last_seq[row.board_id] = sample.seq
                new.append((row.board_id, sample))  # the id of its topic, as the view keys it
            if new:
                self._on_new(now, new)

    def close(self) -> None:
        """Stop polling (waits up to 2 s for the thread)."""
        self._closed.set()
        self._thread.join(timeout=2.0)

    def _poll(self) -> None:
        while not self._closed.wait(self.poll_s):  # the first read one period in (call collect() for one now)
            self.collect()


__all__ = ["NewSamples", "SamplePoller"]
