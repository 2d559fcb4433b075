"""The exchange's record of one board, and the roster of a job's boards.

:class:`BoardState` is everything the exchange keeps about a board between frames: its connection
and frame reader, whether it is welcomed (or its welcome is being written, the results that wait
for it meanwhile in its outbox), the gradient it sent for the open step (a view into its
read buffer until the step is reduced) with that step's sample count, loss, time and logged
values, the last step it answered, why it left, and the flags a run's record shows for it. It is a
plain record: the parts that change it are the admission (``coordinator.exchange.admission``:
connection, welcome, intruders), the step round (``coordinator.exchange.step_round``: the open
step's gradient) and the modes (``coordinator.exchange.modes``: their per-board counters).

:class:`Roster` owns the job's boards by id and by index (board order: the reduce's fixed order),
how a board leaves (its reader stopped before its socket is closed; the step it may have held up
finished), the "a board joined, left or failed" event that :meth:`Roster.wait_for_boards` waits
on, and the byte counters of the run's record. No sockets are opened here and no frames read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.exchange_io import FrameReader, Link

log = logging.getLogger(__name__)


class ExchangeError(EdgeTrainError):
    """The exchange cannot go on (port in use, every board gone, a board refused the job)."""


@dataclass
class BoardState:
    board_id: str
    index: int
    batch_size: int
    sock: Link | None = None
    buffer: bytearray = field(default_factory=bytearray)
    grad: np.ndarray | None = None          # this step's gradient: a view into ``buffer``
    n: int = 0
    loss: float | None = None
    compute_s: float | None = None
    logs: dict[str, list[Any]] | None = None  # this step's ``self.log`` values: name -> [value, on_step, on_epoch, prog_bar]
    reader: FrameReader | None = None     # reads its frames in loop callbacks
    peer: str = ""                          # where its connection comes from
    welcomed: bool = False
    answered_step: int = -1                 # the last step this board sent a gradient for (kept or refused)
    missed_in_row: int = 0                  # the step deadlines it missed since it last answered (or joined)
    sent_step: int = -1                     # the last step of any gradient on its connection (late ones too)
    joined_step: int = 0                    # the step its welcome started it at (its samples since the last average count from there)
    intruders: int = 0                      # connections refused because they presented this board's id
    last_n: int = 0                         # its sample count the last time its gradient was in the average
    refusal: str = ""                       # why its gradient for that step was refused
    gone_reason: str = ""
    flags: list[str] = field(default_factory=list)
    streamed: int = 0                       # its gradients sent during backward (compute_s after the tensor: --overlap)
    outbox: list[bytes] | None = None       # while it joins (welcome, catch-up): results still to be written to it, in order

    @property
    def connected(self) -> bool:
        """Whether it has a connection (welcomed, or being welcomed): no other may take its place."""
        return (self.welcomed or self.outbox is not None) and self.sock is not None


class Roster:
    """A job's boards, by id and in board order, and how they come and go.

    Args:
        boards: (board_id, batch_size) by board index.
    """

    def __init__(self, boards: list[tuple[str, int]]) -> None:
        self.by_id = {bid: BoardState(bid, i, b) for i, (bid, b) in enumerate(boards)}
        self.in_order = list(self.by_id.values())  # by board index: the reduce's fixed order
        self.changed = asyncio.Event()   # a board joined, left or failed
        self.bytes_in = 0
        self.bytes_out = 0
        self.finished = False  # set by the driver after the last step: a board closing then is not news
        self.on_leave: Callable[[], None] = _nothing  # the step round: a leaving board may be the last one it waited for

    @property
    def connected(self) -> list[str]:
        return [b.board_id for b in self.in_order if b.welcomed]

    def disconnect(self, board: BoardState) -> None:
        """Stop reading the board's connection (before its descriptor is closed), then close it."""
        if board.reader is not None:
            board.reader.stop()
            board.reader = None
        if board.sock is not None:
            board.sock.close()
            board.sock = None

    def gone(self, board: BoardState, reason: str, *, quiet: bool = False) -> None:
        """``board`` left (``quiet``: as expected, after the last step); the open step may now be complete."""
        self.disconnect(board)
        board.sock, board.welcomed, board.grad, board.gone_reason, board.outbox = None, False, None, reason, None
        if quiet:  # boards close their connection once they have taken the last step
            return
        board.flags.append(f"left: {reason}")
        log.warning("exchange: board %s left: %s", board.board_id, reason)
        self.changed.set()
        self.on_leave()  # it may have been the last one the step waited for

    def fail(self, board_id: str, reason: str) -> None:
        """Mark a board as failed from outside (its agent reported that the job failed)."""
        board = self.by_id.get(board_id)
        if board is not None:
            board.gone_reason = reason
            self.gone(board, reason)

    def refuse(self, board: BoardState, reason: str) -> None:
        """A board of this job cannot join at all (another protocol version): it counts as failed."""
        board.gone_reason = reason
        board.flags.append(f"refused: {reason}")
        log.error("exchange: board %s cannot join: %s", board.board_id, reason)
        self.changed.set()

    async def wait_for_boards(self, timeout_s: float, *, need: set[str]) -> None:
        """Wait until every board in ``need`` joined.

        Raises:
            ExchangeError: a board failed or was refused, or time ran out, naming the boards and why.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            failed = {b.board_id: b.gone_reason for b in self.in_order if b.board_id in need and b.gone_reason}
            if failed:
                raise ExchangeError("; ".join(f"board {k}: {v}" for k, v in failed.items()))
            missing = sorted(need - set(self.connected))
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExchangeError(f"board(s) {', '.join(missing)} did not connect to the exchange within {timeout_s:.0f} s: "
                                    "check that they can reach the coordinator's --exchange-host and that the agent is running")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def flags(self) -> dict[str, list[str]]:
        return {b.board_id: list(b.flags) for b in self.in_order if b.flags}

    def streamed_steps(self) -> dict[str, int]:
        return {b.board_id: b.streamed for b in self.in_order}


def peer_text(peer: Any) -> str:
    """A peer address as host:port."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


def _nothing() -> None:
    pass


__all__ = ["BoardState", "ExchangeError", "Roster", "peer_text"]
