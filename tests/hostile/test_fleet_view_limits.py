"""The fleet view under junk: bad values shown as bad data, a board-count limit, bounded and rate-limited logs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from edgefleet.coordinator.control import fleet
from edgefleet.coordinator.control.fleet import BAD_LOG_BURST, DEFAULT_MAX_BOARDS, FleetView
from edgefleet.protocol.messages import BoardStatus
from tests.hostile.mqtt_payloads import ABSURD_TELEMETRY, MARKUP, NESTED_100K, NESTED_VALID_60K, telemetry

P = "edgefleet/v1"
OFFLINE = BoardStatus(state="offline", reason="stopped").to_json()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _topic(board: str, kind: str) -> str:
    return f"{P}/boards/{board}/{kind}"


@pytest.mark.parametrize("field, value", ABSURD_TELEMETRY, ids=[f"{f}={v!r:.20}" for f, v in ABSURD_TELEMETRY])
def test_an_absurd_value_is_never_shown_as_healthy(field: str, value: Any) -> None:
    view = FleetView(P, clock=Clock())
    view.ingest(_topic("pi-1", "telemetry"), telemetry("pi-1", seq=1))
    view.ingest(_topic("pi-1", "telemetry"), telemetry("pi-1", **{"seq": 2, field: value}))
    row = view.rows()[0]
    assert row.health == "bad-data" and row.bad_messages == 1
    assert f"'{field}'" in row.last_error
    assert row.sample is not None and row.sample.seq == 1  # what is shown is the last sample that made sense
    # A first message that is absurd: a row that says so, and no sample at all.
    view.ingest(_topic("pi-2", "telemetry"), telemetry("pi-2", **{field: value}))
    assert [(r.board_id, r.health, r.sample) for r in view.rows()][1] == ("pi-2", "bad-data", None)


@pytest.mark.parametrize("payload", [NESTED_100K, NESTED_VALID_60K], ids=["100KB", "60KB-valid"])
@pytest.mark.parametrize("kind", ["telemetry", "status", "caps"])
def test_nested_json_marks_the_board_bad_and_the_view_carries_on(kind: str, payload: bytes) -> None:
    view = FleetView(P, clock=Clock())
    view.ingest(_topic("evil-1", kind), payload, True)  # raised RecursionError out of ingest before the limits
    view.ingest(_topic("pi-1", "telemetry"), telemetry("pi-1"))
    rows = {r.board_id: r for r in view.rows()}
    assert rows["evil-1"].health == "bad-data" and rows["pi-1"].health == "ok"


def test_a_decoder_that_raises_anything_counts_as_bad_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(payload: bytes) -> object:
        raise OverflowError("int too large to convert to float")

    monkeypatch.setitem(fleet._DECODERS, "caps", broken)
    view = FleetView(P, clock=Clock())
    view.ingest(_topic("pi-1", "caps"), b"{}")
    row = view.rows()[0]
    assert row.health == "bad-data" and "OverflowError while decoding" in row.last_error


def test_a_thousand_bogus_boards_fill_the_view_only_to_its_limit(caplog: pytest.LogCaptureFixture) -> None:
    view = FleetView(P, clock=Clock())
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            view.ingest(_topic(f"bogus-{i:04d}", "status"), OFFLINE, True)
    assert len(view.rows()) == DEFAULT_MAX_BOARDS == 512
    assert view.ignored_boards() == 1000 - DEFAULT_MAX_BOARDS
    limit_warnings = [r.message for r in caplog.records if "more than 512 boards" in r.message]
    assert len(limit_warnings) == 1 and "--max-boards" in limit_warnings[0]


def test_a_live_board_takes_the_place_of_a_leftover_status_when_the_view_is_full() -> None:
    view = FleetView(P, clock=Clock(), max_boards=3)
    for i in range(5):
        view.ingest(_topic(f"old-{i}", "status"), OFFLINE, True)
    assert [r.board_id for r in view.rows()] == ["old-0", "old-1", "old-2"] and view.ignored_boards() == 2
    # Junk and another offline status displace nobody.
    view.ingest(_topic("new-junk", "telemetry"), b"[[[")
    view.ingest(_topic("new-offline", "status"), OFFLINE, True)
    assert [r.board_id for r in view.rows()] == ["old-0", "old-1", "old-2"] and view.ignored_boards() == 4
    # A board that says it is online takes a leftover's place, and so does one that sends a sample.
    view.ingest(_topic("pi-online", "status"), BoardStatus(state="online").to_json(), True)
    view.ingest(_topic("pi-live", "telemetry"), telemetry("pi-live"))
    assert {r.board_id for r in view.rows()} == {"pi-online", "pi-live", "old-2"} and view.ignored_boards() == 6
    view.ingest(_topic("pi-online-2", "status"), BoardStatus(state="online").to_json(), True)
    assert {r.board_id for r in view.rows()} == {"pi-online", "pi-live", "pi-online-2"}
    # No leftover any more: an online claim displaces nobody; a sample displaces a board that never sent one.
    view.ingest(_topic("pi-online-3", "status"), BoardStatus(state="online").to_json(), True)
    assert "pi-online-3" not in {r.board_id for r in view.rows()}
    view.ingest(_topic("pi-a", "telemetry"), telemetry("pi-a"))
    view.ingest(_topic("pi-b", "telemetry"), telemetry("pi-b"))
    assert {r.board_id for r in view.rows()} == {"pi-live", "pi-a", "pi-b"}
    # Full of boards that all sent samples: nobody is displaced any more.
    view.ingest(_topic("pi-c", "telemetry"), telemetry("pi-c"))
    assert {r.board_id for r in view.rows()} == {"pi-live", "pi-a", "pi-b"}
    assert all(r.health == "ok" for r in view.rows())


def test_clearing_a_board_frees_its_place() -> None:
    view = FleetView(P, clock=Clock(), max_boards=1)
    view.ingest(_topic("pi-1", "status"), OFFLINE, True)
    view.ingest(_topic("pi-2", "status"), OFFLINE, True)
    view.ingest(_topic("pi-1", "status"), b"", True)  # the operator cleared pi-1's retained status
    view.ingest(_topic("pi-2", "status"), OFFLINE, True)
    assert [r.board_id for r in view.rows()] == ["pi-2"] and view.ignored_boards() == 0


def test_malformed_messages_from_many_boards_are_logged_a_few_times_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    view = FleetView(P, clock=Clock())
    with caplog.at_level(logging.WARNING):
        for i in range(100):
            view.ingest(_topic(f"evil-{i:03d}", "telemetry"), telemetry(f"evil-{i:03d}", power_w=-1.0))
    warnings = [r.message for r in caplog.records if "malformed" in r.message]
    assert len(warnings) == BAD_LOG_BURST
    assert "board evil-000 sent malformed telemetry" in warnings[0] and "'power_w'" in warnings[0]
    assert all(r.health == "bad-data" for r in view.rows()) and view.bad_messages == 100


def test_markup_in_a_topic_level_is_no_board() -> None:
    view = FleetView(P, clock=Clock())
    view.ingest(f"{P}/boards/{MARKUP}/telemetry", telemetry(MARKUP))
    view.ingest(f"{P}/boards/[/]/status", OFFLINE, True)
    assert view.rows() == [] and view.ignored_boards() == 0


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one board"):
        FleetView(P, max_boards=0)
