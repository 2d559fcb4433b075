"""Which boards a job runs on: by default every online board that can train, and the check that
the named boards can take a job now. Shared by the commands that send jobs (``profile``, ``train``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from edgefleet.coordinator.control.board_channel import BoardChannel
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)


def online_trainers(broker: BrokerSettings, *, wait_s: float = 1.0) -> list[str]:
    """Every board that is online now and has torch and Lightning (or has not said otherwise yet)."""
    from edgefleet.coordinator.control.monitor import monitor_fleet, wait_for_snapshot

    with monitor_fleet(broker) as view:
        wait_for_snapshot(view, timeout_s=wait_s)
        rows = view.rows()
    return [r.board_id for r in rows if r.state == "online" and (r.caps is None or r.caps.training_available)]


async def check_boards_ready(channel: BoardChannel, boards: Sequence[str]) -> None:
    """Refuse to start unless every board is online, idle and able to train.

    Raises:
        EdgeTrainError: one line per board that is not ready, each with what to do.
    """
    await channel.wait_for_status()
    problems = []
    for board in boards:
        status = channel.status.get(board)
        if status is None:
            problems.append(f"board {board} has never reported on this broker (is its agent running with this board id?)")
        elif status.state == "offline":
            problems.append(f"board {board} is offline ({status.reason or 'unknown reason'}); start its agent or leave it out of --boards")
        elif status.state == "busy":
            problems.append(f"board {board} is busy with another job; wait for it or leave it out of --boards")
        caps = channel.caps.get(board)
        if caps is not None and not caps.training_available:
            problems.append(f"board {board} has no torch/Lightning: pip install 'edgefleet[train]' there")
    if problems:
        raise EdgeTrainError("cannot start: " + "; ".join(problems))


__all__ = ["check_boards_ready", "online_trainers"]
