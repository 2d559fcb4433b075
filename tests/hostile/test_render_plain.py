"""Board-provided strings are shown as plain text in every table: rich markup is neither applied nor parsed."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgefleet.coordinator.cli.plan_render import plan_table
from edgefleet.coordinator.cli.profile_render import profile_table
from edgefleet.coordinator.cli.render import fleet_table, limit_note, summary_table
from edgefleet.coordinator.control.fleet import BoardRow, FleetView
from edgefleet.coordinator.planning.plan_job import PlanRequest
from edgefleet.protocol.messages import BoardStatus, TelemetrySample
from tests.hostile.mqtt_payloads import CLOSING_TAG, HUGE_INT, MARKUP, telemetry
from tests.planning import board, fleet

P = "edgefleet/v1"


def _text(table: Table) -> str:
    out = io.StringIO()
    Console(file=out, width=220, color_system=None).print(table)
    return out.getvalue()


def test_markup_from_boards_is_shown_as_the_characters_they_sent() -> None:
    view = FleetView(P)
    view.ingest(f"{P}/boards/pi-1/telemetry", telemetry("pi-1", power_source=MARKUP))
    view.ingest(f"{P}/boards/pi-2/telemetry", telemetry("pi-2", power_source=CLOSING_TAG))
    view.ingest(f"{P}/boards/pi-3/status", BoardStatus(state="offline", reason=f"{CLOSING_TAG} {MARKUP}").to_json())
    text = _text(fleet_table(view.rows()))  # MarkupError ("closing tag '[/]' ... nothing to close") before
    assert MARKUP in text and f"offline ({CLOSING_TAG} {MARKUP})" in text
    assert next(line.strip() for line in text.splitlines() if line.strip().startswith("pi-2")).endswith(CLOSING_TAG)


def test_a_number_that_cannot_be_formatted_shows_a_question_mark_not_a_traceback() -> None:
    # Decoding refuses these; the table must not depend on that to stay up.
    sample = TelemetrySample(board_id="pi-1", ts=1.0, seq=1, interval_s=1.0, cpu_percent=HUGE_INT,
                             mem_used_bytes=HUGE_INT, mem_total_bytes=HUGE_INT, power_w=HUGE_INT)
    row = BoardRow(board_id="pi-1", state="online", health="ok", age_s=0.1, sample=sample, caps=None)
    text = _text(fleet_table([row]))  # OverflowError before
    assert "?%" not in text and "?" in text


def test_the_board_limit_note_is_in_the_caption() -> None:
    note = limit_note(488, 512)
    assert note.startswith("488 more board(s) not shown: over the limit of 512") and "--max-boards" in note
    assert limit_note(0, 512) == ""
    text = _text(fleet_table([], note=note))
    assert "488 more board(s) not shown" in text


def test_the_run_summary_shows_board_names_and_flags_as_text() -> None:
    result = {"boards": {MARKUP: {"batch_size": 16, "steps_contributed": 3, "median_compute_s": 0.01,
                                  "flags": [f"late {CLOSING_TAG}"]}}}
    text = _text(summary_table(result))
    assert MARKUP in text and f"1: late {CLOSING_TAG}" in text


def test_profile_and_plan_tables_show_board_ids_and_sources_as_text() -> None:
    profile = fleet(board(MARKUP, power_source=CLOSING_TAG), board("pi-2"))
    text = _text(profile_table("v", profile))
    assert MARKUP in text and CLOSING_TAG in text
    request = PlanRequest(objective="time", max_power_w=None, deadline_s=None, global_batches=(32,), count_idle=False,
                          max_memory_fraction=0.9, top=5)
    assert MARKUP in _text(plan_table(request.run({"v": profile}), request))


def test_names_a_board_logged_show_in_the_progress_line_as_the_characters_they_are() -> None:
    """A module's log names travel from the boards: ``[/]`` must not kill the progress thread, ``[link=…]``
    and styles must not render, and an ESC sequence must not reach the operator's terminal."""
    from edgefleet.coordinator.cli.train_progress import TrainProgress
    from edgefleet.coordinator.run.job_spec import JobSpec
    from edgefleet.coordinator.run.training import StepView

    out = io.StringIO()
    display = TrainProgress(Console(file=out, width=400, color_system=None, force_terminal=False))
    spec = JobSpec(model="mlp", dataset="synthetic", boards=("pi-1",), batch_sizes=(8,), total_steps=2, steps=2)
    display.started(spec, Path("run"), 0)
    names = {CLOSING_TAG: 1.0, "[link=https://example.invalid]click[/link]": 2.0, "\x1b[31mred": 3.0, MARKUP: 4.0}
    display.step(StepView(step=0, total_steps=2, loss=0.5, val_accuracy=None, samples_per_s=10.0,
                          board_compute_s={"pi-1": 0.01}, late=[], refused={}, shown=names))
    display.stopped()
    text = out.getvalue()
    assert CLOSING_TAG in text and "[link=https://example.invalid]click[/link]" in text and MARKUP in text, text
    assert "\x1b" not in text and "?[31mred" in text, repr(text)
