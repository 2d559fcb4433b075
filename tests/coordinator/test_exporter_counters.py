"""The exporter's counters: what a board reports as a rate (CPU load, bytes per second, watts) is folded
into totals sample by sample, so Prometheus' ``rate()`` over any window is the board's true mean. The real
fleet view and collector, rendered by prometheus_client as a scrape would be."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.exporter.fleet_collector import counting_collector
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.topics import caps_topic, status_topic, telemetry_topic

PREFIX = "edgefleet/v1"
Totals = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(seq: int, ts: float, *, cpu: float = 50.0, rx: float = 1000.0, power_w: float | None = 5.0,
            source: str = "rpi5-pmic", energy_wh: float | None = None) -> bytes:
    return TelemetrySample(board_id="pi-1", ts=ts, seq=seq, interval_s=2.0, cpu_percent=cpu, net_rx_bytes_per_s=rx,
                           net_tx_bytes_per_s=0.0, power_w=power_w, power_source=source, energy_wh=energy_wh).to_json()


def _scrape(registry: CollectorRegistry) -> Totals:
    out: Totals = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "board_id"))] = s.value
    return out


@pytest.fixture
def view() -> tuple[FleetView, CollectorRegistry, Clock]:
    clock = Clock()
    fleet = FleetView(PREFIX, clock=clock)
    registry = CollectorRegistry()
    registry.register(counting_collector(fleet))
    fleet.ingest(status_topic(PREFIX, "pi-1"), BoardStatus(state="online", interval_s=2.0).to_json(), True)
    fleet.ingest(caps_topic(PREFIX, "pi-1"), BoardCaps(board_id="pi-1", hostname="pi-1", model="Raspberry Pi 5",
                                                       machine="aarch64", cores=4, ram_bytes=8 << 30).to_json(), True)
    return fleet, registry, clock


def test_rates_add_up_sample_by_sample_lost_samples_filled_a_restart_counted_once(
        view: tuple[FleetView, CollectorRegistry, Clock]) -> None:
    fleet, registry, _ = view
    topic = telemetry_topic(PREFIX, "pi-1")

    # Execute: the first sample (one interval, 2 s), the next 2 s later, one lost, one redelivered,
    # then the agent restarts (seq back to 1) and a silence far longer than three intervals.
    for payload in (_sample(1, 1000.0), _sample(2, 1002.0, cpu=25.0, rx=500.0), _sample(4, 1006.0, cpu=100.0),
                    _sample(4, 1006.0, cpu=100.0), _sample(1, 1010.0, power_w=None), _sample(2, 1100.0, source="estimated")):
        fleet.ingest(topic, payload)
    got = _scrape(registry)

    # Assert: covered seconds 2 + 2 + 4 (the lost sample's 2 s at the next one's rate) + 2 (restart) + 6 (3 intervals).
    cpu_busy = (0.5 * 2 + 0.25 * 2 + 1.0 * 4 + 0.5 * 2 + 0.5 * 6) * 4  # 4 cores, from the caps
    assert got["edgefleet_board_cpu_seconds_total", (("mode", "busy"),)] == pytest.approx(cpu_busy)
    assert got["edgefleet_board_cpu_seconds_total", (("mode", "idle"),)] == pytest.approx(16 * 4 - cpu_busy)
    assert got["edgefleet_board_network_receive_bytes_total", ()] == pytest.approx(1000 * 2 + 500 * 2 + 1000 * 4 + 1000 * 8)
    assert got["edgefleet_board_network_transmit_bytes_total", ()] == 0.0
    assert got["edgefleet_board_energy_joules_total", (("source", "measured"),)] == pytest.approx(5.0 * (2 + 2 + 4))
    assert got["edgefleet_board_energy_joules_total", (("source", "estimated"),)] == pytest.approx(5.0 * 6)


def test_the_boards_own_energy_counter_is_followed_where_it_sends_one(view: tuple[FleetView, CollectorRegistry, Clock]) -> None:
    fleet, registry, _ = view
    topic = telemetry_topic(PREFIX, "pi-1")

    # The board's counter covers the lost sample 3 exactly; after its record was reset, watts x time again.
    for payload in (_sample(1, 1000.0, energy_wh=10.0), _sample(2, 1002.0, energy_wh=10.01),
                    _sample(4, 1006.0, energy_wh=10.03), _sample(5, 1008.0, energy_wh=0.0)):
        fleet.ingest(topic, payload)

    joules = _scrape(registry)["edgefleet_board_energy_joules_total", (("source", "measured"),)]
    assert joules == pytest.approx(5.0 * 2 + 0.01 * 3600 + 0.02 * 3600 + 5.0 * 2)


def test_a_forgotten_board_drops_its_counters_and_starts_again_from_zero(
        view: tuple[FleetView, CollectorRegistry, Clock]) -> None:
    fleet, registry, _ = view
    fleet.ingest(telemetry_topic(PREFIX, "pi-1"), _sample(1, 1000.0))
    assert _scrape(registry)["edgefleet_board_network_receive_bytes_total", ()] == 2000.0

    for kind in ("caps", "status"):  # edge-coordinator forget: empty retained payloads
        fleet.ingest(f"{PREFIX}/boards/pi-1/{kind}", b"", True)
    assert _scrape(registry).get(("edgefleet_board_network_receive_bytes_total", ())) is None
    assert fleet.bad_messages == 0

    fleet.ingest(status_topic(PREFIX, "pi-1"), BoardStatus(state="online", interval_s=2.0).to_json(), True)
    fleet.ingest(telemetry_topic(PREFIX, "pi-1"), _sample(7, 2000.0, rx=10.0))
    assert _scrape(registry)["edgefleet_board_network_receive_bytes_total", ()] == 20.0
