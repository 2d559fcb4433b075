"""fleet8: eight boards, the broker and the coordinator in a namespace of their own on gigabit."""

from __future__ import annotations

import subprocess

import pytest

from edgefleet.lab.lab import Lab
from edgefleet.lab.links import qdisc_rate_bps
from edgefleet.lab.measurements import (
    TOLERANCE,
    first_that_holds,
    measure_cpu,
    measure_link,
    on_mark,
)
from edgefleet.lab.naming import SERVER, SERVER_ADDRESS


def test_all_eight_boards_reach_the_coordinator_in_its_own_namespace(lab8: Lab) -> None:
    assert lab8.coordinator_netns is not None
    assert lab8.broker_address.startswith(f"{SERVER_ADDRESS}:")
    # The broker lives in the server namespace: nothing listens on its port on the host.
    port = lab8.broker_address.rsplit(":", 1)[1]
    host_listeners = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout
    assert host_listeners.strip() == "", host_listeners

    rows = lab8.wait_online(timeout_s=90)  # edge-coordinator runs inside efl-_server

    assert set(rows) >= set(lab8.boards)
    for board in lab8.boards.values():
        row = rows[board.id]
        assert row["power_source"] == "estimated" and row["power_measured"] is False
        assert board.spec.idle_w - 0.01 <= row["power_w"] <= board.spec.max_w + 0.01
        assert f"{board.spec.cpu:.2f} CPU" in row["caps"]["model"]


@pytest.mark.parametrize("direction", ["up", "down"])
def test_the_server_link_runs_at_gigabit(lab8: Lab, direction: str) -> None:
    assert lab8.fleet.server is not None
    held = qdisc_rate_bps("eth0", netns=lab8.server_netns) if direction == "up" else qdisc_rate_bps("efl-v0")
    assert held == 10**9

    m = first_that_holds(lambda: measure_link(lab8, SERVER, direction), on_mark)

    print(f"\nserver {direction}: {m.goodput_bps / 1e6:.1f} Mbit/s goodput for 1000 set (ratio {m.ratio:.3f})")
    assert abs(m.ratio - 1) <= TOLERANCE


def test_eight_boards_hold_their_quotas_together(lab8: Lab) -> None:
    measured = first_that_holds(lambda: measure_cpu(lab8, list(lab8.boards)),
                                lambda ms: on_mark(*ms.values()))
    for board_id, m in measured.items():
        print(f"\n{board_id} together: {m.used_cores:.3f} cores for {m.quota:.2f} (ratio {m.ratio:.3f})", end="")
    bad = {b: round(m.ratio, 3) for b, m in measured.items() if abs(m.ratio - 1) > TOLERANCE}
    assert not bad, f"boards off their quota while all eight were busy: {bad}"
