"""A real ExchangeServer stepping as the coordinator does, and board clients that step against it, on 127.0.0.1.

:class:`SteppingExchange` runs the server in a thread with its own event loop. A stand-in for the
replica (a float32 vector and its step) adds every step's result to its vector, and a joining
board's welcome carries that vector (a copy, as the real replica's ``wire_state`` gives) and the
step it is at, so a test can check that a board which joined mid-run holds, step for step, the
replica's state. Every step's deadline is ``deadline_s`` from the first step on.

:class:`Board` is an honest board: it joins (or joins again), sends a constant vector every step,
adds each result to the state its welcome gave it, and records what it holds after every step.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edgefleet.agent.worker_exchange import ExchangeClient, StopTraining
from edgefleet.coordinator.exchange.server import ExchangeServer, StepResult
from edgefleet.protocol.codec import decode_value, encode_value
from edgefleet.protocol.exchange_frames import Welcome

JOB, TOKEN = "job", "secret"
SIZE = 64  # elements of every vector


class SteppingExchange(threading.Thread):
    """A real ExchangeServer and a stand-in replica, stepping until :meth:`stop` (or an error, kept in ``error``).

    Args:
        boards: (board_id, batch size) by board index.
        need: the boards the first step waits for.
        deadline_s: every step's deadline (the server's minimum; the recent steps are fast).
        welcome_pad_bytes: zeros sent in every welcome besides the state (a large model's welcome).
        hello_timeout_s: the server's; a connection that takes no byte of its welcome for this long is closed.
    """

    def __init__(self, boards: list[tuple[str, int]], *, need: set[str], deadline_s: float,
                 welcome_pad_bytes: int = 0, hello_timeout_s: float = 10.0) -> None:
        super().__init__(daemon=True, name="exchange")
        self.boards, self.need, self.deadline_s, self.hello_timeout_s = boards, need, deadline_s, hello_timeout_s
        self.pad = np.zeros(welcome_pad_bytes // 4, np.float32)
        self.state = np.zeros(SIZE, np.float32)   # the replica's
        self.step = 0
        self.states: dict[int, np.ndarray] = {0: self.state.copy()}  # the replica's state before each step
        self.results: list[tuple[float, StepResult]] = []  # (when it was applied, monotonic; the step's record)
        self.welcomes: list[int] = []             # the step of every welcome handed out
        self.flags: dict[str, list[str]] = {}
        self.error: BaseException | None = None
        self.port = 0
        self.listening = threading.Event()
        self._stopping = threading.Event()
        self._server: ExchangeServer | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # kept for the test's assertions, which name it
            self.error = exc
        finally:
            self.listening.set()

    def stop(self, timeout_s: float = 30) -> None:
        """End after the step that runs now (the boards get ``stop``), and wait for the thread."""
        self._stopping.set()
        self.join(timeout_s)
        assert not self.is_alive(), "the exchange did not stop"

    def steps_with(self, board_id: str) -> list[int]:
        return [r.step for _, r in list(self.results) if board_id in r.contributors]

    def _welcome_state(self) -> tuple[int, Any, Any]:
        self.welcomes.append(self.step)
        return self.step, encode_value({"w": self.state.copy(), "pad": self.pad}), encode_value({})

    def _apply(self, average: np.ndarray, result: StepResult) -> None:
        self.state += average
        self.step = result.step + 1
        self.states[self.step] = self.state.copy()
        self.results.append((time.monotonic(), result))

    async def _serve(self) -> None:
        server = self._server = ExchangeServer(job_id=JOB, token=TOKEN, boards=self.boards, param_count=SIZE,
                                               wire_dtype="float32", welcome_state=self._welcome_state,
                                               hello_timeout_s=self.hello_timeout_s)
        self.port = await server.start("127.0.0.1", 0)
        self.listening.set()
        try:
            await server.wait_for_boards(30, need=self.need)
            server._recent_s.extend([0.001] * 3)  # the deadline is deadline_s from the first step on
            while not self._stopping.is_set():
                await server.run_step(self.step, apply=self._apply, minimum_deadline_s=self.deadline_s)
            server.finished = True
            self.flags = server.flags()
        finally:
            await server.close()


class Throttled:
    """A blocking socket whose reads take at most ``chunk`` bytes every ``every_s`` (a slow link), for FrameReceiver."""

    def __init__(self, sock: socket.socket, *, chunk: int, every_s: float) -> None:
        self.sock, self.chunk, self.every_s = sock, chunk, every_s

    def recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        time.sleep(self.every_s)  # the link's pace, not a synchronisation
        return self.sock.recv_into(view[:self.chunk])


class Board(threading.Thread):
    """An honest board: joins, steps until the coordinator says stop, joins again when ``rejoin`` says so.

    Args:
        stall_at: the step at which it stops answering (a stopped worker) until ``resume`` is set;
            then it finds its connection closed, and joins again.
        slow: (chunk bytes, seconds per chunk): it reads its first welcome over a link that slow.
        compute_s: its forward and backward take this long.
    """

    def __init__(self, exchange: SteppingExchange, board_id: str, batch: int, value: float, *,
                 stall_at: int | None = None, slow: tuple[int, float] | None = None, compute_s: float = 0.0) -> None:
        super().__init__(daemon=True, name=f"board-{board_id}")
        self.exchange, self.board_id, self.batch, self.stall_at, self.slow = exchange, board_id, batch, stall_at, slow
        self.compute_s = compute_s
        self.grad = np.full(SIZE, value, np.float32)
        self.resume = threading.Event()
        self.stalled = threading.Event()
        self.held: dict[int, np.ndarray] = {}   # its state before each step it took part in
        self.joins: list[int] = []              # the step of each welcome it took
        self.welcome_s: list[tuple[float, float]] = []  # (hello sent, welcome read), monotonic
        self.after_stall: BaseException | None = None   # what its old connection said once it resumed
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self._session():
                pass
        except BaseException as exc:  # kept for the test's assertions, which name it
            self.error = exc

    def _session(self) -> bool:
        """One connection: join, step; True to join again (it stalled and its connection is gone)."""
        client = ExchangeClient("127.0.0.1", self.exchange.port, result_timeout_s=60)
        try:
            welcome = self._hello(client)
            state = np.array(decode_value(welcome.model)["w"], np.float32)
            step = welcome.step
            self.joins.append(step)
            while True:
                self.held[step] = state.copy()
                if step == self.stall_at:  # a stopped worker: nothing sent, nothing read
                    self.stall_at = None
                    self.stalled.set()
                    self.resume.wait(60)
                if self.compute_s:
                    time.sleep(self.compute_s)  # forward and backward
                try:
                    average = client.exchange(step=step, grad=self.grad, n=self.batch, loss=1.0, compute_s=0.01)
                except StopTraining:
                    return False
                except Exception as exc:  # once resumed: its connection was closed while it was stopped
                    if not self.stalled.is_set() or self.after_stall is not None:
                        raise
                    self.after_stall = exc
                    return True
                state += average
                step += 1
        finally:
            client.close()

    def _hello(self, client: ExchangeClient) -> Welcome:
        sent = time.monotonic()
        slow, self.slow = self.slow, None
        if slow is not None:  # read the welcome over a slow link
            # a stand-in socket that reads in small chunks (a slow link); the receiver only calls recv_into on it
            client._receiver.sock = Throttled(client.sock, chunk=slow[0], every_s=slow[1])  # type: ignore[assignment]
        welcome = client.hello(job_id=JOB, board_id=self.board_id, token=TOKEN, param_count=SIZE)
        client._receiver.sock = client.sock
        self.welcome_s.append((sent, time.monotonic()))
        return welcome


def started(exchange: SteppingExchange, *boards: Board) -> Callable[[], None]:
    """Start the exchange and ``boards``; the check to call at the end: no thread failed."""
    exchange.start()
    exchange.listening.wait(30)
    for board in boards:
        board.start()

    def check() -> None:
        assert exchange.error is None, f"the exchange failed: {exchange.error!r}"
        for board in boards:
            board.join(30)
            assert board.error is None, f"board {board.board_id} failed: {board.error!r}"

    return check
