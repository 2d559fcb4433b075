"""The fleet as it is now, and which boards a job runs on: :func:`fleet_snapshot` (one look at the
fleet, shared by ``plan``, ``profile``, ``train`` and ``train --auto``), by default every online
board that can train (:meth:`FleetSnapshot.trainers`), and the check that the named boards can take
a job now (:func:`check_boards_ready`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from edgefleet.coordinator.control.board_channel import BoardChannel
from edgefleet.coordinator.control.fleet import BoardRow
from edgefleet.coordinator.control.monitor import monitor_fleet, wait_for_snapshot
from edgefleet.protocol.errors import ConfigError, EdgeTrainError
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

SNAPSHOT_WAIT_S = 1.0  # how long a snapshot waits for online boards' first samples
BUSY_POLL_S = 0.2      # a board that may still be ending a job is looked at this often


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The fleet at one moment: retained status and caps, and a sample of each online board."""

    rows: tuple[BoardRow, ...]

    def trainers(self) -> list[str]:
        """Every board that is online and has torch and Lightning (or has not said otherwise yet)."""
        return [r.board_id for r in self.rows if r.state == "online" and (r.caps is None or r.caps.training_available)]

    def check_named(self, boards: Sequence[str]) -> None:
        """Refuse boards named for a job (``--boards``) that never reported on this broker or are offline, before
        anything is loaded or built; the message names them and the boards online now.

        Raises:
            ConfigError: naming each such board, what it is, and the boards that can train now.
        """
        states = {r.board_id: r for r in self.rows}
        problems = []
        for board in boards:
            row = states.get(board)
            if row is None:
                problems.append(f"board {board} has never reported on this broker (a typo, or its agent runs with "
                                "another board id or broker?)")
            elif row.state == "offline":
                problems.append(f"board {board} is offline ({row.offline_reason or 'unknown reason'})")
        if problems:
            online = self.trainers()
            raise ConfigError(f"--boards: {'; '.join(problems)}. Online now: {', '.join(online) if online else 'none'}; "
                              "edge-coordinator status lists every board")


def fleet_snapshot(broker: BrokerSettings, *, wait_s: float = SNAPSHOT_WAIT_S, settle: Sequence[str] = (),
                   settle_s: float = 0.0, preferred: Iterable[str] = ()) -> FleetSnapshot:
    """Look at the fleet once.

    Args:
        broker: Where the boards report.
        wait_s: How long to wait for the online boards' first samples.
        settle: Boards that may be busy ending a job (one just profiled or pre-trained): the
            snapshot waits, at most ``settle_s``, while any of them is busy.
        settle_s: See ``settle``.
        preferred: Boards that come first in a full view (whose keys the coordinator holds, or that a
            job names); ``settle`` always does.

    Raises:
        BrokerError: the broker cannot be reached.
    """
    with monitor_fleet(broker, preferred=[*preferred, *settle]) as view:
        wait_for_snapshot(view, timeout_s=wait_s)
        deadline = time.monotonic() + settle_s
        while settle and time.monotonic() < deadline and any(
                r.state == "busy" for r in view.rows() if r.board_id in settle):
            time.sleep(0.1)
        return FleetSnapshot(tuple(view.rows()))


async def check_boards_ready(channel: BoardChannel, boards: Sequence[str], *, busy_wait_s: float = 0.0) -> None:
    """Refuse to start unless every board is online, idle and able to train.

    ``busy_wait_s``: how long a busy board may take to become idle first (a run that goes on after a rollback:
    its boards are still ending the attempt it threw away).

    Raises:
        EdgeTrainError: one line per board that is not ready, each with what to do.
    """
    await channel.wait_for_status()
    deadline = time.monotonic() + busy_wait_s
    while any(getattr(channel.status.get(b), "state", "") == "busy" for b in boards) and time.monotonic() < deadline:
        await asyncio.sleep(BUSY_POLL_S)
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


__all__ = ["BUSY_POLL_S", "SNAPSHOT_WAIT_S", "FleetSnapshot", "check_boards_ready", "fleet_snapshot"]
