from __future__ import annotations

import logging

import pytest

from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.protocol.messages import BoardStatus, TelemetrySample

P = "edgefleet/v1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(board: str, seq: int = 1) -> bytes:
    return TelemetrySample(board_id=board, ts=1.0, seq=seq, interval_s=1.0, cpu_percent=5.0).to_json()


def test_online_stale_offline() -> None:
    clock = Clock()
    view = FleetView(P, clock=clock)
    view.ingest(f"{P}/boards/pi-1/status", BoardStatus(state="online", interval_s=1.0).to_json(), True)
    assert view.rows()[0].health == "no-data" and view.waiting_for_samples()
    view.ingest(f"{P}/boards/pi-1/telemetry", _sample("pi-1"))
    assert view.rows()[0].health == "ok" and not view.waiting_for_samples()
    clock.now += 3.5  # more than 3 intervals
    assert view.rows()[0].health == "stale"
    view.ingest(f"{P}/boards/pi-1/status", BoardStatus(state="offline", reason="connection lost").to_json())
    row = view.rows()[0]
    assert (row.health, row.offline_reason) == ("offline", "connection lost")


def test_malformed_telemetry_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    view = FleetView(P, clock=Clock())
    view.ingest(f"{P}/boards/pi-1/telemetry", _sample("pi-1"))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            view.ingest(f"{P}/boards/pi-1/telemetry", b"{broken")
    row = view.rows()[0]
    assert row.health == "bad-data" and row.bad_messages == 5 and "not valid JSON" in row.last_error
    assert len([r for r in caplog.records if "malformed" in r.message]) == 1
    assert row.sample is not None and row.sample.seq == 1  # the last good sample is kept
    view.ingest(f"{P}/boards/pi-1/telemetry", _sample("pi-1", seq=2))
    assert view.rows()[0].health == "ok"


def test_a_board_cannot_speak_for_another() -> None:
    view = FleetView(P, clock=Clock())
    view.ingest(f"{P}/boards/pi-1/telemetry", _sample("pi-2"))
    assert view.rows()[0].health == "bad-data" and view.rows()[0].sample is None


def test_foreign_topics_and_cleared_status_are_ignored() -> None:
    view = FleetView(P, clock=Clock())
    view.ingest("other/boards/pi-1/telemetry", _sample("pi-1"))
    view.ingest(f"{P}/boards/pi-1/status", b"")
    assert view.rows() == []
