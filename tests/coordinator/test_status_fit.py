"""The live fleet view in a terminal shorter than the fleet: the boards that report are shown, the offline ones fill
what room is left, and a caption line says what was left out (rich would cut the table at its bottom, whatever is
there: a test's board hid below twenty boards that earlier tests left offline on the same broker)."""

from __future__ import annotations

import io

from rich.console import Console

from edgefleet.coordinator.cli.render import fit_rows, fleet_table
from edgefleet.coordinator.control.fleet import BoardRow, FleetView
from edgefleet.protocol.messages import BoardStatus
from tests.hostile.mqtt_payloads import telemetry

P = "edgefleet/v1"


def _view(offline: int, reporting: list[str]) -> list[BoardRow]:
    view = FleetView(P)
    for i in range(offline):
        view.ingest(f"{P}/boards/a{i:02d}/status", BoardStatus(state="offline", reason="connection lost").to_json())
    for board in reporting:
        view.ingest(f"{P}/boards/{board}/telemetry", telemetry(board))
    return view.rows()


def _screen(rows: list[BoardRow], height: int) -> list[str]:
    shown, note = fit_rows(rows, height)
    out = io.StringIO()
    Console(file=out, width=120, height=height, color_system=None).print(fleet_table(shown, title="fleet", note=note))
    return [line.strip() for line in out.getvalue().splitlines()]


def test_a_reporting_board_is_shown_above_the_offline_ones_that_do_not_fit() -> None:
    rows = _view(20, ["it-watch"])
    lines = _screen(rows, 16)
    assert len(lines) <= 16, lines
    assert any(line.startswith("it-watch") for line in lines), lines
    assert sum(line.startswith("a") for line in lines) == 16 - 7 - 1  # the room left: rows, less the reporting one
    assert "12 offline board(s) not shown (a08, a09, a10, ...): status without --watch lists them all" in " ".join(lines), lines
    assert [r.board_id for r in fit_rows(rows, 16)[0]] == sorted(r.board_id for r in fit_rows(rows, 16)[0])  # in order


def test_every_row_is_shown_where_the_fleet_fits() -> None:
    rows = _view(3, ["b1", "b2"])
    assert fit_rows(rows, 40) == (rows, "")


def test_more_reporting_boards_than_rows_says_how_to_see_them() -> None:
    rows = _view(2, [f"r{i}" for i in range(12)])
    shown, note = fit_rows(rows, 10)
    assert [r.board_id for r in shown] == ["r0", "r1", "r10"] and all(r.health != "offline" for r in shown)
    assert note.startswith("11 more board(s) not shown: the terminal has room for 3") and "without --watch" in note
