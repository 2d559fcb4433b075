"""The fleet as Prometheus metrics, rendered from the live :class:`FleetView` at every scrape.

A custom collector rather than labelled ``Gauge`` objects: a gauge keeps every label set it was
ever given, so a retired or unplugged board would be exported with its last values for ever. Here
each scrape renders the boards whose sample is fresh (health ``ok``); a board that goes stale,
offline, silent or sends bad data simply drops out, and ``edgefleet_fleet_boards{health=…}``
counts it instead (alert on that, or on ``absent(edgefleet_board_power_watts{board_id="pi-1"})``).

Every board metric is labelled ``board_id`` and ``power_source`` (``estimated`` for a modelled
reading, ``none`` for no reading, else the sensor: ``jtop``, ``rpi5-pmic``, ``hwmon:ina219``, …). The
label takes a bounded set of values (``protocol.messages.power_source_label``): any other string a board
sends is exported as ``other`` and counts as not measured, so it adds no series of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from edgefleet.coordinator.control.fleet import BoardRow, FleetView
from edgefleet.coordinator.exporter.telemetry_metrics import PREFIX, sample_values
from edgefleet.protocol.messages import is_measured, power_source_label

log = logging.getLogger(__name__)

BOARD_LABELS = ("board_id", "power_source")
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
                                                            "or absent (see the power_source label)", labels=BOARD_LABELS)
    age = GaugeMetricFamily(f"{PREFIX}sample_age_seconds", "time since the board's last sample reached the exporter",
                            labels=BOARD_LABELS)
    info = InfoMetricFamily(PREFIX.rstrip("_"), "what the board is (from its caps message)",
                            labels=(*BOARD_LABELS, "model", "machine", "accelerator", "agent_version"))
    telemetry: dict[str, tuple[GaugeMetricFamily, bool]] = {}  # name -> (family, has a key label)
    reserved = {state.name, measured.name, age.name, f"{info.name}_info"}  # a field named like these is not exported
    for row in rows:
        sample = row.sample
        if row.health != EXPORTED_HEALTH or sample is None:
            continue
        labels = [row.board_id, power_source_label(sample.power_source)]
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
    return [state, measured, age, info, *(family for family, _ in telemetry.values())]


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

    def __init__(self, view: FleetView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        rows = self.view.rows()
        counts = FleetCounts(messages=self.view.messages, bad_messages=self.view.bad_messages,
                             ignored_boards=self.view.ignored_boards())
        yield from board_metrics(rows)
        yield from fleet_metrics(rows, counts)


__all__ = ["BOARD_LABELS", "EXPORTED_STATES", "HEALTHS", "FleetCollector", "FleetCounts", "board_metrics", "fleet_metrics"]
