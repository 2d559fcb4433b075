"""One round per step: open it, take the boards' vectors as they arrive, close it at the last one or
the deadline, and send its result to every board.

:class:`StepRound` owns the time side of a step (the arithmetic is ``coordinator.exchange.step_sum``,
what a vector must be is the mode's, ``coordinator.exchange.modes``):

* the open step and the step boundary: a lock held for the whole of a step, under which a joining
  board's welcome (``coordinator.exchange.admission``) is taken between steps, never inside one; it
  is written outside the lock, and the results of the steps that run until the board has caught up
  wait in its outbox (copies, at most :data:`MAX_OUTBOX_BYTES`), to go after its welcome; the steps
  do not wait for it until then;
* reading: each welcomed board's frames are read in event-loop callbacks (``FrameReader``), no task
  woken per frame. A frame is checked for the open step (:meth:`StepRound.run_step`'s ``step``, or
  the next one: a fast board may send it while the others still receive), kept or refused for
  that step and flagged (a malformed or non-finite field, or a sample count ``n`` other than the one
  the split assigned the board for that step: the mode's ``expected_n``), added to the fold, and the
  step finishes in the callback of the last vector it waited for: no task wakes between the last gradient and the result going out;
* the deadline, :class:`StepDeadline`: five times the recent median step (generous at first),
  counting only time the coordinator ran (a check every :data:`DEADLINE_TICK_S`; a check more
  than :data:`DEADLINE_SLACK_S` late adds the interval since the previous one). When it passes,
  every socket is read once more: a vector already in the kernel's buffer is delivered, not late;
* a stalled board: one that missed :data:`MISSES_TO_DROP` deadlines in a row (:data:`JOIN_MISSES_TO_DROP`
  before it answered in time since it joined) is dropped from the job's steps as a board whose
  connection ended is (named, flagged and logged with why), so the following steps do not wait for
  it; it comes back through the welcome once it is live again;
* the result: encoded once for every board (the fixed layout, or the general encoder when a
  re-split or learning rates travel with it: :class:`ResultRelay`), handed to every socket at
  once; only a result larger than a socket's send buffer waits, after the step is reduced;
* ``apply``: the replica steps after the result is on its way, while the boards compute.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefleet.coordinator.exchange.board_state import BoardState, Roster
from edgefleet.coordinator.exchange.modes import ExchangeMode, StepVector
from edgefleet.coordinator.exchange.step_sum import StepResult, StepSum
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import Avg, BatchSplit, Grad, GradientRefused
from edgefleet.protocol.hot_frames import HotFrame
from edgefleet.protocol.split_schedule import SplitSchedule, split_step
from edgefleet.transport.exchange_io import FrameReader, frame_segments, send_now_to_all, send_rest

log = logging.getLogger(__name__)

FRAME_MARGIN_BYTES = 64 * 1024  # a board's frame may exceed the job's gradient frame by this (its logged values)
DEADLINE_TICK_S = 0.25   # while a step waits, its deadline is checked this often ...
DEADLINE_SLACK_S = 0.1   # ... and a check this late means the process did not run: the interval does not count
MISSES_TO_DROP = 3       # a board that misses this many step deadlines in a row is dropped until it joins again ...
JOIN_MISSES_TO_DROP = 10  # ... before it answered in time since it joined (loading its welcome, starting to train); and
                          # a joining board that has not caught up within this many step deadlines is closed
MAX_OUTBOX_BYTES = 64 * 1024 * 1024  # results waiting to be written to a joining board; more: it cannot keep up


class StepDeadline:
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


class ResultRelay:
    """What travels with the next result besides the average: a re-split of the global batch, the replica's learning rates.

    A split announced now starts at the next ``avg`` frame's step plus ``SPLIT_LEAD_STEPS``
    (``protocol.split_schedule``); the schedule keeps every split for later boards' welcomes.
    """

    __slots__ = ("lrs", "next_avg_step", "schedule", "split")

    def __init__(self, schedule: SplitSchedule) -> None:
        self.schedule = schedule
        self.split: BatchSplit | None = None  # goes out in the next avg frame
        self.lrs: tuple[float, ...] | None = None  # the replica's learning rates, when a ReduceLROnPlateau moved them
        self.next_avg_step: int | None = None    # the step of the next avg frame to be built

    def next_split_step(self, open_step: int | None) -> int:
        """The step a split announced now takes effect at (the next avg frame's step + the lead)."""
        next_avg = self.next_avg_step if self.next_avg_step is not None else open_step
        return split_step(next_avg or 0)

    def announce_split(self, open_step: int | None, batch_sizes: Sequence[int]) -> BatchSplit:
        """Raises SplitRefused: the sizes change the global batch or the number of boards, or leave a board empty."""
        self.split = self.schedule.add(self.next_split_step(open_step), batch_sizes)
        return self.split

    def sent(self, step: int) -> None:
        """The avg frame of ``step`` carries what was announced; a split announced from now on waits for the next."""
        self.split = self.lrs = None
        self.next_avg_step = step + 1


@dataclass(slots=True)
class _Finished:
    """A reduced step whose result is on its way to the boards."""

    result: StepResult
    wire: np.ndarray                                  # the average as it travelled
    vector: StepVector                                # what the step's result carries (the mode's)
    unsent: list[tuple[BoardState, list[memoryview]]]  # boards whose send buffer could not take all of it at once
    frame_bytes: int


class StepRound:
    """Runs the job's steps over the boards of ``roster`` (see the module's docstring)."""

    def __init__(self, roster: Roster, mode: ExchangeMode, relay: ResultRelay, wire_dtype: str) -> None:
        self._roster, self._in_order, self._mode, self._relay = roster, roster.in_order, mode, relay
        self._sum = StepSum(roster.in_order, mode, mode.reducer)
        self._wire_dtype = wire_dtype
        self._hot_grad, self._hot_avg = HotFrame("grad", wire_dtype), HotFrame("avg", wire_dtype)  # fixed layouts
        self.grad_frame_bytes = self._hot_grad.prefix_bytes + mode.param_count * self._hot_grad.itemsize  # a step's gradient frame
        self.max_frame_bytes = self.grad_frame_bytes + FRAME_MARGIN_BYTES  # the largest frame a board may send
        self.catch_up_timeout_s = JOIN_MISSES_TO_DROP * 60.0  # a joining board's longest silence while it catches up
        self.step: int | None = None
        self._gathering: tuple[int, float, asyncio.Future[_Finished]] | None = None  # the open step, its start, its outcome
        self._deadline: StepDeadline | None = None  # the open step's
        self.boundary = asyncio.Lock()   # welcomes are taken between steps, never inside one
        self.joining: list[BoardState] = []  # boards being welcomed or catching up (their outbox collects the results)
        self.recent_s: MutableSequence[float] = deque(maxlen=20)  # the last steps' running times (pauses left out)
        roster.on_leave = self._finish_if_ready

    def deadline_for_next_step(self, minimum_s: float) -> float:
        """The step deadline: generous at first, then five times the recent median step."""
        if len(self.recent_s) < 3:
            return max(minimum_s, 60.0)
        return max(minimum_s, 5 * statistics.median(self.recent_s))

    # --- reading --------------------------------------------------------------------------
    async def read(self, loop: asyncio.AbstractEventLoop, board: BoardState) -> None:
        """Read the board's gradients until its connection ends; raises why it ended.

        A kept gradient is a view into the reader's buffer until the step is reduced (a board sends
        its next gradient only after it has the result, so the buffer is free again by then).
        """
        assert board.sock is not None
        reader = FrameReader(loop, board.sock, board.buffer, lambda frame: self._on_frame(board, frame),
                             decode=self._hot_grad.decode_any_array, expected_bytes=self.grad_frame_bytes,
                             max_bytes=self.max_frame_bytes)
        board.reader = reader
        reader.resume()
        reason = await reader.done
        if board.reader is reader:
            board.reader = None
        raise reason

    def on_frame(self, board: BoardState, frame: dict[str, Any]) -> None:
        """A frame of ``board`` read elsewhere (its last while it caught up, ``coordinator.exchange.admission``)."""
        self._on_frame(board, frame)

    def _on_frame(self, board: BoardState, frame: dict[str, Any]) -> bool:
        """A frame arrived from ``board``: keep it, add it to the sum, finish the step if it was the last; read on."""
        self._accept_grad(board, frame)
        self._sum.arrived(self.step)
        self._finish_if_ready()
        return True

    def _accept_grad(self, board: BoardState, raw: dict[str, Any]) -> None:
        """Keep a board's gradient for the current step, or flag why not.

        Raises:
            DecodeError: not a gradient for this step or an earlier one: the board's stream is broken.
        """
        try:
            frame = Grad.from_wire(raw, elements=self._mode.elements(board, raw), dtype=self._wire_dtype)
            expected = self._mode.expected_n(board, frame.step)
            if frame.n != expected:  # a board may not weigh its vector above (or below) its slice of the batch
                raise GradientRefused(f"board {board.board_id} sent n={frame.n} for step {frame.step}; the split "
                                      f"assigned it n={expected}", step=frame.step)
        except GradientRefused as exc:
            exc = self._mode.refused(board, raw, exc)
            if self._answers_open_step(board, exc.step):
                board.refusal = str(exc)
                board.flags.append(f"step {exc.step}: refused ({exc})")
                log.warning("exchange: step %s: refused board %s's gradient: %s", exc.step, board.board_id, exc)
            return
        if self._answers_open_step(board, frame.step):
            grad = frame.array
            self._mode.kept(board, raw)
            self._mode.vector_kept(board, frame.step, grad)
            self._roster.bytes_in += grad.nbytes
            board.grad, board.n, board.logs = grad, frame.n, frame.logs
            board.loss, board.compute_s = frame.loss, frame.compute_s

    def _answers_open_step(self, board: BoardState, step: int) -> bool:
        """Whether a gradient for ``step`` answers the open step (noted); one that came after its deadline is flagged.

        Raises:
            DecodeError: a step the exchange is not at and has not passed, or one this board sent already.
        """
        if step <= board.sent_step:
            raise DecodeError(f"a second gradient for step {step}")
        board.sent_step = step
        if step != self.step:
            if self.step is not None and step < self.step:
                board.flags.append(f"step {step}: arrived after the deadline")
                return False
            raise DecodeError(f"grad for step {step} while the exchange is at step {self.step}")
        board.answered_step = step
        return True

    def _waiting(self) -> bool:
        """Whether a connected board has not answered the open step yet."""
        step = self.step
        for board in self._in_order:
            if board.welcomed and board.answered_step != step:
                return True
        return False

    # --- the step -------------------------------------------------------------------------
    async def run_step(self, step: int, *, apply: Callable[[np.ndarray, StepResult], None],
                       minimum_deadline_s: float = 10.0) -> StepResult:
        """Gather, reduce, return the result to every board, and let ``apply`` update the replica.

        The step is reduced and its result sent as soon as it can be: in the reader callback of
        the last gradient, at the deadline, or when the last pending board leaves. ``apply`` runs
        after the result is on its way, while the boards compute the next step.

        Raises:
            ExchangeError: no board is left, or none contributed.
        """
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        span_s = self.deadline_for_next_step(minimum_deadline_s)
        self.catch_up_timeout_s = JOIN_MISSES_TO_DROP * span_s
        async with self.boundary:
            self.step = step  # gradients that arrived early for this step are already kept
            gathered: asyncio.Future[_Finished] = loop.create_future()
            self._gathering = (step, started, gathered)
            self._sum.start(step)
            self._deadline = deadline = StepDeadline(loop, span_s, self._deadline_passed)
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
                        self._roster.gone(board, f"could not receive the step's result ({failure})")
                    else:
                        self._roster.bytes_out += finished.frame_bytes
            # The replica steps while the boards compute; welcomes wait for it (the lock is held).
            apply(finished.vector.to_float32(finished.wire), finished.result)
        return finished.result

    def _deadline_passed(self) -> None:
        """The open step's time is up: first read what waits in the kernel's buffers (delivered, not late), then reduce."""
        step = self.step
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

    def _drop_if_stalled(self, board: BoardState, step: int) -> None:
        """Drop ``board`` from the job's steps once it missed :data:`MISSES_TO_DROP` deadlines in a row (up to ``step``).

        A stopped worker (SIGSTOP, swapping, a hung SD card) would otherwise make every step wait out
        its deadline for ever. The board leaves as a board whose connection ended does (its
        connection closed, the steps no longer wait for it, the rest of the fleet goes on) and comes
        back the same way: when it is live again its worker finds the connection closed and ends,
        and the board joins again with the replica's state at a step boundary.
        """
        missed = board.missed_in_row
        if missed < (MISSES_TO_DROP if board.answered_step >= board.joined_step else JOIN_MISSES_TO_DROP):
            return
        self._roster.gone(board, f"dropped from the job's steps: it missed {missed} step deadlines in a row (steps "
                                 f"{step - missed + 1} to {step}); its worker may be stopped, swapping or hung. The "
                                 "fleet goes on without it; it joins again at a step boundary once it is live")

    def _queue_for_joining(self, segments: list[bytes | memoryview], frame_bytes: int) -> None:
        """Keep a copy of the step's result for every joining board (written to it after its welcome, as it catches up).

        A board whose outbox would pass :data:`MAX_OUTBOX_BYTES` cannot keep up with the fleet over its link: dropped.
        """
        frame = b"".join(segments)  # the segments are views of buffers the next step reuses
        for board in list(self.joining):
            if board.outbox is None:
                continue
            waiting = sum(len(f) for f in board.outbox)
            if waiting + frame_bytes > MAX_OUTBOX_BYTES:
                self._roster.gone(board, f"its link cannot keep up with the fleet: {len(board.outbox)} results "
                                         f"({waiting} bytes) waited for it while its welcome was written")
                continue
            board.outbox.append(frame)

    def _answer(self, step: int, vector: StepVector, result: StepResult, relay: ResultRelay) -> list[bytes | memoryview]:
        """The step's result frame carrying ``vector`` (a later pipeline group's own average), with whatever the main
        frame carries beside it (a re-split, the learning rates)."""
        vector.to_wire()  # fills the array its tensor describes
        if relay.split is None and relay.lrs is None:
            hot = Avg.encode_hot(self._hot_avg, step=step, n=result.n_total, boards=len(result.contributors),
                                 tensor=vector.tensor)
            if hot is not None:
                return hot
        return frame_segments(Avg(step=step, n=result.n_total, boards=len(result.contributors), g=vector.tensor,
                                  split=relay.split, lrs=relay.lrs).to_wire())

    def _finish_step(self, step: int, started: float) -> _Finished:
        """Reduce ``step``, encode the result once, and hand it to every board's socket."""
        result = self._sum.reduce(step, started)
        self.recent_s.append(result.wall_s - (self._deadline.paused_s if self._deadline is not None else 0.0))
        for board_id in result.late:  # usually none: nothing is looked at
            self._drop_if_stalled(self._roster.by_id[board_id], step)
        vector = self._mode.vector(step)
        wire, relay = vector.to_wire(), self._relay
        segments = None  # encoded once, for every board
        if relay.split is None and relay.lrs is None:
            segments = Avg.encode_hot(self._hot_avg, step=step, n=result.n_total, boards=len(result.contributors),
                                      tensor=vector.tensor)
        if segments is None:  # a re-split or learning rates travel with it: the general encoder
            frame = Avg(step=step, n=result.n_total, boards=len(result.contributors), g=vector.tensor, split=relay.split,
                        lrs=relay.lrs)
            segments = frame_segments(frame.to_wire())
        groups = [(self._answer(step, other, result, relay), indices) for other, indices in self._mode.answers(step) or ()]
        relay.sent(step)  # from here on, an announced split waits for the next frame
        self.step = step + 1  # a fast board may send the next step's gradient while the others still receive
        frame_bytes = sum(memoryview(segment).nbytes for segment in segments)
        if self.joining:  # usually none
            self._queue_for_joining(segments, frame_bytes)
        targets = [b for b in self._in_order if b.welcomed and b.sock is not None]
        unsent: list[tuple[BoardState, list[memoryview]]] = []
        sends = [(targets, segments, frame_bytes)]
        for parts, indices in groups:  # usually none: a pipeline's later groups each get their own stage's average
            sends.append(([b for b in targets if b.index in indices], parts,
                          sum(memoryview(segment).nbytes for segment in parts)))
            sends[0] = ([b for b in sends[0][0] if b.index not in indices], segments, frame_bytes)
        for boards, parts, nbytes in sends:
            sent = 0
            for board, rest in zip(boards, send_now_to_all([b.sock for b in boards if b.sock is not None], parts)):
                if isinstance(rest, OSError):
                    self._roster.gone(board, f"could not receive the step's result ({rest})")
                elif rest:
                    unsent.append((board, rest))
                else:
                    sent += 1
            self._roster.bytes_out += sent * nbytes
        return _Finished(result=result, wire=wire, vector=vector, unsent=unsent, frame_bytes=frame_bytes)


__all__ = ["DEADLINE_SLACK_S", "DEADLINE_TICK_S", "FRAME_MARGIN_BYTES", "JOIN_MISSES_TO_DROP", "MAX_OUTBOX_BYTES",
           "MISSES_TO_DROP", "ResultRelay", "StepDeadline", "StepRound"]
