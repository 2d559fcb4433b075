"""600 bogus boards on a broker without an ACL cannot push a real board out of a fresh fleet view: boards the
caller prefers (whose keys the coordinator holds, or that a job names) take the place of others when the
view is full, while bogus boards still displace no preferred one. Real Mosquitto, retained messages published
as a flood would be, and the real monitor."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.coordinator.control.fleet import DEFAULT_MAX_BOARDS
from edgefleet.coordinator.control.monitor import monitor_fleet, wait_for_snapshot
from edgefleet.protocol.messages import BoardStatus, TelemetrySample
from edgefleet.protocol.topics import status_topic, telemetry_topic
from edgefleet.transport.settings import BrokerSettings

PREFIX = "edgefleet/v1"
FAKES = 600
REAL = ("real-1", "real-2")


def _sample(board: str) -> bytes:
    return TelemetrySample(board_id=board, ts=time.time(), seq=1, interval_s=3600.0, cpu_percent=5.0,
                           mem_total_bytes=1 << 30, mem_used_bytes=1 << 28, mem_percent=25.0).to_json()


def _publish_flood(broker: LocalBroker) -> None:
    """600 fake boards, each online with a valid retained sample, then the real boards (so they come last)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"flood-{time.monotonic_ns()}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        online = BoardStatus(state="online", interval_s=3600.0).to_json()
        infos = []
        for board in [f"fake-{i:03d}" for i in range(FAKES)] + list(REAL):
            infos.append(client.publish(status_topic(PREFIX, board), online, qos=1, retain=True))
            infos.append(client.publish(telemetry_topic(PREFIX, board), _sample(board), qos=1, retain=True))
        for info in infos:
            info.wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def test_preferred_boards_come_first_in_a_view_flooded_by_fake_boards() -> None:
    with start_mosquitto() as broker:  # its own: the flood's retained boards would crowd other tests' fleet views
        _publish_flood(broker)
        settings = BrokerSettings(host=broker.host, port=broker.port, topic_prefix=PREFIX)
        with monitor_fleet(settings, preferred=REAL) as view:
            wait_for_snapshot(view, timeout_s=5)
            shown = {row.board_id for row in view.rows()}
            ignored = view.ignored_boards()
    assert set(REAL) <= shown, f"{len(shown)} boards shown, the real ones missing"
    assert len(shown) == DEFAULT_MAX_BOARDS and ignored == FAKES + len(REAL) - DEFAULT_MAX_BOARDS


def test_status_prefers_the_boards_whose_keys_the_coordinator_holds(tmp_path: Path) -> None:
    from edgefleet.coordinator.cli.status import _keyed_boards

    (tmp_path / "real-1.pub").write_text("key")
    (tmp_path / "real-2.pub").write_text("key")
    (tmp_path / "notes.txt").write_text("not a key")
    assert _keyed_boards(SimpleNamespace(security=SimpleNamespace(board_keys_dir=str(tmp_path)))) == set(REAL)
    assert _keyed_boards(SimpleNamespace(security=SimpleNamespace(board_keys_dir=""))) == frozenset()
