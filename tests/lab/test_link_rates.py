"""Self-check: a bulk TCP transfer through each board's link runs within 15 % of its set rate, both ways.

The figure compared is TCP goodput, which is about 4.4 % under the set rate on a perfect link
(66 header bytes per 1514-byte frame); 15 % is the issue's tolerance for the whole lab.
"""

from __future__ import annotations

import logging

import pytest

from edgefleet.lab.fixtures import MIXED4
from edgefleet.lab.fleet_file import parse_fleet
from edgefleet.lab.lab import Lab
from edgefleet.lab.links import qdisc_rate_bps
from edgefleet.lab.measurements import TOLERANCE, first_that_holds, measure_link, on_mark
from edgefleet.lab.units import format_rate

log = logging.getLogger(__name__)

# The ids for parametrising, read without the machine checks (the fixture does those).
BOARDS = [b.id for b in parse_fleet(MIXED4.read_text(), host_cores=64).boards]


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("board_id", BOARDS)
def test_link_runs_at_its_set_rate(lab: Lab, board_id: str, direction: str) -> None:
    board = lab.board(board_id)
    # The kernel holds the rate the fleet file asked for, on the right side of the veth.
    held = qdisc_rate_bps("eth0", netns=board.netns) if direction == "up" else qdisc_rate_bps(board.host_if)
    assert held == (board.spec.rate_up_bps if direction == "up" else board.spec.rate_down_bps)

    m = first_that_holds(lambda: measure_link(lab, board_id, direction), on_mark)

    print(f"\n{board_id} {direction}: {format_rate(m.goodput_bps)} goodput for {format_rate(m.set_bps)} set "
          f"(ratio {m.ratio:.3f}, {m.bytes / 1e6:.1f} MB in {m.seconds:.2f} s)")
    assert m.seconds >= 1.0 and m.bytes > 0
    assert abs(m.ratio - 1) <= TOLERANCE, f"{board_id} {direction}: {m.goodput_bps / 1e6:.2f} Mbit/s for {m.set_bps / 1e6:.0f} set"


def test_a_rate_changed_while_the_board_runs_takes_effect(lab: Lab) -> None:
    board = lab.board("pi5-1")
    lab.set_link_rate("pi5-1", rate_up_bps=10 * 10**6)
    try:
        m = first_that_holds(lambda: measure_link(lab, "pi5-1", "up"),
                             lambda m: abs(m.goodput_bps / 10e6 - 1) <= TOLERANCE)
    finally:
        lab.set_link_rate("pi5-1", rate_up_bps=board.spec.rate_up_bps)
    assert abs(m.goodput_bps / 10e6 - 1) <= TOLERANCE, m
    assert qdisc_rate_bps("eth0", netns=board.netns) == board.spec.rate_up_bps
