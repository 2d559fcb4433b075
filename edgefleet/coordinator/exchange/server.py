"""The exchange server: one TCP connection per board, one synchronous reduce per step.

Per step every participating board sends its mean gradient g_i over b_i samples; the server
computes g = sum(b_i g_i) / sum(b_i) in board order (so the result does not depend on arrival
order), lets the coordinator's replica apply it, and returns it to every connected board. A board
that misses the step's deadline is left out of that step and flagged; it receives the step's
result like everyone else, so its replica stays identical, and it is back at the next step. One
that misses :data:`MISSES_TO_DROP` deadlines in a row (a stopped worker) is dropped as a board whose
connection ended is, naming it and why; it comes back by joining again. A
gradient of the wrong shape or dtype, or with NaN/Inf, is refused for that step and flagged, and so
is one whose sample count ``n`` is not what the split assigned the board for that step (times the
job's ``accumulate_grad_batches``; the mode says which count: ``ExchangeMode.expected_n``), or whose
loss or ``compute_s`` is not a finite number in range (``protocol.exchange_frames.Grad.from_wire``).

:class:`ExchangeServer` is the public face (what ``coordinator.run.training``, the tests and the
benchmarks use) and composes the exchange's parts, each with one contract:

* ``coordinator.exchange.admission``: the listening socket and its accept loop, each connection's
  TLS, hello, credential and welcome, intruders;
* ``coordinator.exchange.board_state``: the per-board record and the roster (leaving, failing, waiting
  for boards, flags, byte counters);
* ``coordinator.exchange.step_round``: a step's time: open it, take vectors as they arrive, the
  deadline with pause compensation, send the result, relay re-splits and learning rates;
* ``coordinator.exchange.step_sum``: a step's arithmetic: the fold as vectors arrive, the reduce,
  the step's record (:class:`StepResult`);
* ``coordinator.exchange.modes``: what a step exchanges (dense exact, overlap, periodic averaging),
  the one place a job's mode is chosen and answered for; the server never branches on it;
* ``coordinator.exchange.gradient_reduce``: the arithmetic of the reduce (numpy in, numpy out).
  The frames are ``protocol.exchange_frames`` (a board of another protocol version is refused and
  reported for that board), the batch splits in force are ``protocol.split_schedule``.

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
the board and the step, like any malformed gradient (``coordinator.exchange.modes.PeriodicAveraging``).

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
import ssl
from collections.abc import Callable, Coroutine, MutableSequence, Sequence
from typing import Any

import numpy as np

from edgefleet.coordinator.blas_threads import one_blas_thread
from edgefleet.coordinator.exchange.admission import HELLO_TIMEOUT_S, MAX_HELLO_BYTES, Admission, Listener
from edgefleet.coordinator.exchange.board_state import BoardState, ExchangeError, Roster
from edgefleet.coordinator.exchange.gradient_reduce import OUTLIER_RATIO, GradientReducer
from edgefleet.coordinator.exchange.modes import ExchangeMode, select_mode
from edgefleet.coordinator.exchange.pipeline_layout import PipelineLayout
from edgefleet.coordinator.exchange.step_round import (
    DEADLINE_SLACK_S,
    DEADLINE_TICK_S,
    FRAME_MARGIN_BYTES,
    MISSES_TO_DROP,
    ResultRelay,
    StepDeadline,
    StepRound,
)
from edgefleet.coordinator.exchange.step_sum import StepResult
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.protocol.exchange_frames import BatchSplit, Stop
from edgefleet.protocol.split_schedule import SPLIT_LEAD_STEPS, SplitRefused, SplitSchedule
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.transport.exchange_io import async_send_frame

STOP_TIMEOUT_S = 5.0  # telling one board to stop


class ExchangeServer:
    """Serves one job.

    Args:
        job_id, token: a board must present both to join.
        boards: (board_id, batch_size) by board index.
        param_count: length of the flat gradient vector.
        wire_dtype: float32, float16 or bfloat16 on the wire, both ways.
        welcome_state: returns (next step, model state tree, optimizer state tree) for a joining board, as copies:
            it is called at a step boundary, and the welcome is written while the steps go on.
        welcome_extra: returns more fields of the welcome (``schedulers``: the LR schedulers' states), copies as well.
        buffer_elements: The last ``buffer_elements`` of every vector are the model's buffers
            (BatchNorm's running statistics), not a gradient.
        int_buffer_elements: The last ``int_buffer_elements`` of those are its integer buffers' bytes
            (``num_batches_tracked``): always the first contributing board's, whatever ``buffer_sync`` says.
        buffer_sync: ``broadcast``: the result carries the first contributing board's buffers (DDP's
            rule: rank 0's buffers at every forward); ``average``: their sample-weighted average.
        splits: re-splits already in force or announced (``BatchSplit``),
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
            ``sync`` and ``overlap`` choose the mode (``coordinator.exchange.modes.select_mode``).
        accumulate_grad_batches: the job's; a board's sample count at an exact step is its batch (the split's)
            times this. A grad frame whose ``n`` is not the one the mode expects for that board and step
            (``ExchangeMode.expected_n``) is refused for that step and flagged.
        aggregate: ``mean`` (exact), or a robust rule (``coordinator.exchange.robust_reduce``: ``trimmed-mean``,
            ``median``, ``clip``) that bounds what one board can do to a step, inexactly.
        loss_scaled: the boards scale their losses (16-mixed): a board's overflowed gradient skips the step on every
            replica instead of being refused (``GradientReducer``); a board that alone overflows again and again is
            refused (``coordinator.exchange.step_sum``).
        pipeline: a pipelined job's layout (``coordinator.exchange.pipeline_layout``): board ``i`` trains stage ``i``
            and sends its stage's gradient (its hello's ``param_count`` is that stage's), scattered into the
            replica's vector of ``param_count`` (the layout's ``full_elements``, no buffers); the boards get an
            empty result, ``apply`` the full vector (``coordinator.exchange.modes.PipelineStages``).

    Raises:
        ExchangeError: ``splits`` out of order or not the global batch, or both periodic ``sync`` and ``overlap``,
            or ``accumulate_grad_batches`` below 1, or a ``pipeline`` that does not match the job or is combined
            with periodic ``sync``, ``overlap``, a robust ``aggregate`` or gradient accumulation.
        ValueError: the buffers or the wire dtype out of range (``GradientReducer``).
    """

    def __init__(self, *, job_id: str, token: str, boards: list[tuple[str, int]], param_count: int, wire_dtype: str,
                 welcome_state: Callable[[], tuple[int, Any, Any]], max_grad_norm: float = 1e6,
                 splits: Sequence[BatchSplit] = (),
                 welcome_extra: Callable[[], dict[str, Any]] | None = None,
                 buffer_elements: int = 0, buffer_sync: str = "broadcast", hello_timeout_s: float = HELLO_TIMEOUT_S,
                 outlier_ratio: float = OUTLIER_RATIO, tls: ssl.SSLContext | None = None,
                 checker: HelloChecker | None = None, sync: SyncSchedule | None = None, overlap: bool = False,
                 int_buffer_elements: int = 0, accumulate_grad_batches: int = 1, aggregate: str = "mean",
                 loss_scaled: bool = False, pipeline: PipelineLayout | None = None) -> None:
        self.job_id, self.wire_dtype, self.param_count = job_id, wire_dtype, param_count
        one_blas_thread()  # the norm check's np.dot every step: spinning BLAS threads cost far more than the work
        self._reducer = GradientReducer(param_count, wire_dtype=wire_dtype, max_grad_norm=max_grad_norm,
                                        buffer_elements=buffer_elements, buffer_sync=buffer_sync,
                                        outlier_ratio=outlier_ratio, int_buffer_elements=int_buffer_elements,
                                        loss_scaled=loss_scaled)
        try:
            schedule = SplitSchedule([b for _, b in boards], splits)
        except SplitRefused as exc:
            raise ExchangeError(str(exc)) from None
        self._roster = Roster(boards)
        self.boards: dict[str, BoardState] = self._roster.by_id
        self._relay = ResultRelay(schedule)
        self.mode: ExchangeMode = select_mode(self._reducer, schedule, sync=sync, overlap=overlap,
                                              accumulate=accumulate_grad_batches, aggregate=aggregate,
                                              pipeline=pipeline, boards=self._roster.in_order)
        self._steps = StepRound(self._roster, self.mode, self._relay, wire_dtype)
        self._admission = Admission(job_id=job_id, token=token, param_count=param_count, wire_dtype=wire_dtype,
                                    roster=self._roster, steps=self._steps, mode=self.mode, relay=self._relay,
                                    welcome_state=welcome_state, welcome_extra=welcome_extra,
                                    hello_timeout_s=hello_timeout_s, tls=tls, checker=checker)
        self._listener = Listener()

    @property
    def max_grad_norm(self) -> float:
        return self._reducer.max_grad_norm

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0).

        Raises:
            ExchangeError: the address cannot be bound, with the fix.
        """
        return self._listener.start(host, port, self._admission.serve)

    async def close(self, reason: str = "job finished") -> None:
        """Tell every board to stop, then close everything."""
        loop = asyncio.get_running_loop()
        stop = Stop(reason).to_wire()
        for board in self._roster.in_order:
            if board.sock is not None and board.welcomed:
                try:
                    await asyncio.wait_for(async_send_frame(loop, board.sock, stop), STOP_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError):
                    pass
        await self._listener.cancel()
        for board in self._roster.in_order:
            self._roster.disconnect(board)
        self._listener.close()

    @property
    def finished(self) -> bool:
        """Set by the driver after the last step: boards closing their connection then are not flagged."""
        return self._roster.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._roster.finished = value

    @property
    def bytes_in(self) -> int:
        return self._roster.bytes_in

    @property
    def bytes_out(self) -> int:
        return self._roster.bytes_out

    # --- boards ---------------------------------------------------------------------------
    @property
    def connected(self) -> list[str]:
        return self._roster.connected

    def fail(self, board_id: str, reason: str) -> None:
        """Mark a board as failed from outside (its agent reported that the job failed)."""
        self._roster.fail(board_id, reason)

    async def wait_for_boards(self, timeout_s: float, *, need: set[str]) -> None:
        """Wait until every board in ``need`` joined.

        Raises:
            ExchangeError: a board failed or was refused, or time ran out, naming the boards and why.
        """
        await self._roster.wait_for_boards(timeout_s, need=need)

    def flags(self) -> dict[str, list[str]]:
        return self._roster.flags()

    def streamed_steps(self) -> dict[str, int]:
        """How many of each board's kept gradients it sent during backward (``--overlap``; a board that cannot
        stream, e.g. with gradient accumulation, sends after backward: its count stays 0)."""
        return self._roster.streamed_steps()

    # --- re-splitting the global batch, learning rates ------------------------------------
    @property
    def next_split_step(self) -> int:
        """The step a split announced now takes effect at (the next avg frame's step + the lead)."""
        return self._relay.next_split_step(self._steps.step)

    def announce_split(self, batch_sizes: Sequence[int]) -> int:
        """Re-divide the global batch among the boards (by board index) from :attr:`next_split_step` on.

        The split travels in the next ``avg`` frame and in later boards' welcomes. Returns the step
        it takes effect at.

        Raises:
            ExchangeError: the sizes change the global batch or the number of boards, or leave a board empty.
        """
        try:
            return self._relay.announce_split(self._steps.step, batch_sizes).from_step
        except SplitRefused as exc:
            raise ExchangeError(str(exc)) from None

    def announce_lrs(self, lrs: Sequence[float]) -> None:
        """Send the replica's learning rates (one per param group) with the next result: every board sets them
        before that step's update (a ReduceLROnPlateau decides on the coordinator, where its metric is)."""
        self._relay.lrs = tuple(float(lr) for lr in lrs)

    @property
    def splits(self) -> list[BatchSplit]:
        """Every split announced (or restored), in step order."""
        return self._relay.schedule.splits

    def splits_from(self, step: int) -> list[BatchSplit]:
        """The splits a board starting at ``step`` needs: the one in force then, and any later ones."""
        return self._relay.schedule.splits_from(step)

    def batch_sizes_at(self, step: int) -> list[int]:
        """Every board's batch size at ``step``, by board index."""
        return self._relay.schedule.batch_sizes_at(step)

    # --- steps ----------------------------------------------------------------------------
    def run_step(self, step: int, *, apply: Callable[[np.ndarray, StepResult], None],
                 minimum_deadline_s: float = 10.0) -> Coroutine[Any, Any, StepResult]:
        """Gather, reduce, return the average to every board, and let ``apply`` update the replica.

        The step is reduced and its result sent as soon as it can be: in the reader callback of
        the last gradient (no task wakes between the last gradient and the result going out), at
        the deadline, or when the last pending board leaves. ``apply`` runs after the result is on
        its way, while the boards compute the next step.

        The step round's own coroutine, to be awaited (no second coroutine per step in between).

        Raises:
            ExchangeError: no board is left, or none contributed.
        """
        return self._steps.run_step(step, apply=apply, minimum_deadline_s=minimum_deadline_s)

    def deadline_for_next_step(self, minimum_s: float) -> float:
        """The step deadline: generous at first, then five times the recent median step."""
        return self._steps.deadline_for_next_step(minimum_s)

    @property
    def _recent_s(self) -> MutableSequence[float]:
        """The last steps' running times (pauses left out), for the deadline (tests set them)."""
        return self._steps.recent_s

    @_recent_s.setter
    def _recent_s(self, value: MutableSequence[float]) -> None:
        self._steps.recent_s = value

    def wire_to_float32(self, wire: np.ndarray) -> np.ndarray:
        """A result as it travelled, widened to float32 for the replica."""
        return self._reducer.wire_to_float32(wire)


__all__ = ["DEADLINE_SLACK_S", "DEADLINE_TICK_S", "FRAME_MARGIN_BYTES", "HELLO_TIMEOUT_S", "MAX_HELLO_BYTES",
           "MISSES_TO_DROP", "SPLIT_LEAD_STEPS", "STOP_TIMEOUT_S", "ExchangeError", "ExchangeServer", "StepDeadline", "StepResult"]
