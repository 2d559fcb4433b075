"""The fleet as Prometheus metrics, rendered from the live :class:`FleetView` at every scrape.

A custom collector rather than labelled ``Gauge`` objects: a gauge keeps every label set it was
ever given, so a retired or unplugged board would be exported with its last values for ever. Here
each scrape renders the boards whose sample is fresh (health ``ok``); a board that goes stale,
offline, silent or sends bad data simply drops out, and ``edgefleet_fleet_boards{health=…}``
counts it instead (alert on that, or on ``absent(edgefleet_board_power_watts{board_id="pi-1"})``).

Every board metric is labelled ``board_id`` alone. Where the power reading comes from is one series of
its own, ``edgefleet_board_power_info{board_id, power_source} 1`` (``estimated`` for a modelled reading,
``none`` for no reading, else the sensor: ``jtop``, ``rpi5-pmic``, ``hwmon:ina219``, …), so a board that
changes sensor changes that one series, not all of them. The label takes a bounded set of values
(``protocol.messages.power_source_label``): any other string a board sends is exported as ``other``
and counts as not measured, so it adds no series of its own.

Levels are gauges; what a board reports as a rate is a counter (:mod:`.board_counters`):
``edgefleet_board_cpu_seconds_total{mode}``, ``…_network_receive_bytes_total``,
``…_energy_joules_total{source="measured"|"estimated"}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from edgefleet.coordinator.control.fleet import BoardRow, FleetView
from edgefleet.coordinator.exporter.board_counters import BoardCounters, BoardTotals
from edgefleet.coordinator.exporter.telemetry_metrics import PREFIX, sample_values
from edgefleet.protocol.messages import is_measured, power_source_label

log = logging.getLogger(__name__)

BOARD_LABELS = ("board_id",)
EXPORTED_HEALTH = "ok"
HEALTHS = ("ok", "stale", "no-data", "bad-data", "offline")  # FleetView's health values
EXPORTED_STATES = ("online", "busy", "unknown")  # an offline board is never exported; unknown: no status yet


@dataclass(frozen=True, slots=True)
class FleetCounts:
    """The fleet view's own counters, exported beside the boards."""

    messages: int = 0
    bad_messages: int = 0
    ignored_boards: int = 0


def board_metrics(rows: Iterable[BoardRow]) -> list[Metric]:
    """The per-board metric families of the boards in ``rows`` whose sample is fresh."""
    state = GaugeMetricFamily(f"{PREFIX}state", "1 for the board's state (online, busy; unknown: no status message yet)",
                              labels=(*BOARD_LABELS, "state"))
    measured = GaugeMetricFamily(f"{PREFIX}power_measured", "1 if power_watts comes from a sensor, 0 if it is estimated "
                                                            "or absent (edgefleet_board_power_info says which)",
                                 labels=BOARD_LABELS)
    power = InfoMetricFamily(f"{PREFIX}power", "where the board's power reading comes from (power_source: the sensor, "
                                               "estimated, none, other)", labels=BOARD_LABELS)
    age = GaugeMetricFamily(f"{PREFIX}sample_age_seconds", "time since the board's last sample reached the exporter",
                            labels=BOARD_LABELS)
    info = InfoMetricFamily(PREFIX.rstrip("_"), "what the board is (from its caps message: model, machine, accelerator, "
                                                "agent_version)", labels=BOARD_LABELS)
    telemetry: dict[str, tuple[GaugeMetricFamily, bool]] = {}  # name -> (family, has a key label)
    reserved = {state.name, measured.name, age.name, f"{info.name}_info", f"{power.name}_info"}  # not for a field
    for row in rows:
        sample = row.sample
        if row.health != EXPORTED_HEALTH or sample is None:
            continue
        labels = [row.board_id]
        power.add_metric(labels, {"power_source": power_source_label(sample.power_source)})
        for name in EXPORTED_STATES:
            state.add_metric([*labels, name], 1.0 if row.state == name else 0.0)
        measured.add_metric(labels, 1.0 if is_measured(sample.power_source) else 0.0)
        if row.age_s is not None:
            age.add_metric(labels, row.age_s)
        if row.caps is not None:
            info.add_metric(labels, {"model": row.caps.model, "machine": row.caps.machine,
                                     "accelerator": row.caps.accelerator, "agent_version": row.caps.agent_version})
        seen: set[tuple[str, str | None]] = set()
        for value in sample_values(sample):
            keyed = value.key is not None
            if (value.metric.name, value.key) in seen or value.metric.name in reserved:  # two fields, one series: the first wins
                continue
            seen.add((value.metric.name, value.key))
            if value.metric.name not in telemetry:
                telemetry[value.metric.name] = (GaugeMetricFamily(
                    value.metric.name, value.metric.help, labels=(*BOARD_LABELS, value.metric.label) if keyed else BOARD_LABELS),
                    keyed)
            family, family_keyed = telemetry[value.metric.name]
            if family_keyed != keyed:  # a scalar and a dict field derived the same name: the first one wins
                log.debug("telemetry metric %s: a value of another shape dropped", value.metric.name)
                continue
            family.add_metric([*labels, value.key] if value.key is not None else labels, value.value)
    return [state, measured, power, age, info, *(family for family, _ in telemetry.values())]


