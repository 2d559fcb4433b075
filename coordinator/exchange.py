"""The exchange server: one TCP connection per board, one synchronous reduce per step.

Per step every participating board sends its mean gradient g_i over b_i samples; the server
computes g = sum(b_i g_i) / sum(b_i) in board order (so the result does not depend on arrival
order), lets the coordinator's replica apply it, and returns it to every connected board. A board
that misses the step's deadline is left out of that step and flagged; it receives the step's
result like everyone else, so its replica stays identical, and it is back at the next step. A
gradient of the wrong shape or dtype, or with NaN/Inf, is refused for that step and flagged.

Frames (msgpack maps, ``transport.exchange_io``):
    board -> server  hello {job_id, board_id, token, param_count, v}
    server -> board  welcome {step, model, optimizer, schedulers?, splits?}   | error {message}
    board -> server  grad {step, n, loss, compute_s, g: tensor}
    server -> board  avg {step, n, boards, g: tensor, split?}    | stop {reason}

Re-splitting the global batch (re-balancing when a board slows down): :meth:`ExchangeServer.announce_split`
puts ``split = {"from_step": s, "batch_sizes": [b_0, b_1, ...]}`` (by board index, the same sum)
into the next ``avg`` frame; a board joining later finds the splits that still matter in its
welcome's ``splits`` list (the one in force at its first step, then any announced for later
steps). ``s`` is that ``avg`` frame's step plus :data:`SPLIT_LEAD_STEPS`, because a board reads
the result of step ``t`` when its data loader may already have drawn the batch of step ``t + 1``.
Every gradient still carries its own ``n``, so the reduce stays exact on both sides of the change.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.protocol.codec import decode_array, encode_array
from edgefleet.protocol.errors import DecodeError, EdgeTrainError
from edgefleet.protocol.half_cast import cast_into
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.transport.exchange_io import (
    ConnectionClosed,
    FrameReader,
    async_recv_frame,
    async_send_frame,
    frame_segments,
    send_now_to_all,
    send_rest,
)

log = logging.getLogger(__name__)

EXCHANGE_VERSION = 1
HELLO_TIMEOUT_S = 10.0
REDUCE_BLOCK = 1 << 16  # float32 elements: a block of the sum and of the scratch stay in the CPU cache
FOLD_MAX_ELEMENTS = 1 << 19  # gradients up to this size (2 MB of float32) are summed as they arrive
# A split announced in the avg frame of step t takes effect at step t + SPLIT_LEAD_STEPS. When that
# frame arrives the board has trained on step t, and Lightning's fetcher may already have drawn
# step t + 1: it prefetches one batch to learn whether it is the last, whenever the loader has no
# len() (Lightning 2.6 skips it for sized loaders such as the worker's). Step t + 2 is drawn after
# the frame in every case. tests/workloads/test_sharding.py measures the fetcher's lead with the
# installed Lightning; a board refuses a split for a step it has already drawn (SplitError).
SPLIT_LEAD_STEPS = 2
_WIRE_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


MAX_LOGGED = 64  # names a board may log in one step


def _checked_logs(value: Any) -> dict[str, list[Any]] | None:
    """A grad frame's ``logs`` (name -> [finite value, on_step, on_epoch, prog_bar]), or None if absent.

    Raises:
        DecodeError: anything else: a board's bad logs refuse its gradient for the step, they never reach a logger.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGGED:
        raise DecodeError(f"logs must be a map of at most {MAX_LOGGED} names")
    for name, entry in value.items():
        if not (isinstance(name, str) and 0 < len(name) <= 128 and isinstance(entry, list) and len(entry) == 4
                and isinstance(entry[0], (int, float)) and not isinstance(entry[0], bool) and math.isfinite(entry[0])
                and all(isinstance(flag, bool) for flag in entry[1:])):
            raise DecodeError(f"logged value {str(name)[:40]!r} is not [finite number, on_step, on_epoch, prog_bar]")
    return value


def _scale_into(target: np.ndarray, grad: np.ndarray, weight: np.float32) -> float:
    """``target = weight * grad`` in float32 (a wire dtype widened first); the gradient's squared norm.

    float32 is read in place, with no widening copy. NaN or Inf anywhere makes the norm non-finite.
    """
    if grad.dtype == np.float32:
        square = float(np.dot(grad, grad))
        np.multiply(grad, weight, out=target)
        return square
    cast_into(target, grad)
    square = float(np.dot(target, target))
    target *= weight
    return square


