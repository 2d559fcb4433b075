"""The exporter's ``power_source`` label, on ``edgefleet_board_power_info`` alone, takes a bounded set of
values: the known sources, ``hwmon:<chip>`` with a short plain chip name, else ``other``, which never
counts as measured. A board that names a new string in every sample adds no series and cannot pass an
invented source off as a sensor. The real fleet view and collector, rendered by prometheus_client as a
scrape would be."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.exporter.fleet_collector import FleetCollector
from edgefleet.protocol.messages import POWER_SOURCES, BoardStatus, TelemetrySample, is_measured, power_source_label
from edgefleet.protocol.topics import status_topic, telemetry_topic

PREFIX = "edgefleet/v1"
KNOWN = {*POWER_SOURCES, "hwmon:ina219", "hwmon:cpu_thermal"}
INVENTED = ("my-own-meter", "hwmon:" + "x" * 33, "hwmon:ina 219", "hwmon:ina219\u2028", "hwmon:", "JTOP", "", "estimated2")


def _sample(board_id: str, power_source: str, seq: int) -> bytes:
    return TelemetrySample(board_id=board_id, ts=time.time(), seq=seq, interval_s=60.0, cpu_percent=10.0,
                           mem_total_bytes=1 << 30, mem_used_bytes=1 << 29, mem_percent=50.0, power_w=5.0,
                           power_source=power_source).to_json()


def _scrape(view: FleetView) -> dict[str, dict[str, float]]:
    """Each board's edgefleet_board_power_info sources with its edgefleet_board_power_measured: {board_id: {power_source: value}}."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(view))
    sources: dict[str, list[str]] = {}
    measured: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            assert s.name == "edgefleet_board_power_info" or "power_source" not in s.labels, s  # on the info series only
            if s.name == "edgefleet_board_power_info":
                assert s.value == 1.0
                sources.setdefault(s.labels["board_id"], []).append(s.labels["power_source"])
            elif s.name == "edgefleet_board_power_measured":
                measured[s.labels["board_id"]] = s.value
    return {board: {source: measured[board] for source in found} for board, found in sources.items()}


def test_known_sources_keep_their_label_and_any_other_string_is_other_and_not_measured() -> None:
    assert {source: power_source_label(source) for source in KNOWN} == {source: source for source in KNOWN}
    assert {power_source_label(source) for source in INVENTED} == {"other"}
    assert not any(is_measured(source) for source in INVENTED)
    assert is_measured("hwmon:ina219") and is_measured("rapl") and not is_measured("estimated")

    view = FleetView(PREFIX)
    boards = {f"src-{i}": source for i, source in enumerate(("hwmon:ina219", "rapl", "estimated", *INVENTED))}
    for board, source in boards.items():
        view.ingest(status_topic(PREFIX, board), BoardStatus(state="online", interval_s=60.0).to_json(), True)
        view.ingest(telemetry_topic(PREFIX, board), _sample(board, source, 1))
    got = _scrape(view)
    assert got["src-0"] == {"hwmon:ina219": 1.0} and got["src-1"] == {"rapl": 1.0} and got["src-2"] == {"estimated": 0.0}
    invented = [board for board, source in boards.items() if source in INVENTED and board in got]
    assert len(invented) >= 5  # the others (empty, a line separator) the telemetry checks refuse: not exported at all
    assert all(got[board] == {"other": 0.0} for board in invented), got


def test_a_board_naming_a_new_source_in_every_sample_adds_no_label_value() -> None:
    view = FleetView(PREFIX)
    view.ingest(status_topic(PREFIX, "flood-1"), BoardStatus(state="online", interval_s=60.0).to_json(), True)
    seen: set[str] = set()
    for seq in range(1, 201):
        view.ingest(telemetry_topic(PREFIX, "flood-1"), _sample("flood-1", f"sensor-{seq}", seq))
        seen |= set(_scrape(view).get("flood-1", {}))
    assert seen == {"other"}
