"""Counters the way node_exporter exposes them, folded from the boards' samples as they arrive.

A board reports rates averaged over its own sampling interval (``cpu_percent``, ``net_rx_bytes_per_s``,
``power_w``): exported as gauges, a 15 s scrape would see one interval in fifteen, and ``rate()`` or
``increase()`` could not be used. Here every accepted sample adds its rate times the time it covers
to a per-board total (CPU seconds by mode, bytes, joules), so ``rate(…_total[5m])`` is the true mean
over any window, whatever the scrape interval.

Energy is the board's own counter where it sends one (``energy_wh``, the agent's integral of every
reading): its increase since the previous sample is added, which also covers samples lost on the way.
Otherwise, and when that counter went back (its record was reset), it is ``power_w`` times the time
the sample covers.

The time a sample covers is the gap to the board's previous sample (its rates are averages since
that one was read), at most :data:`MAX_GAP_INTERVALS` of its intervals: a sample or two lost on the
way (telemetry is QoS 0) are filled with the next one's rate, a longer silence is not guessed at. A
board's first sample seen, or the first after the agent restarted (``seq`` went back), counts one
interval. The totals live in the exporter and start at 0 when it starts; Prometheus' ``rate()``
handles that as a counter reset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from edgefleet.coordinator.exporter.telemetry_metrics import RATE_SUFFIX
from edgefleet.protocol.messages import BoardCaps, TelemetrySample, is_measured

MAX_GAP_INTERVALS = 3.0  # as the fleet view's stale limit: a longer gap is not filled in
# The byte-rate fields with established names (node_exporter's node_network_receive_bytes_total).
NAMED_BYTE_COUNTERS = {"net_rx_bytes_per_s": "network_receive_bytes", "net_tx_bytes_per_s": "network_transmit_bytes"}
ENERGY_SOURCES = ("measured", "estimated")  # the energy counter's source label: a sensor's reading, or a model's


def byte_counter_stem(field_name: str) -> str | None:
    """The counter a byte-rate field feeds (``net_rx_bytes_per_s`` -> ``network_receive_bytes``), None for other fields."""
    if field_name in NAMED_BYTE_COUNTERS:
        return NAMED_BYTE_COUNTERS[field_name]
    if field_name.endswith(RATE_SUFFIX) and len(field_name) > len(RATE_SUFFIX):
        return field_name[: -len(RATE_SUFFIX)] + "_bytes"
    return None


@dataclass(slots=True)
class BoardTotals:
    """One board's totals since the exporter started."""

    cpu_busy_s: float = 0.0     # CPU seconds, summed over the CPUs the board reports on
    cpu_idle_s: float = 0.0
    cpu_seen: bool = False      # the board reports CPU load: the counters are exported (at 0 before the first)
    bytes: dict[str, float] = field(default_factory=dict)        # counter stem -> bytes
    energy_j: dict[str, float] = field(default_factory=dict)     # ENERGY_SOURCES -> joules
    last_ts: float | None = None
    last_seq: int | None = None
    last_energy_wh: float | None = None   # the board's own energy counter in its last sample

    def copy(self) -> BoardTotals:
        return BoardTotals(self.cpu_busy_s, self.cpu_idle_s, self.cpu_seen, dict(self.bytes), dict(self.energy_j),
                           self.last_ts, self.last_seq, self.last_energy_wh)


def cpu_count(sample: TelemetrySample, caps: BoardCaps | None) -> float:
    """The CPUs ``cpu_percent`` is a share of: the agent's quota or CPUs from its caps, else the per-core list, else 1."""
    if caps is not None and caps.cpu_cores > 0:
        return caps.cpu_cores
    if caps is not None and caps.cores > 0:
        return float(caps.cores)
    return float(len(sample.cpu_percent_per_core) or 1)


def covered_s(totals: BoardTotals, sample: TelemetrySample) -> float:
    """The seconds ``sample``'s rates stand for (see the module's docstring)."""
    interval = max(sample.interval_s, 0.0)
    if totals.last_ts is None or totals.last_seq is None or sample.seq <= totals.last_seq:
        return interval
    return min(max(sample.ts - totals.last_ts, 0.0), MAX_GAP_INTERVALS * interval)


class BoardCounters:
    """Per-board totals, fed by :meth:`add` (the fleet view's ``on_sample``) and read at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boards: dict[str, BoardTotals] = {}

    def add(self, sample: TelemetrySample, caps: BoardCaps | None) -> None:
        """Fold one accepted sample into its board's totals."""
        with self._lock:
            totals = self._boards.setdefault(sample.board_id, BoardTotals())
            if totals.last_seq is not None and sample.seq == totals.last_seq and sample.ts == totals.last_ts:
                return  # the same sample delivered twice (QoS 1 redelivery, a replayed retained copy)
            dt = covered_s(totals, sample)
            same_run = totals.last_seq is not None and sample.seq > totals.last_seq
            totals.last_ts, totals.last_seq = sample.ts, sample.seq
            if sample.cpu_percent is not None:
                cpus, busy = cpu_count(sample, caps), min(max(sample.cpu_percent, 0.0), 100.0) / 100.0
                totals.cpu_busy_s += busy * cpus * dt
                totals.cpu_idle_s += (1.0 - busy) * cpus * dt
                totals.cpu_seen = True
            for name in (*NAMED_BYTE_COUNTERS, *_extra_rate_fields(sample)):
                rate, stem = _number(getattr(sample, name, None)), byte_counter_stem(name)
                if stem is not None and rate is not None:
                    totals.bytes[stem] = totals.bytes.get(stem, 0.0) + max(rate, 0.0) * dt
            board_wh = _number(getattr(sample, "energy_wh", None))
            previous_wh, totals.last_energy_wh = totals.last_energy_wh, board_wh
            joules = None
            if board_wh is not None and previous_wh is not None and same_run and board_wh >= previous_wh:
                joules = (board_wh - previous_wh) * 3600.0
            elif sample.power_w is not None:
                joules = max(sample.power_w, 0.0) * dt
            if joules is not None:
                source = "measured" if is_measured(sample.power_source) else "estimated"
                totals.energy_j[source] = totals.energy_j.get(source, 0.0) + joules

    def totals(self, keep: Iterable[str]) -> dict[str, BoardTotals]:
        """A copy of the totals of the boards in ``keep``; the others' are dropped (forgotten or left the view)."""
        wanted = set(keep)
        with self._lock:
            for board_id in [b for b in self._boards if b not in wanted]:
                del self._boards[board_id]
            return {board_id: totals.copy() for board_id, totals in self._boards.items()}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _extra_rate_fields(sample: TelemetrySample) -> Iterable[str]:
    """Byte-rate fields a later telemetry version may add (``disk_read_bytes_per_s``): counted with no code change."""
    return (name for name in getattr(sample, "__dataclass_fields__", {})
            if name.endswith(RATE_SUFFIX) and name not in NAMED_BYTE_COUNTERS)


__all__ = ["ENERGY_SOURCES", "MAX_GAP_INTERVALS", "NAMED_BYTE_COUNTERS", "BoardCounters", "BoardTotals", "byte_counter_stem",
           "covered_s", "cpu_count"]
