"""Self-check: a board that goes over its memory limit is OOM-killed by the kernel, and the
supervisor says so in words; the rest of the board (its agent) lives on."""

from __future__ import annotations

import re
import sys

import pytest

from edgefleet.lab.lab import Lab
from edgefleet.lab.measurements import MEMORY_HOG
from edgefleet.lab.units import format_size
from tests.helpers import wait_until

pytestmark = pytest.mark.untimed  # it times nothing: it runs beside the other worker's tests (tests/conftest.py)


def test_the_kernel_holds_every_board_s_memory_limit(lab: Lab) -> None:
    for board in lab.boards.values():
        assert board.cgroup.memory_limit() == board.spec.memory_bytes, board.id


def test_a_board_over_its_memory_limit_is_oom_killed_and_reported(lab: Lab) -> None:
    # Prepare: the board with the least memory, and a real process started like its agent that
    # writes 256 MiB more than the board has.
    board = min(lab.boards.values(), key=lambda b: b.spec.memory_bytes)
    limit = board.spec.memory_bytes
    agent = lab.agent(board.id)
    kills_before = board.cgroup.oom_kills() or 0

    # Execute
    hog = lab.start_in_board(board.id, "memory-hog", [sys.executable, str(MEMORY_HOG), "--bytes", str(limit + 256 * 2**20)],
                             capture_stdout=True, expect_exit=True)
    report = lab.supervisor.wait_for_report(board_id=board.id, name="memory-hog", timeout_s=120)

    # Assert: killed by the kernel at the limit (SIGKILL, counted by the board's memory cgroup),
    # reported in words that name the board, the process, the limit and the counters.
    assert report is not None, f"no report; hog alive: {hog.alive()}; log: {hog.log()[-500:]}"
    print(f"\nsupervisor: {report.message}")
    assert report.kind == "oom-killed" and report.returncode == -9
    pattern = (rf"^board {re.escape(board.id)}: memory-hog was killed by the kernel's OOM killer "
               rf"\(memory limit {re.escape(format_size(limit))}, memory\.failcnt (\d+), oom_kill (\d+)\)$")
    match = re.match(pattern, report.message)
    assert match, report.message
    assert int(match.group(2)) == kills_before + 1  # failcnt is as the kernel counts it (some count 0 here)
    assert board.cgroup.memory_max_usage() >= 0.95 * limit, "it was the limit that stopped it"
    lines = []
    while (line := hog.readline(timeout_s=1)):
        lines.append(line)
    assert lines and not any(line.startswith("reached") for line in lines)
    # The agent, the smaller process in the same board, was spared and still reports.
    assert agent.alive(), agent.log()[-500:]
    assert lab.supervisor.reports(board_id=board.id, name="edge-agent") == []
    wait_until(lambda: lab.status_json().get(board.id, {}).get("health") == "ok", timeout_s=30,
               what=f"{board.id} still online after the OOM kill")
