"""The exchange server: one TCP connection per board, one synchronous reduce per step.

Per step every participating board sends its mean gradient g_i over b_i samples; the server
computes g = sum(b_i g_i) / sum(b_i) in board order (so the result does not depend on arrival
order), lets the coordinator's replica apply it, and returns it to every connected board. A board
that misses the step's deadline is left out of that step and flagged; it receives the step's
result like everyone else, so its replica stays identical, and it is back at the next step. A
gradient of the wrong shape or dtype, or with NaN/Inf, is refused for that step and flagged.

This module is the connections: accepting boards, their hello and welcome, reading gradients and
sending results, deadlines. The frames are ``protocol.exchange_frames`` (a board of another
protocol version is refused and reported for that board), the arithmetic is
``coordinator.exchange.gradient_reduce``, the batch splits in force are ``coordinator.run.split_schedule``.

Re-splitting the global batch (re-balancing when a board slows down): :meth:`ExchangeServer.announce_split`
puts the split (from which step, each board's batch size by board index, the same sum) into the
next ``avg`` frame; a board joining later finds the splits that still matter in its welcome (the
one in force at its first step, then any announced for later steps). The split starts at that
``avg`` frame's step plus :data:`SPLIT_LEAD_STEPS`. Every gradient still carries its own ``n``, so
the reduce stays exact on both sides of the change.

Periodic averaging (``protocol.sync_schedule``, ``sync`` with ``every`` > 1) keeps one round per
step: at a local step every board sends an empty vector after its own optimizer step and gets an
empty result (the step's loss, timing, re-splits, learning rates and stop still travel); at a
sync step it sends its parameter delta since the last average with ``n`` = its samples since then,
reduced as gradients are (the outlier band on plain norms: ``coordinator.exchange.gradient_reduce``). A full
vector on a local step or an empty one on a sync or exact step is refused for that step, naming
the board and the step, like any malformed gradient.

Deadlines count time the coordinator could read, not wall time it did not run (Ctrl-Z, a closed
laptop lid, a paused VM, a loop blocked by other work). While a step waits, a check runs every
:data:`DEADLINE_TICK_S`; a check that runs more than :data:`DEADLINE_SLACK_S` late means the
process was not running at some moment since the previous one, and that whole interval is added to
the deadline (gradients sent meanwhile are in the kernel's buffers, or wait on the boards for room
there). When the deadline does pass, every socket is read once more before the step is reduced:
a gradient already in the kernel's buffer counts as delivered. A pause never makes a board that
delivered late.

Hostile peers: a connection has :data:`HELLO_TIMEOUT_S` to send its hello (at most
:data:`MAX_HELLO_BYTES`) and the same to take each part of its welcome, else it is closed; a board's
frames after that may not exceed the job's gradient frame plus :data:`FRAME_MARGIN_BYTES` (its
logged values), checked before anything is allocated; a board that is connected cannot be replaced
by a second connection presenting its id (the second is refused, the first kept); a gradient whose
norm is far above the other boards' is refused and flagged (``coordinator.exchange.gradient_reduce``). The
accept loop outlives running out of file descriptors (EMFILE/ENFILE): it says so once and retries,
and connections wait in the listen queue meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
import ssl
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.coordinator.exchange.gradient_reduce import (
    FOLD_MAX_ELEMENTS,
    OUTLIER_RATIO,
    WIRE_NUMPY,
    GradientReducer,
    Reduced,
    sample_weights,
)
from edgefleet.coordinator.run.split_schedule import SPLIT_LEAD_STEPS, SplitRefused, SplitSchedule, split_step
from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.errors import DecodeError, EdgeTrainError
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.protocol.exchange_frames import (
    Avg,
    BatchSplit,
    ExchangeVersionError,
    Grad,
    GradientRefused,
    Hello,
    Refusal,
    Stop,
    Welcome,
    same_secret,
)
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.protocol.sync_schedule import EXACT, LOCAL, SYNC, StepKind, SyncSchedule
from edgefleet.transport.exchange_io import (
    ConnectionClosed,
    FrameReader,
    FrameTooLarge,
    Link,
    async_recv_frame,
    async_send_frame,
    frame_segments,
    send_now_to_all,
    send_rest,
)
from edgefleet.transport.exchange_tls import TlsRefused, accept_tls

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # to send the hello after connecting, and to take each part of the welcome
MAX_HELLO_BYTES = 16 * 1024  # a hello is three short strings and a number: well under 4 KiB
FRAME_MARGIN_BYTES = 64 * 1024  # a board's frame may exceed the job's gradient frame by this (its logged values)
STOP_TIMEOUT_S = 5.0  # telling one board to stop
DEADLINE_TICK_S = 0.25   # while a step waits, its deadline is checked this often ...
DEADLINE_SLACK_S = 0.1   # ... and a check this late means the process did not run: the interval does not count
ACCEPT_RETRY_S = (0.05, 1.0)  # out of file descriptors: retry accepting after this long, doubling up to the second
FD_WARN_EVERY_S = 60.0   # ... and say so at most this often
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ExchangeError(EdgeTrainError):
    """The exchange cannot go on (port in use, every board gone, a board refused the job)."""


@dataclass
class _Board:
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
    sent_step: int = -1                     # the last step of any gradient on its connection (late ones too)
    intruders: int = 0                      # connections refused because they presented this board's id
    last_n: int = 0                         # its sample count the last time its gradient was in the average
    refusal: str = ""                       # why its gradient for that step was refused
    gone_reason: str = ""
    flags: list[str] = field(default_factory=list)
    streamed: int = 0                       # its gradients sent during backward (compute_s after the tensor: --overlap)


@dataclass(slots=True, kw_only=True)  # not frozen: a frozen dataclass's __init__ costs 4 us, once per step
class StepResult:
    step: int
    n_total: int                 # samples in this step's average
    loss: float | None           # sample-weighted mean of the boards' losses
    contributors: list[str]      # boards whose gradient is in the average
    late: list[str]              # boards left out because they missed the deadline
    refused: dict[str, str]      # boards whose gradient was refused, and why
    compute_s: dict[str, float]  # each contributor's own forward+backward time
    wall_s: float                # the step as the server saw it
    batch_sizes: dict[str, int] = field(default_factory=dict)  # each contributor's sample count n
    logs: dict[str, float] = field(default_factory=dict)  # what training_step logged: sample-weighted over the boards
    log_flags: dict[str, tuple[bool, bool, bool]] = field(default_factory=dict)  # name -> (on_step, on_epoch, prog_bar)
    kind: StepKind = EXACT       # exact (gradients averaged), local (nothing averaged) or sync (parameters averaged)


@dataclass(slots=True)
class _Finished:
    """A reduced step whose result is on its way to the boards."""

    result: StepResult
    wire: np.ndarray                                # the average as it travelled
    unsent: list[tuple[_Board, list[memoryview]]]   # boards whose send buffer could not take all of it at once
    frame_bytes: int


class _StepDeadline:
    """Calls ``expire`` once the event loop has been running for ``span_s``; time it did not run does not count.

    A check runs every :data:`DEADLINE_TICK_S`. One that runs more than :data:`DEADLINE_SLACK_S`
    after it was due shows the process was stopped (SIGSTOP, suspend, a paused VM) or its loop
    blocked at some moment since the previous check; that whole interval is added to the deadline.
    A step that finishes in time costs one ``call_at`` and one ``cancel``, as a plain timer would.
    """

    __slots__ = ("_due", "_expire", "_handle", "_last", "_loop", "_planned", "paused_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, span_s: float, expire: Callable[[], None]) -> None:
        self._loop, self._expire = loop, expire
        now = self._last = loop.time()
        self._due = now + span_s
        self.paused_s = 0.0  # time added because the process did not run
        self._planned = min(self._due, now + DEADLINE_TICK_S)
        self._handle = loop.call_at(self._planned, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now - self._planned > DEADLINE_SLACK_S:  # not run when due: the interval since the last check does not count
            self._due += now - self._last
            self.paused_s += now - self._last
            log.info("exchange: the coordinator did not run for up to %.1f s; the step's deadline moves by as much",
                     now - self._last)
        self._last = now
        if now >= self._due:
            self._expire()
            return
        self._planned = min(self._due, now + DEADLINE_TICK_S)
        self._handle = self._loop.call_at(self._planned, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


@dataclass(slots=True)
class _Fold:
    """The open step's average, summed in board order as gradients arrive (small gradients only).

    Weights come from each board's sample count at its last contribution; if a board answers with
    another count, is refused or is missing, the fold stops and the step is summed in full at the end.
    """

    step: int
    boards: list[_Board]          # welcomed at the step's start, in board order
    ns: list[int]                 # the sample counts the weights assume
    weights: list[np.float32]
    squares: list[float] = field(default_factory=list)  # of the gradients summed so far

    @property
    def complete(self) -> bool:
        return len(self.squares) == len(self.boards)


class ExchangeServer:
    """Serves one job.

    Args:
        job_id, token: a board must present both to join.
        boards: (board_id, batch_size) by board index.
        param_count: length of the flat gradient vector.
        wire_dtype: float32, float16 or bfloat16 on the wire, both ways.
        welcome_state: returns (next step, model state tree, optimizer state tree) for a joining board.
        welcome_extra: returns more fields of the welcome (``schedulers``: the LR schedulers' states).
        buffer_elements: The last ``buffer_elements`` of every vector are the model's buffers
            (BatchNorm's running statistics), not a gradient.
        int_buffer_elements: The last ``int_buffer_elements`` of those are its integer buffers' bytes
            (``num_batches_tracked``): always the first contributing board's, whatever ``buffer_sync`` says.
        buffer_sync: ``broadcast``: the result carries the first contributing board's buffers (DDP's
            rule: rank 0's buffers at every forward); ``average``: their sample-weighted average.
        splits: re-splits already in force or announced, as ``BatchSplit`` or (from_step, batch sizes),
            in step order (a resumed run's, from its checkpoint); boards learn them in their welcome.
        hello_timeout_s: a connection that has not sent its hello within this long, or that takes no
            byte of its welcome for this long, is closed.
        outlier_ratio: a gradient whose norm exceeds this many times the median of the other boards'
            (with at least two others) is refused for that step and flagged.
        tls: the server context of the job's certificate (``transport.exchange_tls``): every connection
            speaks TLS; None: plain TCP.
        checker: each board's credential (``protocol.exchange_auth``); None: every board shows ``token``.
        sync: the job's averaging schedule (``protocol.sync_schedule``); None or ``every == 1``: every step exact.
        overlap: the job's vectors hold the gradient in reversed parameter order, streamed by the boards
            as backward produces it (``--overlap``); the welcome says so. The reduce is the same: a
            streamed frame is an ordinary grad frame whose bytes arrive over a longer time.
    """

    def __init__(self, *, job_id: str, token: str, boards: list[tuple[str, int]], param_count: int, wire_dtype: str,
                 welcome_state: Callable[[], tuple[int, Any, Any]], max_grad_norm: float = 1e6,
                 splits: Sequence[BatchSplit | tuple[int, Sequence[int]]] = (),
                 welcome_extra: Callable[[], dict[str, Any]] | None = None,
                 buffer_elements: int = 0, buffer_sync: str = "broadcast", hello_timeout_s: float = HELLO_TIMEOUT_S,
                 outlier_ratio: float = OUTLIER_RATIO, tls: ssl.SSLContext | None = None,
                 checker: HelloChecker | None = None, sync: SyncSchedule | None = None, overlap: bool = False,
                 int_buffer_elements: int = 0) -> None:
        self.job_id, self._token, self.wire_dtype = job_id, token, wire_dtype
        self.overlap = overlap
        self._tls, self._checker = tls, checker
        self._hello_timeout_s = hello_timeout_s
        self.param_count = param_count
        self.boards = {bid: _Board(bid, i, b) for i, (bid, b) in enumerate(boards)}
        self._in_order = list(self.boards.values())  # by board index: the reduce's fixed order
        self._welcome_state = welcome_state
        self._welcome_extra = welcome_extra
        self._reducer = GradientReducer(param_count, wire_dtype=wire_dtype, max_grad_norm=max_grad_norm,
                                        buffer_elements=buffer_elements, buffer_sync=buffer_sync,
                                        outlier_ratio=outlier_ratio, int_buffer_elements=int_buffer_elements)
        self._sum_tensor = encode_array(self._reducer.sum)  # fixed arrays: described once
        self._sync = sync if sync is not None and sync.periodic else None
        self._empty_wire = np.zeros(0, dtype=WIRE_NUMPY[wire_dtype])  # a local step's result, as it travels ...
        self._empty_tensor = encode_array(self._empty_wire)
        self._empty32 = np.zeros(0, dtype=np.float32)                 # ... and as the replica takes it
        self._wire_tensor = encode_array(self._reducer.wire_out)
        self._hot_grad, self._hot_avg = HotFrame("grad", wire_dtype), HotFrame("avg", wire_dtype)  # fixed layouts
        self._grad_frame_bytes = self._hot_grad.prefix_bytes + param_count * self._hot_grad.itemsize  # a step's gradient frame
        self._max_frame_bytes = self._grad_frame_bytes + FRAME_MARGIN_BYTES  # the largest frame a board may send
        self._step: int | None = None
        self._gathering: tuple[int, float, asyncio.Future[_Finished]] | None = None  # the open step, its start, its outcome
        self._deadline: _StepDeadline | None = None  # the open step's
        self._boundary = asyncio.Lock()   # welcomes happen between steps, never inside one
        self._changed = asyncio.Event()   # a board joined, left or failed
        self._server_sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent_s: deque[float] = deque(maxlen=20)  # the last steps' running times (pauses left out), for the deadline
        self._fd_warned = -math.inf  # when running out of file descriptors was last reported
        self._fold: _Fold | None = None
        self._fold_weights: tuple[list[int], list[np.float32]] = ([], [])  # the last fold's counts and weights
        try:
            self._schedule = SplitSchedule([b for _, b in boards], splits)
        except SplitRefused as exc:
            raise ExchangeError(str(exc)) from None
        self._unsent_split: BatchSplit | None = None  # goes out in the next avg frame
        self._unsent_lrs: tuple[float, ...] | None = None  # the replica's learning rates, when a ReduceLROnPlateau moved them
        self._next_avg_step: int | None = None            # the step of the next avg frame to be built
        self.bytes_in = 0
        self.bytes_out = 0
        self.finished = False  # set by the driver after the last step

    @property
    def max_grad_norm(self) -> float:
        return self._reducer.max_grad_norm

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0).

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
        self._server_sock = sock
        self._spawn(self._accept_loop())
        return int(sock.getsockname()[1])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, reason: str = "job finished") -> None:
        """Tell every board to stop, then close everything."""
        loop = asyncio.get_running_loop()
        stop = Stop(reason).to_wire()
        for board in self.boards.values():
            if board.sock is not None and board.welcomed:
                try:
                    await asyncio.wait_for(async_send_frame(loop, board.sock, stop), STOP_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError):
                    pass
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for board in self.boards.values():
            self._disconnect(board)
        if self._server_sock is not None:
            self._server_sock.close()

    # --- joining --------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        """Accept connections until the server closes; no error of one connection, nor running out of
        file descriptors, ends it (a new connection waits in the listen queue until one is free)."""
        loop = asyncio.get_running_loop()
        assert self._server_sock is not None
        retry_s = ACCEPT_RETRY_S[0]
        while True:
            try:
                conn, peer = await loop.sock_accept(self._server_sock)
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
            self._spawn(self._serve(conn, peer))

    def _out_of_fds(self, exc: OSError) -> None:
        """Say (at most once a minute) that connections wait because the process has no descriptor left."""
        now = time.monotonic()
        if now - self._fd_warned < FD_WARN_EVERY_S:
            return
        self._fd_warned = now
        log.warning("exchange: cannot accept connections: %s (the coordinator has too many open files); boards "
                    "wait in the listen queue and are accepted as descriptors free up. Raise the limit "
                    "(ulimit -n, or LimitNOFILE= in a systemd unit) if this repeats", exc.strerror or exc)

    async def _serve(self, raw: socket.socket, peer: Any) -> None:
        loop = asyncio.get_running_loop()
        board: _Board | None = None
        conn: Link = raw
        try:
            if self._tls is not None:
                conn = await self._tls_handshake(loop, raw, peer)
            board = await self._handshake(loop, conn, peer)
            if board is not None:
                await self._read_grads(loop, board)
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as exc:
            if board is not None and board.sock is conn:
                self._gone(board, f"connection closed ({exc})", quiet=self.finished)
        except FrameTooLarge as exc:
            if board is not None and board.sock is conn:
                self._gone(board, f"sent a frame of {exc.size} bytes; this job's frames are at most {exc.max_bytes} "
                                  f"({self.param_count} {self.wire_dtype} values and their fields): check that the board "
                                  "runs the same model and wire dtype, and that it is not compromised")
        except DecodeError as exc:
            if board is not None and board.sock is conn:
                self._gone(board, f"sent a malformed frame ({exc})")
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
            log.info("exchange: closed a connection from %s: no TLS handshake within %g s", _peer_text(peer),
                     self._hello_timeout_s)
        except (TlsRefused, OSError) as exc:
            log.warning("exchange: closed a connection from %s: %s", _peer_text(peer), exc)
        raise _NotTls

    async def _handshake(self, loop: asyncio.AbstractEventLoop, conn: Link, peer: Any) -> _Board | None:
        """Read the hello; welcome the board (returned) or refuse the connection (None).

        The hello must arrive within ``hello_timeout_s``; the welcome is sent under the step
        boundary's lock, so a connection that stops taking it for ``hello_timeout_s`` is closed
        rather than holding every step up.
        """
        where = _peer_text(peer)
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
        elif self._connected(board := self.boards[hello.board_id]):  # at once, even while a step holds the boundary
            problem = self._intruder(board, where)
        else:
            async with self._boundary:
                if self._connected(board):  # it joined while this one waited
                    problem = self._intruder(board, where)
                else:
                    joined = await self._welcome(loop, board, conn, buffer, where)
                    if joined is None:
                        return None
                    self._changed.set()
                    log.info("exchange: board %s joined from %s at step %d", board.board_id, where, joined)
                    return board
        await asyncio.wait_for(async_send_frame(loop, conn, Refusal(problem).to_wire()), self._hello_timeout_s)
        return None

    @staticmethod
    def _connected(board: _Board) -> bool:
        """Whether ``board`` has a connection (welcomed, or being welcomed): no other may take its place."""
        return board.welcomed and board.sock is not None

    def _intruder(self, board: _Board, where: str) -> str:
        """A second connection presents the id of a connected board: the refusal's text (the first connection stays)."""
        board.intruders += 1
        if board.intruders == 1:
            board.flags.append(f"refused a second connection presenting its id, from {where} (later ones are counted)")
        log.warning("exchange: refused a connection from %s presenting board %s's id: that board is connected from %s "
                    "(%d such connection(s) so far); if it was not the board itself, the job's token has leaked",
                    where, board.board_id, board.peer, board.intruders)
        return (f"board {board.board_id} is already connected to job {self.job_id} (from {board.peer}); a second "
                "connection cannot replace it. If this board restarted, its old connection is dropped once it "
                "misses a step's result; join again after that")

    async def _welcome(self, loop: asyncio.AbstractEventLoop, board: _Board, conn: Link, buffer: bytearray,
                       where: str) -> int | None:
        """Welcome ``board`` on ``conn`` (the boundary's lock held): the step it starts at, or None if it took no welcome."""
        next_step, model_state, optimizer_state = self._welcome_state()
        if self._step is None:
            self._step = next_step
        board.sock, board.buffer, board.welcomed, board.gone_reason = conn, buffer, True, ""
        board.grad, board.peer, board.sent_step = None, where, -1
        welcome = Welcome(step=next_step, model=model_state, optimizer=optimizer_state,
                          splits=tuple(self._schedule.splits_from(next_step)), overlap=self.overlap)
        if self._welcome_extra is not None:
            welcome = welcome.with_fields(self._welcome_extra())
        try:
            self.bytes_out += await async_send_frame(loop, conn, welcome.to_wire(), stall_s=self._hello_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            if board.sock is conn:  # not joined after all; the board may connect again
                board.sock, board.welcomed, board.buffer = None, False, bytearray()
            log.warning("exchange: closed the connection of board %s from %s: it did not take its welcome (%s)",
                        board.board_id, where, exc)
            return None
        return next_step

    def _checked_hello(self, frame: dict[str, Any]) -> tuple[Hello | None, str]:
        """The hello if this job takes it, else None and why not.

        A board of this job (its id, the job's id and token) speaking another protocol version is
        reported for that board: :meth:`wait_for_boards` fails naming it and the side to upgrade.
        """
        try:
            hello = Hello.from_wire(frame)
        except ExchangeVersionError as exc:
            board = self.boards.get(exc.board_id or "") if self._vouched(exc.job_id or "", exc.board_id or "", exc.token,
                                                                         exc.proof) else None
            if board is not None and not board.welcomed:
                self._refuse_board(board, str(exc))
            return None, str(exc)
        except DecodeError as exc:
            return None, f"malformed hello ({exc})"
        if not self._vouched(hello.job_id, hello.board_id, hello.token, hello.proof):
            return None, ("wrong job or credential (a board proves itself with its own key, or the legacy fleet key, or "
                          "the token its signed command carried)")
        if hello.board_id not in self.boards:
            return None, f"board {hello.board_id!r} is not part of job {self.job_id}"
        if hello.param_count != self.param_count:
            return None, (f"the board's model has {hello.param_count} trainable parameters, the coordinator's "
                          f"{self.param_count}: the same model name resolves to different code; install the same version")
        return hello, ""

    def _vouched(self, job_id: str, board_id: str, token: str, proof: bytes | None) -> bool:
        """Whether a hello's job, board and credential are this job's (a token or key proof: ``protocol.exchange_auth``)."""
        if job_id != self.job_id:
            return False
        if self._checker is not None:
            return self._checker.check(job_id, board_id, token=token, proof=proof)
        return same_secret(token, self._token)

    def _refuse_board(self, board: _Board, reason: str) -> None:
        """A board of this job cannot join at all (another protocol version): it counts as failed."""
        board.gone_reason = reason
        board.flags.append(f"refused: {reason}")
        log.error("exchange: board %s cannot join: %s", board.board_id, reason)
        self._changed.set()

    def _disconnect(self, board: _Board) -> None:
        """Stop reading the board's connection (before its descriptor is closed), then close it."""
        if board.reader is not None:
            board.reader.stop()
            board.reader = None
        if board.sock is not None:
            board.sock.close()
            board.sock = None

    def _gone(self, board: _Board, reason: str, *, quiet: bool = False) -> None:
        self._disconnect(board)
        board.sock, board.welcomed, board.grad, board.gone_reason = None, False, None, reason
        if quiet:  # boards close their connection once they have taken the last step
            return
        board.flags.append(f"left: {reason}")
        log.warning("exchange: board %s left: %s", board.board_id, reason)
        self._changed.set()
        self._finish_if_ready()  # it may have been the last one the step waited for

    def fail(self, board_id: str, reason: str) -> None:
        """Mark a board as failed from outside (its agent reported that the job failed)."""
        board = self.boards.get(board_id)
        if board is not None:
            board.gone_reason = reason
            self._gone(board, reason)

    @property
    def connected(self) -> list[str]:
        return [b.board_id for b in self.boards.values() if b.welcomed]

    async def wait_for_boards(self, timeout_s: float, *, need: set[str]) -> None:
        """Wait until every board in ``need`` joined.

        Raises:
            ExchangeError: a board failed or was refused, or time ran out, naming the boards and why.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            failed = {b.board_id: b.gone_reason for b in self.boards.values() if b.board_id in need and b.gone_reason}
            if failed:
                raise ExchangeError("; ".join(f"board {k}: {v}" for k, v in failed.items()))
            missing = sorted(need - set(self.connected))
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExchangeError(f"board(s) {', '.join(missing)} did not connect to the exchange within {timeout_s:.0f} s: "
                                    "check that they can reach the coordinator's --exchange-host and that the agent is running")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    # --- re-splitting the global batch ----------------------------------------------------
    @property
    def next_split_step(self) -> int:
        """The step a split announced now takes effect at (the next avg frame's step + the lead)."""
        next_avg = self._next_avg_step if self._next_avg_step is not None else self._step
        return split_step(next_avg or 0)

    def announce_split(self, batch_sizes: Sequence[int]) -> int:
        """Re-divide the global batch among the boards (by board index) from :attr:`next_split_step` on.

        The split travels in the next ``avg`` frame and in later boards' welcomes. Returns the step
        it takes effect at.

        Raises:
            ExchangeError: the sizes change the global batch or the number of boards, or leave a board empty.
        """
        try:
            split = self._schedule.add(self.next_split_step, batch_sizes)
        except SplitRefused as exc:
            raise ExchangeError(str(exc)) from None
        self._unsent_split = split
        return split.from_step

    @property
    def splits(self) -> list[BatchSplit]:
        """Every split announced (or restored), in step order."""
        return self._schedule.splits

    def splits_from(self, step: int) -> list[BatchSplit]:
        """The splits a board starting at ``step`` needs: the one in force then, and any later ones."""
        return self._schedule.splits_from(step)

    def batch_sizes_at(self, step: int) -> list[int]:
        """Every board's batch size at ``step``, by board index."""
        return self._schedule.batch_sizes_at(step)

    # --- steps ----------------------------------------------------------------------------
    async def _read_grads(self, loop: asyncio.AbstractEventLoop, board: _Board) -> None:
        """Read the board's gradients until its connection ends; raises why it ended.

        Frames are read in event-loop callbacks (``FrameReader``): no task wakes per frame. A kept
        gradient is a view into the reader's buffer until the step is reduced (a board sends its
        next gradient only after it has the result, so the buffer is free again by then).
        """
        assert board.sock is not None
        reader = FrameReader(loop, board.sock, board.buffer, lambda frame: self._on_frame(board, frame),
                             decode=self._hot_grad.decode_any_array, expected_bytes=self._grad_frame_bytes,
                             max_bytes=self._max_frame_bytes)
        board.reader = reader
        reader.resume()
        reason = await reader.done
        if board.reader is reader:
            board.reader = None
        raise reason

    def _on_frame(self, board: _Board, frame: dict[str, Any]) -> bool:
        """A frame arrived from ``board``: keep it, add it to the sum, finish the step if it was the last; read on."""
        self._accept_grad(board, frame)
        if self._fold is not None:
            self._fold_arrived()
        self._finish_if_ready()
        return True

    def _start_fold(self, step: int) -> None:
        """Sum this step's gradients as they arrive, when they are small and every board's count is known."""
        self._fold = None
        boards = [b for b in self._in_order if b.welcomed]
        ns = [b.last_n for b in boards]
        if self.param_count > FOLD_MAX_ELEMENTS or not boards or 0 in ns or self._kind(step) != EXACT:
            return
        if self._fold_weights[0] != ns:  # the counts rarely change: the weights are made once
            self._fold_weights = (ns, sample_weights(ns))
        self._fold = _Fold(step, boards, ns, self._fold_weights[1])
        self._fold_arrived()  # gradients that came early

    def _fold_arrived(self) -> None:
        """Add the gradients that arrived, as far as board order allows (a later board waits for an earlier one)."""
        fold = self._fold
        if fold is None or fold.step != self._step:
            return
        while not fold.complete:
            i = len(fold.squares)
            board = fold.boards[i]
            if board.grad is None or board.n != fold.ns[i]:
                return  # not here yet, refused, or another count: summed in full at the end if need be
            fold.squares.append(self._reducer.add_weighted(board.grad, fold.weights[i], first=i == 0))

    def _accept_grad(self, board: _Board, raw: dict[str, Any]) -> None:
        """Keep a board's gradient for the current step, or flag why not.

        Raises:
            DecodeError: not a gradient for this step or an earlier one: the board's stream is broken.
        """
        elements = self.param_count
        if self._sync is not None:  # a local step's vector is empty
            step = raw.get("step") if type(raw) is dict else None
            elements = 0 if type(step) is int and self._kind(step) == LOCAL else self.param_count
        try:
            frame = Grad.from_wire(raw, elements=elements, dtype=self.wire_dtype)
        except GradientRefused as exc:
            if self._sync is not None and _vector_length(raw) not in (None, elements):
                exc = self._wrong_size(board, exc)
            if self._answers_open_step(board, exc.step):
                board.refusal = str(exc)
                board.flags.append(f"step {exc.step}: refused ({exc})")
                log.warning("exchange: step %s: refused board %s's gradient: %s", exc.step, board.board_id, exc)
            return
        if self._answers_open_step(board, frame.step):
            grad = frame.array
            if self.overlap and next(reversed(raw)) == "compute_s":  # decoders keep the order: a streamed frame's is last
                board.streamed += 1
            self.bytes_in += grad.nbytes
            board.grad, board.n, board.logs = grad, frame.n, frame.logs
            board.loss, board.compute_s = frame.loss, frame.compute_s

    def _kind(self, step: int) -> StepKind:
        """What ``step`` averages: gradients (exact), nothing (local) or parameters (sync)."""
        return self._sync.kind(step) if self._sync is not None else EXACT

    def _wrong_size(self, board: _Board, exc: GradientRefused) -> GradientRefused:
        """A refusal that says which vector a step of periodic averaging takes, naming the board and the step."""
        kind = self._kind(exc.step)
        if kind == LOCAL:
            expected = "an empty vector: it is a local step of periodic averaging (--sync-every)"
        else:
            expected = f"the full vector of {self.param_count} values: it is {'an' if kind == EXACT else 'a'} {kind} step"
        return GradientRefused(f"board {board.board_id} sent a vector of the wrong size for step {exc.step}, which "
                               f"takes {expected} ({exc})", step=exc.step)

    def _answers_open_step(self, board: _Board, step: int) -> bool:
        """Whether a gradient for ``step`` answers the open step (noted); one that came after its deadline is flagged.

        Raises:
            DecodeError: a step the exchange is not at and has not passed, or one this board sent already.
        """
        if step <= board.sent_step:
            raise DecodeError(f"a second gradient for step {step}")
        board.sent_step = step
        if step != self._step:
            if self._step is not None and step < self._step:
                board.flags.append(f"step {step}: arrived after the deadline")
                return False
            raise DecodeError(f"grad for step {step} while the exchange is at step {self._step}")
        board.answered_step = step
        return True

    def _waiting(self) -> bool:
        """Whether a connected board has not answered the open step yet."""
        step = self._step
        for board in self._in_order:
            if board.welcomed and board.answered_step != step:
                return True
        return False

    def deadline_for_next_step(self, minimum_s: float) -> float:
        """The step deadline: generous at first, then five times the recent median step."""
        if len(self._recent_s) < 3:
            return max(minimum_s, 60.0)
        return max(minimum_s, 5 * statistics.median(self._recent_s))

    def _reduce(self, step: int, started: float) -> tuple[StepResult, np.ndarray]:
        kind = self._kind(step)
        refused: dict[str, str] = {}
        late: list[str] = []
        answered: list[_Board] = []
        for board in self._in_order:  # fixed order: deterministic sums
            if not board.welcomed:
                continue
            if board.grad is not None:
                answered.append(board)
            elif board.answered_step != step:
                late.append(board.board_id)
                board.flags.append(f"step {step}: missed the deadline")
            else:
                refused[board.board_id] = board.refusal
        fold, self._fold = self._fold, None
        folded = (fold is not None and fold.step == step and fold.complete and fold.boards == answered
                  and all(b.n == n for b, n in zip(answered, fold.ns)))
        grads = [(b.grad, b.n) for b in answered if b.grad is not None]
        if kind == LOCAL:  # nothing to average: every board that answered took its own step
            outcome = Reduced(list(range(len(grads))), [])
        else:  # a sync step's vectors are parameter deltas, weighted by the samples since the last average
            outcome = self._reducer.reduce(grads, fold.squares if folded and fold is not None else None,
                                           scale_by_samples=kind == EXACT)
        for i, why in outcome.refused:  # rare: NaN, Inf or an implausible norm
            board = answered[i]
            refused[board.board_id] = why
            board.flags.append(f"step {step}: refused ({why})")
            log.warning("exchange: step %d: refused board %s's gradient: %s", step, board.board_id, why)
        kept = [answered[i] for i in outcome.kept]
        for board in self._in_order:
            board.grad = None
        if not kept:
            raise ExchangeError(f"step {step}: no board contributed a usable gradient "
                                f"(late: {late or 'none'}; refused: {refused or 'none'})")
        total, weighted_loss = 0, 0.0
        logged: dict[str, list[float]] = {}  # name -> [sum of n * value, sum of n]
        log_flags: dict[str, tuple[bool, bool, bool]] = {}
        contributors: list[str] = []
        compute: dict[str, float] = {}
        sizes: dict[str, int] = {}
        step_sizes = self._schedule.batch_sizes_at(step) if kind == SYNC else None
        for board in kept:  # one pass: this runs once per step on the exchange's critical path
            if step_sizes is None:
                n = board.last_n = board.n
            else:  # the frame's n is the weight (samples since the last average); this step's batch is the split's
                n = step_sizes[board.index]
            total += n
            weighted_loss += (board.loss or 0.0) * n
            contributors.append(board.board_id)
            sizes[board.board_id] = n
            if board.compute_s is not None:
                compute[board.board_id] = board.compute_s
            for name, (value, *flags) in (board.logs or {}).items():
                sums = logged.setdefault(name, [0.0, 0.0])
                sums[0] += value * n
                sums[1] += n
                on_step, on_epoch, prog_bar = flags
                log_flags.setdefault(name, (on_step, on_epoch, prog_bar))
        wall = time.monotonic() - started
        self._recent_s.append(wall - (self._deadline.paused_s if self._deadline is not None else 0.0))
        result = StepResult(step=step, n_total=total, loss=weighted_loss / total, contributors=contributors, late=late,
                            refused=refused, compute_s=compute, wall_s=wall, batch_sizes=sizes,
                            logs={name: s / w for name, (s, w) in logged.items() if math.isfinite(s / w)},
                            log_flags=log_flags, kind=kind)
        return result, self._empty32 if kind == LOCAL else self._reducer.sum

    def wire_to_float32(self, wire: np.ndarray) -> np.ndarray:
        """A result as it travelled, widened to float32 for the replica."""
        return self._reducer.wire_to_float32(wire)

    async def run_step(self, step: int, *, apply: Callable[[np.ndarray, StepResult], None],
                       minimum_deadline_s: float = 10.0) -> StepResult:
        """Gather, reduce, return the average to every board, and let ``apply`` update the replica.

        The step is reduced and its result sent as soon as it can be: in the reader callback of
        the last gradient (no task wakes between the last gradient and the result going out), at
        the deadline, or when the last pending board leaves. ``apply`` runs after the result is on
        its way, while the boards compute the next step.

        Raises:
            ExchangeError: no board is left, or none contributed.
        """
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        span_s = self.deadline_for_next_step(minimum_deadline_s)
        async with self._boundary:
            self._step = step  # gradients that arrived early for this step are already kept
            gathered: asyncio.Future[_Finished] = loop.create_future()
            self._gathering = (step, started, gathered)
            self._start_fold(step)
            self._deadline = deadline = _StepDeadline(loop, span_s, self._deadline_passed)
            try:
                self._finish_if_ready()
                finished = await gathered
            finally:
                deadline.cancel()
                self._gathering = self._deadline = None
            if finished.unsent:  # a large result the send buffers could not take at once
                waiting = [(board, board.sock, rest) for board, rest in finished.unsent if board.sock is not None]
                failures = await send_rest(loop, [(sock, rest) for _, sock, rest in waiting if sock is not None])
                for (board, _, _), failure in zip(waiting, failures):
                    if failure is not None:
                        self._gone(board, f"could not receive the step's result ({failure})")
                    else:
                        self.bytes_out += finished.frame_bytes
            # The replica steps while the boards compute; welcomes wait for it (the lock is held).
            apply(self._empty32 if finished.result.kind == LOCAL else self.wire_to_float32(finished.wire), finished.result)
        return finished.result

    def _deadline_passed(self) -> None:
        """The open step's time is up: first read what waits in the kernel's buffers (delivered, not late), then reduce."""
        step = self._step
        for board in self._in_order:
            if self._gathering is None:
                return  # the last gradient read finished the step
            if board.welcomed and board.answered_step != step and board.reader is not None:
                board.reader.read_now()
        self._finish_if_ready(True)

    def _finish_if_ready(self, expired: bool = False) -> None:
        """Reduce the open step and send its result, if every board answered or time is up."""
        if self._gathering is None or (not expired and self._waiting()):
            return
        step, started, gathered = self._gathering
        self._gathering = None  # a board failing while its result is sent must not finish the step again
        if gathered.done():  # run_step was cancelled
            return
        try:
            gathered.set_result(self._finish_step(step, started))
        except Exception as exc:
            gathered.set_exception(exc)

    def _finish_step(self, step: int, started: float) -> _Finished:
        """Reduce ``step``, encode the result once, and hand it to every board's socket."""
        result, avg = self._reduce(step, started)
        if result.kind == LOCAL:
            wire, tensor = self._empty_wire, self._empty_tensor
        else:
            wire = self._reducer.to_wire(avg)
            tensor = self._sum_tensor if wire is avg else self._wire_tensor  # fixed arrays: described once
        segments = None  # encoded once, for every board
        if self._unsent_split is None and self._unsent_lrs is None:
            segments = Avg.encode_hot(self._hot_avg, step=step, n=result.n_total, boards=len(result.contributors),
                                      tensor=tensor)
        if segments is None:  # a re-split or learning rates travel with it: the general encoder
            frame = Avg(step=step, n=result.n_total, boards=len(result.contributors), g=tensor, split=self._unsent_split,
                        lrs=self._unsent_lrs)
            segments = frame_segments(frame.to_wire())
        self._unsent_split = self._unsent_lrs = None
        self._next_avg_step = step + 1  # from here on, an announced split waits for the next frame
        self._step = step + 1  # a fast board may send the next step's gradient while the others still receive
        frame_bytes = sum(memoryview(segment).nbytes for segment in segments)
        targets = [b for b in self.boards.values() if b.welcomed and b.sock is not None]
        unsent: list[tuple[_Board, list[memoryview]]] = []
        for board, rest in zip(targets, send_now_to_all([b.sock for b in targets if b.sock is not None], segments)):
            if isinstance(rest, OSError):
                self._gone(board, f"could not receive the step's result ({rest})")
            elif rest:
                unsent.append((board, rest))
            else:
                self.bytes_out += frame_bytes
        return _Finished(result=result, wire=wire, unsent=unsent, frame_bytes=frame_bytes)

    def announce_lrs(self, lrs: Sequence[float]) -> None:
        """Send the replica's learning rates (one per param group) with the next result: every board sets them
        before that step's update (a ReduceLROnPlateau decides on the coordinator, where its metric is)."""
        self._unsent_lrs = tuple(float(lr) for lr in lrs)

    def flags(self) -> dict[str, list[str]]:
        return {b.board_id: list(b.flags) for b in self.boards.values() if b.flags}

    def streamed_steps(self) -> dict[str, int]:
        """How many of each board's kept gradients it sent during backward (``--overlap``; a board that cannot
        stream, e.g. with gradient accumulation, sends after backward: its count stays 0)."""
        return {b.board_id: b.streamed for b in self.boards.values()}


class _NotTls(Exception):
    """A connection that did not complete its TLS handshake (already logged)."""


def _vector_length(frame: Any) -> int | None:
    """How many values a grad frame's vector holds, if it says so plainly (a decoded array or a flat tensor map)."""
    g = frame.get("g") if type(frame) is dict else None
    if isinstance(g, np.ndarray):
        return int(g.size)
    shape = g.get("shape") if isinstance(g, dict) else None
    return shape[0] if isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int else None


def _peer_text(peer: Any) -> str:
    """A peer address as host:port."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


__all__ = ["SPLIT_LEAD_STEPS", "ExchangeError", "ExchangeServer", "StepResult"]