class ExchangeError(EdgeTrainError):
    """The exchange cannot go on (port in use, every board gone, a board refused the job)."""


@dataclass
class _Board:
    board_id: str
    index: int
    batch_size: int
    sock: socket.socket | None = None
    buffer: bytearray = field(default_factory=bytearray)
    grad: np.ndarray | None = None          # this step's gradient: a view into ``buffer``
    n: int = 0
    loss: float | None = None
    compute_s: float | None = None
    logs: dict[str, list[Any]] | None = None  # this step's ``self.log`` values: name -> [value, on_step, on_epoch, prog_bar]
    reader: FrameReader | None = None     # reads its frames in loop callbacks
    welcomed: bool = False
    answered_step: int = -1                 # the last step this board sent a gradient for (kept or refused)
    last_n: int = 0                         # its sample count the last time its gradient was in the average
    refusal: str = ""                       # why its gradient for that step was refused
    gone_reason: str = ""
    flags: list[str] = field(default_factory=list)


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


@dataclass(slots=True)
class _Finished:
    """A reduced step whose result is on its way to the boards."""

    result: StepResult
    wire: np.ndarray                                # the average as it travelled
    unsent: list[tuple[_Board, list[memoryview]]]   # boards whose send buffer could not take all of it at once
    frame_bytes: int


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
        buffer_elements: The last ``buffer_elements`` of every vector are the model's float buffers
            (BatchNorm's running statistics), not a gradient.
        buffer_sync: ``broadcast``: the result carries the first contributing board's buffers (DDP's
            rule: rank 0's buffers at every forward); ``average``: their sample-weighted average.
        splits: re-splits already in force or announced, as (from_step, batch sizes), in step
            order (a resumed run's, from its checkpoint); boards learn them in their welcome.
    """

    def __init__(self, *, job_id: str, token: str, boards: list[tuple[str, int]], param_count: int, wire_dtype: str,
                 welcome_state: Callable[[], tuple[int, Any, Any]], max_grad_norm: float = 1e6,
                 splits: Sequence[tuple[int, Sequence[int]]] = (),
                 welcome_extra: Callable[[], dict[str, Any]] | None = None,
                 buffer_elements: int = 0, buffer_sync: str = "broadcast") -> None:
        self.job_id, self._token, self.wire_dtype = job_id, token, wire_dtype
        self.param_count = param_count
        self.boards = {bid: _Board(bid, i, b) for i, (bid, b) in enumerate(boards)}
        self._in_order = list(self.boards.values())  # by board index: the reduce's fixed order
        self._welcome_state = welcome_state
        self._welcome_extra = welcome_extra
        if not 0 <= buffer_elements <= param_count or buffer_sync not in ("broadcast", "average"):
            raise ValueError(f"buffer_elements {buffer_elements} / buffer_sync {buffer_sync!r} out of range")
        self._buffer_elements = buffer_elements
        self._buffers_from = param_count - buffer_elements if buffer_elements and buffer_sync == "broadcast" else None
        self.max_grad_norm = max_grad_norm
        self._sum = np.zeros(param_count, dtype=np.float32)
        self._scratch = np.zeros(param_count, dtype=np.float32)
        self._wire_out = np.zeros(param_count, dtype=_WIRE_NUMPY[wire_dtype])
        self._grad_shape, self._grad_dtype = (param_count,), self._wire_out.dtype  # what a gradient must be
        self._sum_tensor, self._wire_tensor = encode_array(self._sum), encode_array(self._wire_out)
        self._applied: np.ndarray | None = None  # fp16/bf16 jobs: the average widened back, for the replica
        self._hot_grad, self._hot_avg = HotFrame("grad", wire_dtype), HotFrame("avg", wire_dtype)  # fixed layouts
        self._grad_frame_bytes = self._hot_grad.prefix_bytes + param_count * self._hot_grad.itemsize  # a step's gradient frame
        self._step: int | None = None
        self._gathering: tuple[int, float, asyncio.Future[_Finished]] | None = None  # the open step, its start, its outcome
        self._boundary = asyncio.Lock()   # welcomes happen between steps, never inside one
        self._changed = asyncio.Event()   # a board joined, left or failed
        self._server_sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent_s: deque[float] = deque(maxlen=20)  # the last steps' wall times, for the deadline
        self._fold: _Fold | None = None
        self._fold_weights: tuple[list[int], list[np.float32]] = ([], [])  # the last fold's counts and weights
        self._global_batch = sum(b for _, b in boards)
        self._splits: list[dict[str, Any]] = []
        self._unsent_split: dict[str, Any] | None = None  # goes out in the next avg frame
        self._unsent_lrs: list[float] | None = None  # the replica's learning rates, when a ReduceLROnPlateau moved them
        self._next_avg_step: int | None = None            # the step of the next avg frame to be built
        for from_step, sizes in splits:
            self._splits.append(self._checked_split(from_step, sizes))
        self.bytes_in = 0
        self.bytes_out = 0
        self.finished = False  # set by the driver after the last step

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
        for board in self.boards.values():
            if board.sock is not None and board.welcomed:
                try:
                    await asyncio.wait_for(async_send_frame(loop, board.sock, {"type": "stop", "reason": reason}), 5)
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
        loop = asyncio.get_running_loop()
        assert self._server_sock is not None
        while True:
            conn, peer = await loop.sock_accept(self._server_sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(conn, peer))

    async def _serve(self, conn: socket.socket, peer: Any) -> None:
        loop = asyncio.get_running_loop()
        board: _Board | None = None
        try:
            board = await self._handshake(loop, conn, peer)
            if board is None:
                conn.close()
                return
            await self._read_grads(loop, board)
        except (ConnectionClosed, OSError) as exc:
            if board is not None and board.sock is conn:
                self._gone(board, f"connection closed ({exc})", quiet=self.finished)
        except DecodeError as exc:
            if board is not None and board.sock is conn:
                self._gone(board, f"sent a malformed frame ({exc})")
            conn.close()

    async def _handshake(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, peer: Any) -> _Board | None:
        buffer = bytearray()
        hello = await asyncio.wait_for(async_recv_frame(loop, conn, buffer, max_bytes=64 * 1024), HELLO_TIMEOUT_S)
        board = self.boards.get(str(hello.get("board_id")))
        problem = ""
        if hello.get("type") != "hello" or hello.get("v") != EXCHANGE_VERSION:
            problem = f"expected hello version {EXCHANGE_VERSION}"
        elif hello.get("job_id") != self.job_id or not hmac.compare_digest(str(hello.get("token", "")), self._token):
            problem = "wrong job or token"
        elif board is None:
            problem = f"board {hello.get('board_id')!r} is not part of job {self.job_id}"
        elif hello.get("param_count") != self.param_count:
            problem = (f"the board's model has {hello.get('param_count')} trainable parameters, the coordinator's "
                       f"{self.param_count}: the same model name resolves to different code; install the same version")
        if problem:
            log.warning("exchange: refused a connection from %s: %s", peer, problem)
            await async_send_frame(loop, conn, {"type": "error", "message": problem})
            return None
        assert board is not None
        async with self._boundary:
            self._disconnect(board)  # a reconnect replaces the old connection
            next_step, model_state, optimizer_state = self._welcome_state()
            if self._step is None:
                self._step = next_step
            board.sock, board.buffer, board.welcomed, board.gone_reason = conn, buffer, True, ""
            board.grad = None
            welcome = {"type": "welcome", "step": next_step, "model": model_state, "optimizer": optimizer_state}
            if self._welcome_extra is not None:
                welcome.update(self._welcome_extra())
            splits = self.splits_from(next_step)
            if splits:
                welcome["splits"] = splits
            self.bytes_out += await async_send_frame(loop, conn, welcome)
        log.info("exchange: board %s joined from %s at step %d", board.board_id, peer, next_step)
        self._changed.set()
        return board

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
            ExchangeError: a board failed or time ran out, naming the boards and why.
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
    def _checked_split(self, from_step: int, batch_sizes: Sequence[int]) -> dict[str, Any]:
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != len(self.boards) or min(sizes) < 1 or sum(sizes) != self._global_batch:
            raise ExchangeError(f"re-split {sizes} must give each of the {len(self.boards)} boards at least one "
                                f"sample and keep the global batch of {self._global_batch}")
        if self._splits and from_step < self._splits[-1]["from_step"]:
            raise ExchangeError(f"a re-split from step {from_step} would come before the one from step "
                                f"{self._splits[-1]['from_step']}")
        return {"from_step": int(from_step), "batch_sizes": sizes}

    @property
    def next_split_step(self) -> int:
        """The step a split announced now takes effect at (the next avg frame's step + the lead)."""
        next_avg = self._next_avg_step if self._next_avg_step is not None else self._step
        return (next_avg or 0) + SPLIT_LEAD_STEPS

    def announce_split(self, batch_sizes: Sequence[int]) -> int:
        """Re-divide the global batch among the boards (by board index) from :attr:`next_split_step` on.

        The split travels in the next ``avg`` frame and in later boards' welcomes. Returns the step
        it takes effect at.

        Raises:
            ExchangeError: the sizes change the global batch or the number of boards, or leave a board empty.
        """
        split = self._checked_split(self.next_split_step, batch_sizes)
        if self._splits and self._splits[-1]["from_step"] == split["from_step"]:
            self._splits.pop()  # announced twice between two steps: the later one wins
        self._splits.append(split)
        self._unsent_split = split
        log.info("exchange: batch sizes %s from step %d", split["batch_sizes"], split["from_step"])
        return int(split["from_step"])

    @property
    def splits(self) -> list[dict[str, Any]]:
        """Every split announced (or restored), in step order, as ``{"from_step", "batch_sizes"}``."""
        return [dict(s) for s in self._splits]

    def splits_from(self, step: int) -> list[dict[str, Any]]:
        """The splits a board starting at ``step`` needs: the one in force then, and any later ones."""
        first = 0
        for i, split in enumerate(self._splits):
            if split["from_step"] <= step:
                first = i
        return [dict(s) for s in self._splits[first:]]

    def batch_sizes_at(self, step: int) -> list[int]:
        """Every board's batch size at ``step``, by board index."""
        sizes = [b.batch_size for b in self._in_order]
        for split in self._splits:
            if split["from_step"] <= step:
                sizes = list(split["batch_sizes"])
        return sizes

    # --- steps ----------------------------------------------------------------------------
    async def _read_grads(self, loop: asyncio.AbstractEventLoop, board: _Board) -> None:
        """Read the board's gradients until its connection ends; raises why it ended.

        Frames are read in event-loop callbacks (``FrameReader``): no task wakes per frame. A kept
        gradient is a view into the reader's buffer until the step is reduced (a board sends its
        next gradient only after it has the result, so the buffer is free again by then).
        """
        assert board.sock is not None
        reader = FrameReader(loop, board.sock, board.buffer, lambda frame: self._on_frame(board, frame),
                             decode=self._hot_grad.decode_any_array, expected_bytes=self._grad_frame_bytes)
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
        if self.param_count > FOLD_MAX_ELEMENTS or not boards or 0 in ns:
            return
        if self._fold_weights[0] != ns:  # the counts rarely change: the weights are made once
            total = sum(ns)
            self._fold_weights = (ns, [np.float32(n / total) for n in ns])
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
            fold.squares.append(self._add_weighted(board.grad, fold.weights[i], first=i == 0))

    def _add_weighted(self, grad: np.ndarray, weight: np.float32, *, first: bool) -> float:
        """``sum (+)= weight * grad`` for a small gradient, the same operations as :meth:`_weighted_sum`; its squared norm."""
        square = _scale_into(self._sum if first else self._scratch, grad, weight)
        if not first:
            self._sum += self._scratch
        return square

    def _accept_grad(self, board: _Board, frame: dict[str, Any]) -> None:
        """Keep a board's gradient for the current step, or flag why not."""
        if frame.get("type") != "grad":
            raise DecodeError(f"expected a grad frame, got {frame.get('type')!r}")
        step = frame.get("step")
        if step != self._step:
            if isinstance(step, int) and self._step is not None and step < self._step:
                board.flags.append(f"step {step}: arrived after the deadline")
                return
            raise DecodeError(f"grad for step {step!r} while the exchange is at step {self._step}")
        board.answered_step = step
        try:
            grad = frame.get("g")
            if not isinstance(grad, np.ndarray):  # a general frame (the fixed layout's arrives as an array)
                grad = decode_array(grad, max_elements=self.param_count)  # type: ignore[arg-type]
            n = frame.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise DecodeError(f"sample count {n!r} is not a positive integer")
            if grad.shape != self._grad_shape or grad.dtype != self._grad_dtype:
                raise DecodeError(f"gradient of shape {grad.shape} and dtype {grad.dtype}, expected "
                                  f"({self.param_count},) {self.wire_dtype}")
            logs = _checked_logs(frame.get("logs"))
        except DecodeError as exc:
            board.refusal = str(exc)
            board.flags.append(f"step {step}: refused ({exc})")
            log.warning("exchange: step %s: refused board %s's gradient: %s", step, board.board_id, exc)
            return
        self.bytes_in += grad.nbytes
        board.grad, board.n, board.logs = grad, n, logs
        loss, compute = frame.get("loss"), frame.get("compute_s")
        board.loss = float(loss) if isinstance(loss, (int, float)) else None
        board.compute_s = float(compute) if isinstance(compute, (int, float)) else None

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

    def _weighted_sum(self, grads: list[tuple[np.ndarray, int]], total: int) -> list[float]:
        """``sum = Σ (n_i / total) g_i`` in board order, in one cache-blocked pass over memory.

        Returns each gradient's squared norm (NaN or Inf anywhere makes it non-finite). Widening
        fp16/bf16 and weighting happen block by block in the scratch buffer: no large temporary.
        Each gradient is scaled by its weight n_i / total as it is added (no separate division
        pass); the result equals Σ n_i g_i / Σ n_i to float32 rounding.
        """
        squares = [0.0] * len(grads)
        weights = [np.float32(n / total) for _, n in grads]
        for start in range(0, self.param_count, REDUCE_BLOCK):
            end = min(start + REDUCE_BLOCK, self.param_count)
            acc, tmp = self._sum[start:end], self._scratch[:end - start]
            for i, (grad, _) in enumerate(grads):
                squares[i] += _scale_into(acc if i == 0 else tmp, grad[start:end], weights[i])
                if i:
                    acc += tmp
        return squares

    def _reduce(self, step: int, started: float) -> tuple[StepResult, np.ndarray]:
        refused: dict[str, str] = {}
        late: list[str] = []
        kept: list[_Board] = []
        for board in self._in_order:  # fixed order: deterministic sums
            if not board.welcomed:
                continue
            if board.grad is not None:
                kept.append(board)
            elif board.answered_step != step:
                late.append(board.board_id)
                board.flags.append(f"step {step}: missed the deadline")
            else:
                refused[board.board_id] = board.refusal
        fold, self._fold = self._fold, None
        folded = (fold is not None and fold.step == step and fold.complete and fold.boards == kept
                  and all(b.n == n for b, n in zip(kept, fold.ns)))
        limit = min(self.max_grad_norm ** 2, sys.float_info.max)  # so that an Inf square is never within it
        while kept:
            total = sum(b.n for b in kept)
            if folded:  # summed as the gradients arrived, with these very weights
                assert fold is not None
                squares, folded = fold.squares, False
            else:
                squares = self._weighted_sum([(b.grad, b.n) for b in kept], total)  # type: ignore[misc]
            if self._buffer_elements:  # the norm check is the gradient's; buffers count only for NaN or Inf
                squares = [square - self._buffer_square(b.grad) for b, square in zip(kept, squares)]
            bad = [(b, q) for b, q in zip(kept, squares) if not q <= limit]  # NaN, Inf or too large
            if not bad:
                break
            for board, square in bad:  # rare: refuse it and sum again without it
                why = "NaN or Inf in the gradient" if not math.isfinite(square) else f"gradient norm {square ** 0.5:.3g} is implausible"
                refused[board.board_id] = why
                board.flags.append(f"step {step}: refused ({why})")
                log.warning("exchange: step %d: refused board %s's gradient: %s", step, board.board_id, why)
                kept.remove(board)
        if kept and self._buffers_from is not None:  # the buffers of the first board that answered, exactly
            start, first = self._buffers_from, kept[0].grad
            assert first is not None
            _scale_into(self._sum[start:], first[start:], np.float32(1.0))
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
        for board in kept:  # one pass: this runs once per step on the exchange's critical path
            n = board.last_n = board.n
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
        self._recent_s.append(wall)
        result = StepResult(step=step, n_total=total, loss=weighted_loss / total, contributors=contributors, late=late,
                            refused=refused, compute_s=compute, wall_s=wall, batch_sizes=sizes,
                            logs={name: s / w for name, (s, w) in logged.items() if math.isfinite(s / w)},
                            log_flags=log_flags)
        return result, self._sum

    def _buffer_square(self, vector: np.ndarray | None) -> float:
        """The squared norm of a board's float buffers (the vector's tail), widened from the wire dtype if need be."""
        assert vector is not None  # a kept board's
        tail = vector[self.param_count - self._buffer_elements:]
        if tail.dtype != np.float32:
            widened = self._scratch[:tail.size]  # free again: the weighted sum is done
            cast_into(widened, tail)
            tail = widened
        return float(np.dot(tail, tail))

    def _to_wire(self, avg: np.ndarray) -> np.ndarray:
        """The average as it travels, and as every replica (the coordinator's too) applies it."""
        if self.wire_dtype == "float32":
            return avg
        cast_into(self._wire_out, avg)
        return self._wire_out

    def wire_to_float32(self, wire: np.ndarray) -> np.ndarray:
        if self.wire_dtype == "float32":
            return wire
        if self._applied is None:
            self._applied = np.zeros(self.param_count, dtype=np.float32)
        cast_into(self._applied, wire)
        return self._applied

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
        deadline = loop.time() + self.deadline_for_next_step(minimum_deadline_s)  # on the loop's clock
        async with self._boundary:
            self._step = step  # gradients that arrived early for this step are already kept
            gathered: asyncio.Future[_Finished] = loop.create_future()
            self._gathering = (step, started, gathered)
            self._start_fold(step)
            timer = loop.call_at(deadline, self._finish_if_ready, True)
            try:
                self._finish_if_ready()
                finished = await gathered
            finally:
                timer.cancel()
                self._gathering = None
            if finished.unsent:  # a large result the send buffers could not take at once
                waiting = [(board, rest) for board, rest in finished.unsent if board.sock is not None]
                failures = await send_rest(loop, [(board.sock, rest) for board, rest in waiting])  # type: ignore[misc]
                for (board, _), failure in zip(waiting, failures):
                    if failure is not None:
                        self._gone(board, f"could not receive the step's result ({failure})")
                    else:
                        self.bytes_out += finished.frame_bytes
            # The replica steps while the boards compute; welcomes wait for it (the lock is held).
            apply(self.wire_to_float32(finished.wire), finished.result)
        return finished.result

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
        wire = self._to_wire(avg)
        values = {"step": step, "n": result.n_total, "boards": len(result.contributors)}
        tensor = self._sum_tensor if wire is self._sum else self._wire_tensor  # fixed arrays: described once
        plain = self._unsent_split is None and self._unsent_lrs is None
        segments = self._hot_avg.encode(values, tensor) if plain else None  # encoded once
        if segments is None:  # a re-split or learning rates travel with it: the general encoder
            frame = {"type": "avg", **values, "g": tensor}
            if self._unsent_split is not None:
                frame["split"], self._unsent_split = self._unsent_split, None
            if self._unsent_lrs is not None:
                frame["lrs"], self._unsent_lrs = self._unsent_lrs, None
            segments = frame_segments(frame)
        self._next_avg_step = step + 1  # from here on, an announced split waits for the next frame
        self._step = step + 1  # a fast board may send the next step's gradient while the others still receive
        frame_bytes = sum(memoryview(segment).nbytes for segment in segments)
        targets = [b for b in self.boards.values() if b.welcomed and b.sock is not None]
        unsent: list[tuple[_Board, list[memoryview]]] = []
        for board, rest in zip(targets, send_now_to_all([b.sock for b in targets], segments)):  # type: ignore[misc]
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
        self._unsent_lrs = [float(lr) for lr in lrs]

    def flags(self) -> dict[str, list[str]]:
        return {b.board_id: list(b.flags) for b in self.boards.values() if b.flags}


__all__ = ["ExchangeError", "ExchangeServer", "StepResult"]
