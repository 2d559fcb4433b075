"""The lab's agents in ``edge-coordinator status``: every board, its own power model labelled as
an estimate, its speed in its caps; and a board whose cable is pulled goes offline, then back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from edgefleet.lab.fixtures import TEST_KEEPALIVE_S
from edgefleet.lab.lab import Lab
from tests.helpers import wait_until

pytestmark = pytest.mark.untimed  # it times nothing: it runs beside the other worker's tests (tests/conftest.py)


def test_every_board_appears_with_the_lab_s_power_labels(lab: Lab) -> None:
    rows = lab.wait_online(timeout_s=60)

    for board in lab.boards.values():
        row, spec = rows[board.id], board.spec
        assert row["state"] == "online" and row["health"] == "ok", row
        # The board's own power model, never passed off as a measurement.
        assert row["power_source"] == "estimated" and row["power_measured"] is False, row
        assert spec.idle_w - 0.01 <= row["power_w"] <= spec.max_w + 0.01, (board.id, row["power_w"])
        assert row["caps"]["power_source"] == "estimated"
        # Its speed, memory and link are in the model it publishes: status shows boards that differ.
        model = row["caps"]["model"]
        assert model.startswith("lab: ") and f"{spec.cpu:.2f} CPU" in model and spec.model in model, model
    assert len({rows[b]["caps"]["model"] for b in lab.boards}) == len(lab.boards)


def test_the_human_table_lists_every_board(lab: Lab) -> None:
    done = lab.coordinator("status", "--wait", "2")
    assert done.returncode == 0, done.stderr
    for board_id in lab.boards:
        assert board_id in done.stdout
    assert "estimated" in done.stdout


def test_lab_status_shows_quotas_beside_what_the_agents_report(lab: Lab) -> None:
    done = subprocess.run([sys.executable, "-m", "edgefleet.lab", "status", "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rows = {r["board_id"]: r for r in json.loads(done.stdout)}
    assert set(rows) == set(lab.boards)
    for board in lab.boards.values():
        row = rows[board.id]
        assert row["cpu_quota"] == board.spec.cpu and row["memory_limit_bytes"] == board.spec.memory_bytes
        assert row["state"] == "online" and row["power_source"] == "estimated"
        assert 0 <= row["cpu_used"] <= board.spec.cpu * 1.15  # an idle agent, capped by its quota


def test_a_board_whose_cable_is_pulled_goes_offline_then_comes_back(lab: Lab) -> None:
    board_id = "nano-1"
    lab.set_link_up(board_id, False)
    pulled = time.monotonic()
    try:
        def offline_row() -> dict[str, Any] | None:
            row = lab.status_json().get(board_id, {})
            return row if row.get("state") == "offline" else None

        row = wait_until(offline_row, timeout_s=TEST_KEEPALIVE_S * 1.5 + 10, what=f"{board_id} offline after its cable was pulled")
        assert row is not None and row["offline_reason"] == "connection lost"
        assert time.monotonic() - pulled <= TEST_KEEPALIVE_S * 1.5 + 8  # + the CLI's own start-up and wait
        assert lab.agent(board_id).alive()  # the board is cut off, not dead
    finally:
        lab.set_link_up(board_id, True)
    wait_until(lambda: lab.status_json().get(board_id, {}).get("health") == "ok", timeout_s=45,
               what=f"{board_id} back online after its cable was plugged in")


def test_estimated_power_follows_the_board_s_own_load(lab: Lab) -> None:
    """With ``telemetry.cpu_scope = "cgroup"`` a busy board reports near its max_w and an idle one
    near its idle_w, whatever the rest of the machine does."""
    from edgefleet.lab.lab import agent_supports_cpu_scope
    from edgefleet.lab.measurements import BUSY_LOOP

    if not agent_supports_cpu_scope():
        pytest.skip('the agent has no telemetry.cpu_scope yet: its CPU (and estimated power) is host-wide')
    busy, idle = lab.board("pi5-1").spec, lab.board("x86-1").spec
    loop = lab.start_in_board("pi5-1", "busy-loop", [sys.executable, str(BUSY_LOOP), "--seconds", "60"], expect_exit=True)
    try:
        high = busy.idle_w + 0.8 * (busy.max_w - busy.idle_w)
        low = idle.idle_w + 0.2 * (idle.max_w - idle.idle_w)

        def busy_high_idle_low() -> dict[str, dict[str, Any]] | None:
            # one snapshot in which the busy board is near its max and the idle one near its idle
            # watts (an earlier test's leftover load on the idle board may take a moment to end)
            rows = lab.status_json()
            row, other = rows.get("pi5-1", {}), rows.get("x86-1", {})
            busy_ok = (row.get("power_w") or 0) >= high and (row.get("cpu_percent") or 0) >= 80
            return rows if busy_ok and (other.get("power_w") or float("inf")) <= low else None

        found = wait_until(busy_high_idle_low, timeout_s=40,
                           what="pi5-1's estimated power near its max_w while x86-1 stays near its idle_w")
        assert found["pi5-1"]["power_source"] == "estimated" and found["x86-1"]["power_source"] == "estimated"
    finally:
        lab.supervisor.stop(loop)
