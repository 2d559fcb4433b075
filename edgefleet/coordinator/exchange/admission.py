"""Who gets into the exchange: the listening socket, each connection's TLS and hello, the board's
credential, intruders, and the welcome.

:class:`Listener` owns the listening socket and the tasks serving connections. Its accept loop
outlives running out of file descriptors (EMFILE/ENFILE): it says so at most once every
:data:`FD_WARN_EVERY_S` and retries, doubling its wait up to a second, while connections wait in
the listen queue; no error of one connection ends it.

:class:`Admission` serves one accepted connection until it ends. Hostile peers are expected:

* with a TLS context every connection must complete its handshake within ``hello_timeout_s``
  (:data:`HELLO_TIMEOUT_S` by default); a failed one is logged and closed;
* the hello (at most :data:`MAX_HELLO_BYTES`) must arrive within ``hello_timeout_s``; it must name
  this job, a board of it, the job's model size and a credential (``protocol.exchange_auth``: the
  board's own key proof, the legacy fleet key, or the token its signed command carried; without a
  checker, the job's token). A refused connection gets a ``Refusal`` saying why. A board of this
  job speaking another protocol version counts as failed, naming the side to upgrade;
* a board that is connected cannot be replaced by a second connection presenting its id: the
  second is refused (and counted on the first's flags, once), the first kept;
* the welcome (the state from ``welcome_state``, the splits that still matter, what the mode adds:
  ``ExchangeMode.welcome``) is taken under the step boundary's lock, so a board starts at a step
  boundary, and written outside it: a slow link does not hold up the steps. The results of the
  steps run meanwhile wait in the board's outbox and follow the welcome; the board computes its
  way through them (as a board late by some steps does) and the steps wait for it only once it
  has caught up. A connection that takes no byte of it for ``hello_timeout_s``, or that has not
  caught up within ``step_round.JOIN_MISSES_TO_DROP`` step deadlines, is closed.

A welcomed board's frames are then read by the step round (``coordinator.exchange.step_round``)
until its connection ends; why it ended (closed, a frame above the job's limit, a malformed frame)
is the board's leaving reason (``board_state.Roster.gone``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

from edgefleet.coordinator.exchange.board_state import BoardState, ExchangeError, Roster, peer_text
from edgefleet.coordinator.exchange.modes import ExchangeMode
from edgefleet.coordinator.exchange.step_round import ResultRelay, StepRound
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.protocol.exchange_frames import ExchangeVersionError, Hello, Refusal, Welcome, same_secret
from edgefleet.transport.exchange_io import (
    ConnectionClosed,
    FrameTooLarge,
    Link,
    async_recv_frame,
    async_send_frame,
    async_send_segments,
    frame_segments,
)
from edgefleet.transport.exchange_tls import TlsRefused, accept_tls

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # to send the hello after connecting, and to take each part of the welcome
MAX_HELLO_BYTES = 16 * 1024  # a hello is three short strings and a number: well under 4 KiB
ACCEPT_RETRY_S = (0.05, 1.0)  # out of file descriptors: retry accepting after this long, doubling up to the second
FD_WARN_EVERY_S = 60.0   # ... and say so at most this often
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

Serve = Callable[[socket.socket, Any], Coroutine[Any, Any, None]]


class Listener:
    """The listening socket, its accept loop, and the tasks it spawned (one per connection)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._fd_warned = -math.inf  # when running out of file descriptors was last reported

    def start(self, host: str, port: int, serve: Serve) -> int:
        """Listen, and ``serve`` each accepted connection in its own task; returns the port (useful with port 0).

        Raises:
            ExchangeError: the address cannot be bound, with the fix.
        """
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ExchangeError(f"cannot listen for the exchange on {host}:{port} ({exc.strerror}); "
                                "choose another --exchange-port (0 picks a free one) or --exchange-host") from None
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._spawn(self._accept_loop(sock, serve))
        return int(sock.getsockname()[1])

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        """Cancel the accept loop and every connection's task, and wait for them."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

    async def _accept_loop(self, listening: socket.socket, serve: Serve) -> None:
        """Accept connections until the server closes; no error of one connection, nor running out of
        file descriptors, ends it (a new connection waits in the listen queue until one is free)."""
        loop = asyncio.get_running_loop()
        retry_s = ACCEPT_RETRY_S[0]
        while True:
            try:
                conn, peer = await loop.sock_accept(listening)
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:  # the peer gave up before it was accepted, and the like
                    log.debug("exchange: accepting a connection failed (%s); accepting on", exc)
                    continue
                self._out_of_fds(exc)
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, ACCEPT_RETRY_S[1])
                continue
            retry_s = ACCEPT_RETRY_S[0]
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:  # reset before we looked at it
                log.debug("exchange: a connection from %s failed at once (%s)", peer, exc)
                conn.close()
                continue
            self._spawn(serve(conn, peer))

    def _out_of_fds(self, exc: OSError) -> None:
        """Say (at most once a minute) that connections wait because the process has no descriptor left."""
        now = time.monotonic()
        if now - self._fd_warned < FD_WARN_EVERY_S:
            return
        self._fd_warned = now
        log.warning("exchange: cannot accept connections: %s (the coordinator has too many open files); boards "
                    "wait in the listen queue and are accepted as descriptors free up. Raise the limit "
                    "(ulimit -n, or LimitNOFILE= in a systemd unit) if this repeats", exc.strerror or exc)


class _NotTls(Exception):
    """A connection that did not complete its TLS handshake (already logged)."""


class Admission:
    """Serves a job's connections: TLS, hello, credential, intruders, welcome; then the step round reads the board.

    Args:
        welcome_state: returns (next step, model state tree, optimizer state tree) for a joining board.
        welcome_extra: returns more fields of the welcome (``schedulers``: the LR schedulers' states).
        tls: the server context of the job's certificate; None: plain TCP.
        checker: each board's credential; None: every board shows ``token``.
    """

    def __init__(self, *, job_id: str, token: str, param_count: int, wire_dtype: str, roster: Roster, steps: StepRound,
                 mode: ExchangeMode, relay: ResultRelay, welcome_state: Callable[[], tuple[int, Any, Any]],
                 welcome_extra: Callable[[], dict[str, Any]] | None, hello_timeout_s: float,
                 tls: ssl.SSLContext | None, checker: HelloChecker | None) -> None:
        self._job_id, self._token, self._param_count, self._wire_dtype = job_id, token, param_count, wire_dtype
        self._roster, self._steps, self._mode, self._relay = roster, steps, mode, relay
        self._welcome_state, self._welcome_extra = welcome_state, welcome_extra
        self._hello_timeout_s, self._tls, self._checker = hello_timeout_s, tls, checker

    async def serve(self, raw: socket.socket, peer: Any) -> None:
        """One accepted connection, from its TLS handshake to its end (a board's leaving reason, if it joined)."""
        loop = asyncio.get_running_loop()
        board: BoardState | None = None
        conn: Link = raw
        try:
            if self._tls is not None:
                conn = await self._tls_handshake(loop, raw, peer)
            board = await self._handshake(loop, conn, peer)
            if board is not None:
                await self._steps.read(loop, board)
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
            if board is not None and board.sock is conn:
                self._roster.gone(board, f"connection closed ({exc})", quiet=self._roster.finished)
        except FrameTooLarge as exc:
            if board is not None and board.sock is conn:
                self._roster.gone(board, f"sent a frame of {exc.size} bytes; this job's frames are at most {exc.max_bytes} "
                                         f"({self._param_count} {self._wire_dtype} values and their fields): check that the "
                                         "board runs the same model and wire dtype, and that it is not compromised")
        except DecodeError as exc:
            if board is not None and board.sock is conn:
                self._roster.gone(board, f"sent a malformed frame ({exc})")
        except _NotTls:
            pass
        finally:
            if board is None or board.sock is not conn:
                conn.close()

    async def _tls_handshake(self, loop: asyncio.AbstractEventLoop, raw: socket.socket, peer: Any) -> Link:
        """TLS on an accepted connection, within the hello's time; raises ``_NotTls`` (said in the log) if it fails."""
        assert self._tls is not None
        try:
            return await asyncio.wait_for(accept_tls(loop, raw, self._tls), self._hello_timeout_s)
        except asyncio.TimeoutError:
            log.info("exchange: closed a connection from %s: no TLS handshake within %g s", peer_text(peer),
                     self._hello_timeout_s)
        except (TlsRefused, OSError) as exc:
            log.warning("exchange: closed a connection from %s: %s", peer_text(peer), exc)
        raise _NotTls

    async def _handshake(self, loop: asyncio.AbstractEventLoop, conn: Link, peer: Any) -> BoardState | None:
        """Read the hello; welcome the board (returned) or refuse the connection (None)."""
        where = peer_text(peer)
        buffer = bytearray()
        try:
            frame = await asyncio.wait_for(async_recv_frame(loop, conn, buffer, max_bytes=MAX_HELLO_BYTES),
                                           self._hello_timeout_s)
        except asyncio.TimeoutError:
            log.info("exchange: closed a connection from %s: no hello within %g s", where, self._hello_timeout_s)
            return None
        except (DecodeError, ConnectionClosed, OSError) as exc:
            log.info("exchange: closed a connection from %s before its hello: %s", where, exc)
            return None
        hello, problem = self._checked_hello(frame)
        if hello is None:
            log.warning("exchange: refused a connection from %s: %s", where, problem)
        elif (board := self._roster.by_id[hello.board_id]).connected:  # at once, even while a step holds the boundary
            problem = self._intruder(board, where)
        else:
            async with self._steps.boundary:  # a step boundary: the state the board starts from
                if board.connected:  # it joined while this one waited
                    problem = self._intruder(board, where)
                else:
                    start, welcome = self._snapshot(board, conn, buffer, where)
            if not problem:  # the welcome is written while the fleet steps on
                if not await self._welcome(loop, board, conn, welcome, where):
                    return None
                self._roster.changed.set()
                log.info("exchange: board %s joined from %s at step %d (in the steps from step %s)", board.board_id,
                         where, start, self._steps.step)
                return board
        await asyncio.wait_for(async_send_frame(loop, conn, Refusal(problem).to_wire()), self._hello_timeout_s)
        return None

    def _intruder(self, board: BoardState, where: str) -> str:
        """A second connection presents the id of a connected board: the refusal's text (the first connection stays)."""
        board.intruders += 1
        if board.intruders == 1:
            board.flags.append(f"refused a second connection presenting its id, from {where} (later ones are counted)")
        log.warning("exchange: refused a connection from %s presenting board %s's id: that board is connected from %s "
                    "(%d such connection(s) so far); if it was not the board itself, the job's token has leaked",
                    where, board.board_id, board.peer, board.intruders)
        return (f"board {board.board_id} is already connected to job {self._job_id} (from {board.peer}); a second "
                "connection cannot replace it. If this board restarted, its old connection is dropped once it "
                "misses a step's result; join again after that")

    def _snapshot(self, board: BoardState, conn: Link, buffer: bytearray, where: str) -> tuple[int, list[bytes | memoryview]]:
        """``board``'s welcome on ``conn`` at this step boundary (the lock held): the step it starts at and the frame.

        From here on the results of the steps that run while the welcome is written wait in the
        board's outbox, to go after it (``StepRound._queue_for_joining``); the state is
        ``welcome_state``'s copy, which the steps meanwhile do not change.
        """
        next_step, model_state, optimizer_state = self._welcome_state()
        if self._steps.step is None:
            self._steps.step = next_step
        board.sock, board.buffer, board.welcomed, board.gone_reason, board.outbox = conn, buffer, False, "", []
        board.grad, board.peer, board.sent_step, board.joined_step = None, where, next_step - 1, next_step
        board.missed_in_row = 0
        welcome = self._mode.welcome(Welcome(step=next_step, model=model_state, optimizer=optimizer_state,
                                             splits=tuple(self._relay.schedule.splits_from(next_step))), board)
        if self._welcome_extra is not None:
            welcome = welcome.with_fields(self._welcome_extra())
        self._steps.joining.append(board)
        return next_step, frame_segments(welcome.to_wire())

    async def _welcome(self, loop: asyncio.AbstractEventLoop, board: BoardState, conn: Link,
                       welcome: list[bytes | memoryview], where: str) -> bool:
        """Write ``board``'s welcome, then let it catch up, outside the step boundary (the fleet steps on meanwhile);
        then it is in the steps. False: it took no welcome, fell silent, or was dropped meanwhile (said in the log).
        """
        sent = 0
        try:
            sent += await async_send_segments(loop, conn, welcome, stall_s=self._hello_timeout_s)
            sent += await self._catch_up(loop, board, conn)
        except (OSError, asyncio.TimeoutError, DecodeError, ConnectionClosed) as exc:
            if board.sock is conn:  # not joined after all; the board may connect again
                board.sock, board.welcomed, board.buffer, board.outbox, board.grad = None, False, bytearray(), None, None
                log.warning("exchange: closed the connection of board %s from %s: it did not take its welcome or catch up "
                            "(%s)", board.board_id, where, exc)
            return False
        finally:
            self._steps.joining = [b for b in self._steps.joining if b is not board]
            self._roster.bytes_out += sent
        return board.sock is conn

    async def _catch_up(self, loop: asyncio.AbstractEventLoop, board: BoardState, conn: Link) -> int:
        """Write the results that wait in ``board``'s outbox as it asks for them, until it is at the open step; the bytes.

        The board starts at its welcome's step and computes each step after it, as any board late by
        some steps does, so its state at every step is the replica's; the steps do not wait for it
        meanwhile, and its gradients for steps already reduced are read here and left out. Once it
        has sent the gradient of the last reduced step and nothing waits for it (or its frame for
        the open step arrives), it is welcomed: the step round reads it and waits for it from then on.

        Raises:
            ConnectionClosed: the board closed its connection.
            OSError, TimeoutError: its connection failed, it took no byte for ``hello_timeout_s``, or it did not
                catch up within ``StepRound.catch_up_timeout_s`` (``step_round.JOIN_MISSES_TO_DROP`` step deadlines).
            DecodeError: a malformed frame, or a step it cannot be at.
        """
        sent, steps = 0, self._steps
        until = time.monotonic() + steps.catch_up_timeout_s
        while board.sock is conn:
            while board.outbox and board.sock is conn:
                sent += await async_send_segments(loop, conn, [board.outbox.pop(0)], stall_s=self._hello_timeout_s)
            if board.sock is not conn:
                break
            if not board.outbox and board.sent_step == (steps.step or 0) - 1:
                board.outbox, board.welcomed = None, True  # nothing waits: later results go to it as to every board
                break
            left_s = until - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"still {(steps.step or 0) - 1 - board.sent_step} steps behind the fleet after "
                                   f"{steps.catch_up_timeout_s:g} s: it cannot catch up")
            frame = await asyncio.wait_for(async_recv_frame(loop, conn, board.buffer, max_bytes=steps.max_frame_bytes),
                                           left_s)
            step = frame.get("step")
            if type(step) is not int or not board.sent_step < step <= (steps.step or 0):
                raise DecodeError(f"a frame for step {step!r} from a board at step {board.sent_step + 1} catching up "
                                  f"with step {steps.step}")
            if step == steps.step and not board.outbox:  # caught up: its gradient answers the open step
                board.outbox, board.welcomed = None, True
                steps.on_frame(board, frame)
                break
            board.sent_step = step  # a step already reduced: left out
        return sent

    def _checked_hello(self, frame: dict[str, Any]) -> tuple[Hello | None, str]:
        """The hello if this job takes it, else None and why not.

        A board of this job (its id, the job's id and token) speaking another protocol version is
        reported for that board: ``wait_for_boards`` fails naming it and the side to upgrade.
        """
        try:
            hello = Hello.from_wire(frame)
        except ExchangeVersionError as exc:
            board = self._roster.by_id.get(exc.board_id or "") if self._vouched(exc.job_id or "", exc.board_id or "",
                                                                                exc.token, exc.proof) else None
            if board is not None and not board.welcomed:
                self._roster.refuse(board, str(exc))
            return None, str(exc)
        except DecodeError as exc:
            return None, f"malformed hello ({exc})"
        if not self._vouched(hello.job_id, hello.board_id, hello.token, hello.proof):
            return None, ("wrong job or credential (a board proves itself with its own key, or the legacy fleet key, or "
                          "the token its signed command carried)")
        if hello.board_id not in self._roster.by_id:
            return None, f"board {hello.board_id!r} is not part of job {self._job_id}"
        expected = self._mode.hello_param_count(self._roster.by_id[hello.board_id])  # a pipeline's: the board's stage's
        if hello.param_count != expected:
            return None, (f"the board's model has {hello.param_count} trainable parameters, the coordinator's "
                          f"{expected}: the same model name resolves to different code; install the same version")
        return hello, ""

    def _vouched(self, job_id: str, board_id: str, token: str, proof: bytes | None) -> bool:
        """Whether a hello's job, board and credential are this job's (a token or key proof: ``protocol.exchange_auth``)."""
        if job_id != self._job_id:
            return False
        if self._checker is not None:
            return self._checker.check(job_id, board_id, token=token, proof=proof)
        return same_secret(token, self._token)


__all__ = ["ACCEPT_RETRY_S", "FD_WARN_EVERY_S", "HELLO_TIMEOUT_S", "MAX_HELLO_BYTES", "Admission", "Listener"]
