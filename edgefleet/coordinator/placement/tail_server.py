"""The tail host's endpoint (layer placement): one connection per board, two rounds per step.

The driver (``coordinator.run.training``) runs a placed step as the activation rounds here, then the
gradient exchange's round for the head (``coordinator.exchange``):

* :meth:`TailServer.run_step` waits for every joined board's ``act`` (its head's output for its slice
  of the step's global batch), runs the tail's forward over all of them at once
  (``coordinator.placement.tail_host``), answers each board its slice of the output, waits for each
  board's ``dout`` and answers its ``dact``; the returned :class:`~edgefleet.coordinator.placement.tail_host.TailStep`
  then gives the tail's gradient over the boards whose head gradient the exchange kept.
* A connection shows the same credential as the gradient exchange's hello (``protocol.exchange_auth``:
  the board's key proof over the job's certificate, or its command's token), over TLS when the
  exchange runs it (the same certificate), within :data:`HELLO_TIMEOUT_S`.
* A board that misses a round's deadline, sends a frame of another step, shape or dtype, a NaN, or a
  frame larger than the job's largest slice, is dropped from the step and its connection closed,
  naming the board and why (its worker then ends, and its head gradient never reaches the exchange):
  the rest of the fleet's step goes on without its slice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.coordinator.exchange.admission import HELLO_TIMEOUT_S, MAX_HELLO_BYTES, Listener
from edgefleet.coordinator.exchange.board_state import ExchangeError, peer_text
from edgefleet.coordinator.placement.tail_host import TailStep
from edgefleet.protocol.activation_frames import (
    ACT,
    DACT,
    DOUT,
    OUT,
    TAIL_REFUSAL,
    TAIL_STOP,
    StepTensor,
    TailHello,
    TailMessage,
    TailWelcome,
)
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.transport.exchange_io import ConnectionClosed, Link, async_recv_frame, async_send_frame
from edgefleet.transport.exchange_tls import TlsRefused, accept_tls
from edgefleet.workloads.layer_cut import ModelCut

log = logging.getLogger(__name__)

FRAME_MARGIN_BYTES = 4096  # a frame's fields beside its tensor


@dataclass
class _Board:
    board_id: str
    index: int
    link: Link | None = None
    start: int = 0
    frames: asyncio.Queue[dict[str, Any] | BaseException] = field(default_factory=asyncio.Queue)
    dropped: list[str] = field(default_factory=list)  # why it was dropped from steps (for the run's flags)


class TailServer:
    """Serves one placed job's activation rounds.

    Args:
        job_id: the job; a hello must name it.
        boards: the job's boards, in board order.
        cut: the replica's model, cut (the tail runs on the replica's layers).
        boundary: one sample's activation shape at the cut; ``output``: one sample's tail output shape.
        global_batch: the step's global batch (bounds every frame before it is read).
        checker: each board's credential, as the gradient exchange checks it.
        tls: the exchange's TLS server context (the same certificate), or None for plain TCP.
    """

    def __init__(self, *, job_id: str, boards: list[str], cut: ModelCut, boundary: tuple[int, ...],
                 output: tuple[int, ...], global_batch: int, checker: HelloChecker, tls: ssl.SSLContext | None,
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self.job_id, self.cut, self.boundary, self.output = job_id, cut, boundary, output
        self._boards = {b: _Board(b, i) for i, b in enumerate(boards)}
        self._checker, self._tls, self._hello_timeout_s = checker, tls, hello_timeout_s
        per_sample = max(int(np.prod(boundary)), int(np.prod(output)))
        self.max_frame_bytes = global_batch * per_sample * 4 + FRAME_MARGIN_BYTES
        self._listener = Listener()
        self.bytes_in = self.bytes_out = 0
        self.changed = asyncio.Event()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port.

        Raises:
            ExchangeError: the address cannot be bound.
        """
        return self._listener.start(host, port, self._serve)

    async def close(self, reason: str = "job finished") -> None:
        loop = asyncio.get_running_loop()
        for board in self._boards.values():
            if board.link is not None:
                try:
                    await asyncio.wait_for(async_send_frame(loop, board.link, TailMessage(TAIL_STOP, reason).to_wire()),
                                           1.0)
                except (OSError, asyncio.TimeoutError):
                    pass
                self._disconnect(board)
        await self._listener.cancel()
        self._listener.close()

    @property
    def connected(self) -> list[str]:
        return [b.board_id for b in self._boards.values() if b.link is not None]

    def flags(self) -> dict[str, list[str]]:
        return {b.board_id: list(b.dropped) for b in self._boards.values() if b.dropped}

    async def wait_for(self, boards: set[str], timeout_s: float) -> None:
        """Wait until every board in ``boards`` has connected.

        Raises:
            ExchangeError: time ran out, naming the boards that did not connect.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while not boards <= set(self.connected):
            self.changed.clear()
            left = until - loop.time()
            if left <= 0:
                missing = sorted(boards - set(self.connected))
                raise ExchangeError(f"board(s) {', '.join(missing)} joined the gradient exchange but not the tail host's "
                                    f"activation endpoint within {timeout_s:g} s: check that they can reach it (the "
                                    "same host as the exchange, the port the command names)")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    # --- a step ---------------------------------------------------------------------------
    async def run_step(self, step: int, sizes: dict[str, int], deadline_s: float) -> TailStep | None:
        """The step's two activation rounds with every connected board that started by ``step``; the tail's
        step (None: no board sent its activation)."""
        boards = [b for b in self._boards.values() if b.link is not None and b.start <= step]
        acts = await self._gather(boards, ACT, step, lambda b: (sizes[b.board_id], *self.boundary), deadline_s)
        if not acts:
            return None
        tail = TailStep(self.cut, {b.board_id: acts[b.board_id] for b in boards if b.board_id in acts})
        outs = tail.forward()
        answering = [self._boards[b] for b in outs]
        await self._send_all(answering, OUT, step, outs)
        douts = await self._gather(answering, DOUT, step, lambda b: (sizes[b.board_id], *self.output), deadline_s)
        dacts = tail.backward(douts)
        await self._send_all([self._boards[b] for b in dacts], DACT, step, dacts)
        return tail

    async def _gather(self, boards: list[_Board], kind: str, step: int, shape: Callable[[_Board], tuple[int, ...]],
                      deadline_s: float) -> dict[str, np.ndarray]:
        """Each board's ``kind`` tensor for ``step``; a board that fails to send it in time is dropped and named."""
        got = await asyncio.gather(*(self._receive(b, kind, step, shape(b), deadline_s) for b in boards))
        return {b.board_id: a for b, a in zip(boards, got) if a is not None}

    async def _receive(self, board: _Board, kind: str, step: int, shape: tuple[int, ...],
                       deadline_s: float) -> np.ndarray | None:
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline_s
        while True:
            try:
                item = await asyncio.wait_for(board.frames.get(), max(until - loop.time(), 0.0))
            except asyncio.TimeoutError:
                self._drop(board, f"sent no {kind} for step {step} within {deadline_s:g} s")
                return None
            if isinstance(item, BaseException):
                self._drop(board, f"its activation connection ended at step {step} ({item})")
                return None
            if isinstance(item.get("step"), int) and item["step"] < step:
                continue  # a frame of a step it was dropped from: stale
            try:
                return StepTensor.from_wire(item, kind, step=step, shape=shape).tensor
            except DecodeError as exc:
                self._drop(board, f"sent a wrong {kind} frame for step {step} ({exc})")
                return None

    async def _send_all(self, boards: list[_Board], kind: str, step: int, tensors: dict[str, np.ndarray]) -> None:
        loop = asyncio.get_running_loop()

        async def send(board: _Board) -> None:
            link = board.link
            if link is None:
                return
            try:
                self.bytes_out += await async_send_frame(loop, link, StepTensor(kind, step, tensors[board.board_id]).to_wire(),
                                                         stall_s=self._hello_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                self._drop(board, f"took no {kind} for step {step} ({exc})")

        await asyncio.gather(*(send(b) for b in boards))

    def _drop(self, board: _Board, why: str) -> None:
        log.warning("placement: board %s dropped from the step: %s", board.board_id, why)
        board.dropped.append(why)
        self._disconnect(board)

    def _disconnect(self, board: _Board) -> None:
        if board.link is not None:
            try:
                board.link.close()
            except OSError:
                pass
        board.link = None
        board.frames = asyncio.Queue()
        self.changed.set()

    # --- connections ----------------------------------------------------------------------
    async def _serve(self, raw: socket.socket, peer: Any) -> None:
        loop = asyncio.get_running_loop()
        where = peer_text(peer)
        link: Link = raw
        board: _Board | None = None
        try:
            if self._tls is not None:
                link = await asyncio.wait_for(accept_tls(loop, raw, self._tls), self._hello_timeout_s)
            board = await self._hello(loop, link, where)
            if board is None:
                return
            buffer = bytearray()
            while board.link is link:
                frame = await async_recv_frame(loop, link, buffer, max_bytes=self.max_frame_bytes)
                self.bytes_in += sum(len(v) if isinstance(v, (bytes, memoryview)) else 0 for v in _tensor_bytes(frame))
                if isinstance(frame.get("t"), dict):  # the buffer is reused by the next frame: keep this one's bytes
                    frame["t"] = dict(frame["t"], data=bytes(frame["t"]["data"]))
                board.frames.put_nowait(frame)
        except (asyncio.TimeoutError, TlsRefused) as exc:
            log.info("placement: closed a connection from %s: %s", where, exc or "no TLS handshake or hello in time")
        except (ConnectionClosed, OSError, DecodeError) as exc:
            if board is not None and board.link is link:
                board.frames.put_nowait(exc)
        finally:
            if board is None or board.link is not link:
                link.close()

    async def _hello(self, loop: asyncio.AbstractEventLoop, link: Link, where: str) -> _Board | None:
        buffer = bytearray()
        frame = await asyncio.wait_for(async_recv_frame(loop, link, buffer, max_bytes=MAX_HELLO_BYTES),
                                       self._hello_timeout_s)
        problem = ""
        try:
            hello = TailHello.from_wire(frame)
        except DecodeError as exc:
            hello, problem = None, f"malformed hello ({exc})"
        board = self._boards.get(hello.board_id) if hello is not None else None
        if hello is not None and not problem:
            if hello.job_id != self.job_id or not self._checker.check(hello.job_id, hello.board_id, token=hello.token,
                                                                      proof=hello.proof):
                problem = "wrong job or credential"
            elif board is None:
                problem = f"board {hello.board_id!r} is not part of job {self.job_id}"
            elif board.link is not None:
                problem = f"board {hello.board_id} is already connected to the tail host"
        if problem or board is None or hello is None:
            log.warning("placement: refused a connection from %s: %s", where, problem)
            await asyncio.wait_for(async_send_frame(loop, link, TailMessage(TAIL_REFUSAL, problem).to_wire()),
                                   self._hello_timeout_s)
            return None
        await asyncio.wait_for(async_send_frame(loop, link, TailWelcome(self.boundary, self.output).to_wire()),
                               self._hello_timeout_s)
        board.link, board.start, board.frames = link, hello.start, asyncio.Queue()
        log.info("placement: board %s connected from %s (from step %d)", board.board_id, where, hello.start)
        self.changed.set()
        return board


def _tensor_bytes(frame: dict[str, Any]) -> list[Any]:
    t = frame.get("t")
    return [t.get("data")] if isinstance(t, dict) else []


__all__ = ["FRAME_MARGIN_BYTES", "TailServer"]