def counter_metrics(rows: Iterable[BoardRow], totals: dict[str, BoardTotals]) -> list[Metric]:
    """The counters (:mod:`.board_counters`) of the boards in ``rows`` whose sample is fresh."""
    cpu = CounterMetricFamily(f"{PREFIX}cpu_seconds", "CPU seconds the board spent busy or idle, summed over its CPUs "
                                                      "(busy share: rate of mode=busy over the rate of both)",
                              labels=(*BOARD_LABELS, "mode"))
    energy = CounterMetricFamily(f"{PREFIX}energy_joules", "energy drawn, the power readings integrated over time "
                                                           "(source: measured by a sensor, or estimated)",
                                 labels=(*BOARD_LABELS, "source"))
    byte_families: dict[str, CounterMetricFamily] = {}
    for row in rows:
        board = totals.get(row.board_id)
        if row.health != EXPORTED_HEALTH or board is None:
            continue
        if board.cpu_seen:
            cpu.add_metric([row.board_id, "busy"], board.cpu_busy_s)
            cpu.add_metric([row.board_id, "idle"], board.cpu_idle_s)
        for source, joules in sorted(board.energy_j.items()):
            energy.add_metric([row.board_id, source], joules)
        for stem, n in sorted(board.bytes.items()):
            if stem not in byte_families:
                byte_families[stem] = CounterMetricFamily(f"{PREFIX}{stem}", f"bytes, the board's {stem} rate integrated",
                                                          labels=BOARD_LABELS)
            byte_families[stem].add_metric([row.board_id], n)
    return [cpu, energy, *byte_families.values()]


def fleet_metrics(rows: Iterable[BoardRow], counts: FleetCounts) -> list[Metric]:
    """How many boards are in each health, and the view's message counters."""
    by_health = dict.fromkeys(HEALTHS, 0)
    for row in rows:
        by_health[row.health] = by_health.get(row.health, 0) + 1
    boards = GaugeMetricFamily("edgefleet_fleet_boards", "boards the exporter knows, by health (only ok boards have "
                                                         "edgefleet_board_* metrics)", labels=("health",))
    for health, n in by_health.items():
        boards.add_metric([health], n)
    return [boards,
            CounterMetricFamily("edgefleet_fleet_messages", "status, caps and telemetry messages received",
                                value=counts.messages),
            CounterMetricFamily("edgefleet_fleet_bad_messages", "messages dropped as malformed", value=counts.bad_messages),
            GaugeMetricFamily("edgefleet_fleet_ignored_boards", "boards left out because the view is full (--max-boards)",
                              value=counts.ignored_boards)]


class FleetCollector(Collector):
    """Renders ``view`` at scrape time (``registry.register(FleetCollector(view))``)."""

    def __init__(self, view: FleetView, counters: BoardCounters | None = None) -> None:
        self.view = view
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        rows = self.view.rows()
        counts = FleetCounts(messages=self.view.messages, bad_messages=self.view.bad_messages,
                             ignored_boards=self.view.ignored_boards())
        yield from board_metrics(rows)
        if self.counters is not None:
            yield from counter_metrics(rows, self.counters.totals(row.board_id for row in rows))
        yield from fleet_metrics(rows, counts)


def counting_collector(view: FleetView) -> FleetCollector:
    """A collector of ``view`` with its counters, fed by the view from now on (``view.on_sample``)."""
    counters = BoardCounters()
    view.on_sample = counters.add
    return FleetCollector(view, counters)


__all__ = ["BOARD_LABELS", "EXPORTED_STATES", "HEALTHS", "FleetCollector", "FleetCounts", "board_metrics", "counter_metrics",
           "counting_collector", "fleet_metrics"]
