"""The exchange's modes: one interface that every variant of "what a step exchanges" implements.

The server and the step round (``coordinator.exchange.step_round``) run every job the same way:
open a step, read one vector per board, reduce, send one result. What differs between the variants
is a handful of questions, and :class:`ExchangeMode` is where they are answered, once per variant
(as a DDP communication hook is one signature for every way of reducing a bucket):

* :meth:`~ExchangeMode.kind`: what step ``s`` averages: gradients (``exact``), nothing (``local``)
  or parameters (``sync``), as ``protocol.sync_schedule`` names them; it goes into the step's record;
* :meth:`~ExchangeMode.elements`: how many values a board's vector for a grad frame's step holds;
* :meth:`~ExchangeMode.expected_n`: the sample count a board's grad frame for step ``s`` must carry,
  from the job's split schedule (a frame with another ``n`` is refused for that step: a board with
  valid keys cannot weigh its vector above its slice of the batch);
* :meth:`~ExchangeMode.refused`: how a vector refused by the frame's decoder is described;
* :meth:`~ExchangeMode.kept`: a kept gradient frame arrived (a mode's own per-board counters);
* :meth:`~ExchangeMode.vector_kept`: a kept vector, decoded, for the audits (``coordinator.audit``), and
  again if the reduce refuses it (its norm): a mode whose vectors are not one batch's gradient (periodic
  averaging's local and sync steps) keeps them out;
* :meth:`~ExchangeMode.folds`: whether step ``s`` may be summed as its gradients arrive;
* :meth:`~ExchangeMode.reduce`: how the step's vectors (board order) are reduced into the reducer's sum;
* :meth:`~ExchangeMode.counts`: which sample count each board's contribution counts for;
* :meth:`~ExchangeMode.vector`: what the step's result carries (:class:`StepVector`: as it travels,
  described once, and widened for the replica);
* :meth:`~ExchangeMode.welcome`: what the welcome says about the mode.

The implementations:

* :class:`DenseExact`: every step averages the boards' mean gradients, sample-weighted, in board
  order (``coordinator.exchange.gradient_reduce``), into the full vector both ways. Folding is allowed.
* :class:`OverlapStream` (``--overlap``): the same reduce; the boards stream their vector (in reversed
  parameter order) while backward runs, so a frame's bytes arrive over a longer time. The welcome
  says so (``overlap``), and a streamed frame (its ``compute_s`` after the tensor) is counted for
  the run's record (:meth:`ExchangeMode.kept`).
* :class:`RobustAggregate` (``--aggregate trimmed-mean|median|clip``, ``coordinator.exchange.robust_reduce``):
  every step reduces the boards' gradients by a rule that bounds what one board can do to it, not by
  their mean: opt-in and inexact, for local data, where the boards cannot be audited. The reducer's
  refusals and buffers stand; only the gradient's part of the sum is replaced. No folding.
* :class:`PeriodicAveraging` (local SGD, ``protocol.sync_schedule`` with ``every`` > 1): an exact
  step is :class:`DenseExact`'s; at a local step every vector is empty both ways and nothing is
  reduced; at a sync step each vector is the board's parameter delta since the last average,
  weighted by its samples since then (the frame's ``n``: its batch sizes summed over the steps since
  the last average, or since it joined if that was later), judged by the outlier band on plain
  norms; the step's record counts each board's batch at that step (the split's). A vector of the
  wrong length for its step's kind is refused naming the board, the step and what it takes.

* :class:`PipelineStages` (``ExchangeServer``'s ``pipeline``, issue 35): each board trains one stage of a
  pipeline with its own optimizer, and its vector is its stage's gradient over the whole batch
  (``coordinator.exchange.pipeline_layout``). Every stage must answer; the vectors are scattered
  into the replica's full vector (no averaging), the boards get stage 0's average and the replica the
  full vector (:class:`PipelineVector`). The audits do not see the vectors (none is a whole-model gradient).
  With the layout's ``sync`` sparse (``protocol.stage_sync``) a later stage's vector is empty at most
  steps, and at a state step its gradient followed by its parameters and optimizer state, which the
  mode keeps for the replica (:meth:`PipelineStages.take_states`).

Buffer sync (``broadcast``: the first kept vector's float buffers, DDP's rule; ``average``: their
sample-weighted average) is not a mode: it is how any mode's reduce treats the vector's tail, and a
job combines it with each of the modes above. It is fixed where the reducer is made
(:class:`~edgefleet.coordinator.exchange.gradient_reduce.GradientReducer`'s ``buffer_sync``), and
nothing else looks at it.

Adding a mode (layer placement, pipeline stages): subclass :class:`ExchangeMode` here and answer
the questions above for it (override the defaults that do not hold: e.g. a board holding only some
layers answers :meth:`~ExchangeMode.elements` by the board, and a stage's reduce sums only the
boards of that stage); then let :func:`select_mode` choose it from a new keyword of
``ExchangeServer`` (the only place a mode is chosen). The server, the admission and the step round
do not change: they ask, and never test which mode they run.

Every method runs on the exchange's critical path (``elements`` and ``kept`` once per frame, the
rest once per step): no allocation beyond what the answer is, no lookups that can be made once.
"""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edgefleet.coordinator.exchange.board_state import BoardState, ExchangeError
from edgefleet.coordinator.exchange.gradient_reduce import GradientReducer, Reduced, refusal_reason
from edgefleet.coordinator.exchange.pipeline_layout import PipelineLayout
from edgefleet.coordinator.exchange.robust_reduce import aggregate as robust_aggregate
from edgefleet.coordinator.exchange.robust_reduce import stacked
from edgefleet.protocol.aggregates import AGGREGATES
from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.exchange_frames import GradientRefused, Welcome
from edgefleet.protocol.half_cast import cast_into
from edgefleet.protocol.split_schedule import SplitSchedule
from edgefleet.protocol.stage_sync import NOTHING, STATE
from edgefleet.protocol.sync_schedule import EXACT, LOCAL, SYNC, StepKind, SyncSchedule
from edgefleet.protocol.wire_dtype import numpy_dtype


class StepVector:
    """What a step's result carries: the reducer's sum, as it travels (the wire dtype) and as the replica applies it.

    ``tensor`` describes the wire array once (a fixed array: the same description every step).
    """

    __slots__ = ("_reducer", "tensor")

    def __init__(self, reducer: GradientReducer) -> None:
        self._reducer = reducer
        self.tensor: dict[str, Any] = encode_array(reducer.to_wire(reducer.sum))  # the wire array is fixed: described once

    def to_wire(self) -> np.ndarray:
        """The step's sum in the wire dtype (the reducer's own arrays; cast once per step for fp16/bf16)."""
        return self._reducer.to_wire(self._reducer.sum)

    def to_float32(self, wire: np.ndarray) -> np.ndarray:
        """The result as it travelled, widened to float32 for the replica."""
        return self._reducer.wire_to_float32(wire)


class EmptyVector(StepVector):
    """A step that averages nothing (a local step): an empty vector both ways."""

    __slots__ = ("_empty32", "_empty_wire")

    def __init__(self, wire_dtype: str) -> None:  # no reducer: nothing of it travels
        self._empty_wire = np.zeros(0, dtype=numpy_dtype(wire_dtype))  # as it travels ...
        self._empty32 = np.zeros(0, dtype=np.float32)                 # ... and as the replica takes it
        self.tensor = encode_array(self._empty_wire)

    def to_wire(self) -> np.ndarray:
        return self._empty_wire

    def to_float32(self, wire: np.ndarray) -> np.ndarray:
        return self._empty32


class ExchangeMode(ABC):
    """What one exchange variant decides (see the module's docstring); the defaults are :class:`DenseExact`'s.

    Args:
        reducer: the job's reducer (its vector length, wire dtype, checks and buffers' rule).
        schedule: the job's batch splits (each board's batch size at each step, re-splits included).
        accumulate: the job's ``accumulate_grad_batches``: an exact step's frame counts that many batches.
    """

    def __init__(self, reducer: GradientReducer, schedule: SplitSchedule, *, accumulate: int = 1) -> None:
        if accumulate < 1:
            raise ExchangeError(f"accumulate_grad_batches {accumulate} is not a positive number of batches")
        self.reducer = reducer
        self.param_count = reducer.param_count
        self._full = StepVector(reducer)
        self._schedule, self._accumulate = schedule, accumulate
        self.audit_tap: Callable[[str, int, np.ndarray, bool], None] | None = None  # the run's auditor (``Auditor.tap``)

    @abstractmethod
    def kind(self, step: int) -> StepKind:
        """What ``step`` averages: gradients (exact), nothing (local) or parameters (sync)."""

    def elements(self, board: BoardState, frame: dict[str, Any]) -> int:
        """How many values ``board``'s vector in grad ``frame`` (as received, not checked yet) must hold."""
        return self.param_count

    def hello_param_count(self, board: BoardState) -> int:
        """The ``param_count`` ``board``'s hello must give (its model's size as the board built it)."""
        return self.param_count

    def expected_n(self, board: BoardState, step: int) -> int:
        """The sample count ``board``'s grad frame for ``step`` must carry: its batch at that step (the split's)
        times the job's ``accumulate_grad_batches``, as the boards compute it (``agent.worker_exchange``)."""
        return self._schedule.batch_size_at(step, board.index) * self._accumulate

    def refused(self, board: BoardState, frame: dict[str, Any], exc: GradientRefused) -> GradientRefused:
        """The refusal of ``board``'s grad ``frame`` for its step, as the board's flag and the log say it."""
        return exc

    def kept(self, board: BoardState, frame: dict[str, Any]) -> None:
        """``board``'s grad ``frame`` answers the open step and is kept (a mode's per-board counters)."""
        return None  # nothing to count by default

    def vector_kept(self, board: BoardState, step: int, vector: np.ndarray, *, refused: bool = False) -> None:
        """``board``'s ``vector`` for ``step`` is kept, or (``refused``) the reduce refused it: the auditor sees it
        (it copies those it audits, and every refused one)."""
        tap = self.audit_tap
        if tap is not None:
            tap(board.board_id, step, vector, refused)

    def folds(self, step: int) -> bool:
        """Whether ``step``'s vectors may be summed as they arrive (``add_weighted``, board order)."""
        return True

    def reduce(self, step: int, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None,
               boards: Sequence[BoardState] = ()) -> Reduced:
        """Reduce ``step``'s (vector, n) pairs, in board order, into the reducer's sum; which are kept, which refused.

        ``squares``: their squared norms when the fold already summed every one (None: sum them here). ``boards``:
        the board of each pair (a mode whose vectors differ by board reads it; the others need not).
        """
        return self.reducer.reduce(grads, squares)

    def counts(self, step: int) -> list[int] | None:
        """Each board's sample count in ``step``'s record, by board index; None: the count its frame says
        (which is then also the count its next step's fold assumes)."""
        return None

    def vector(self, step: int) -> StepVector:
        """What ``step``'s result carries."""
        return self._full

    def answers(self, step: int) -> list[tuple[StepVector, tuple[int, ...]]] | None:
        """Boards (by index) whose result carries another vector than :meth:`vector`'s, with it; None: none."""
        return None

    def welcome(self, welcome: Welcome, board: BoardState | None = None) -> Welcome:
        """The welcome ``board`` gets as it joins, with what it must know about the mode."""
        return welcome


class DenseExact(ExchangeMode):
    """Every step: the boards' mean gradients, sample-weighted, the full vector both ways (DDP's mathematics)."""

    def kind(self, step: int) -> StepKind:
        return EXACT


class OverlapStream(DenseExact):
    """``--overlap``: the vectors are streamed during backward (reversed parameter order); the reduce is exact."""

    def kept(self, board: BoardState, frame: dict[str, Any]) -> None:
        if next(reversed(frame)) == "compute_s":  # decoders keep the order: a streamed frame's is last
            board.streamed += 1

    def welcome(self, welcome: Welcome, board: BoardState | None = None) -> Welcome:
        return dataclasses.replace(welcome, overlap=True)


class RobustAggregate(DenseExact):
    """``--aggregate``: every step's gradient is the kept vectors' robust aggregate (``robust_reduce``), not their mean.

    Args:
        reducer: the job's reducer (its refusals, and the buffers of the result, stand).
        schedule: the job's batch splits.
        rule: ``trimmed-mean``, ``median`` or ``clip``.
    """

    def __init__(self, reducer: GradientReducer, schedule: SplitSchedule, rule: str, *, accumulate: int = 1) -> None:
        if rule not in AGGREGATES or rule == "mean":
            raise ExchangeError(f"aggregate {rule!r} is not one of {', '.join(AGGREGATES[1:])}")
        super().__init__(reducer, schedule, accumulate=accumulate)
        self.rule = rule
        self._grad_elements = reducer.param_count - reducer.buffer_elements

    def folds(self, step: int) -> bool:
        return False  # the rule needs every vector at once

    def reduce(self, step: int, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None,
               boards: Sequence[BoardState] = ()) -> Reduced:
        outcome = self.reducer.reduce(grads, None)  # NaN, Inf, the band; the result's buffers
        if len(outcome.kept) >= 2:
            kept = [grads[i] for i in outcome.kept]
            rows = stacked([vector for vector, _ in kept], self._grad_elements)
            robust_aggregate(self.rule, rows, [n for _, n in kept], self.reducer.sum[:self._grad_elements])
        return outcome


class PeriodicAveraging(ExchangeMode):
    """Local SGD (``protocol.sync_schedule``): exact steps, then local steps (empty vectors) and sync steps
    (parameter deltas, weighted by the samples since the last average).

    Args:
        reducer: the job's reducer.
        sync: the schedule (``every`` > 1).
        schedule: the job's batch splits: a sync step's record counts each board's batch at that step.
        accumulate: the job's ``accumulate_grad_batches`` (an exact step's count; local and sync steps count batches).
    """

    def __init__(self, reducer: GradientReducer, sync: SyncSchedule, schedule: SplitSchedule, *,
                 accumulate: int = 1) -> None:
        super().__init__(reducer, schedule, accumulate=accumulate)
        self._sync = sync
        self._empty = EmptyVector(reducer.wire_dtype)
        self._kind_of: tuple[int, StepKind] = (-1, EXACT)  # the last step asked about: a step asks several times

    def kind(self, step: int) -> StepKind:
        known, kind = self._kind_of
        if step != known:
            kind = self._sync.kind(step)
            self._kind_of = (step, kind)
        return kind

    def elements(self, board: BoardState, frame: dict[str, Any]) -> int:
        step = frame.get("step") if type(frame) is dict else None  # a local step's vector is empty
        return 0 if type(step) is int and self.kind(step) == LOCAL else self.param_count

    def expected_n(self, board: BoardState, step: int) -> int:
        """An exact step's count is :class:`DenseExact`'s; a local step's, the board's batch at that step; a sync
        step's, the samples since the last average (``agent.local_sgd.ParameterAnchor``): its batches summed over
        the steps after the last exact or sync step, up to and including ``step``, from the step it joined at if
        that is later (its anchor is taken at its first local step)."""
        kind = self.kind(step)
        if kind == EXACT:
            return super().expected_n(board, step)
        if kind == LOCAL:
            return self._schedule.batch_size_at(step, board.index)
        first = step
        while first > board.joined_step and first > 0 and self._sync.kind(first - 1) == LOCAL:
            first -= 1
        schedule, i = self._schedule, board.index
        return sum(schedule.batch_size_at(s, i) for s in range(first, step + 1))

    def refused(self, board: BoardState, frame: dict[str, Any], exc: GradientRefused) -> GradientRefused:
        """A vector of the wrong length says which vector a step of periodic averaging takes, naming the board and the step."""
        if _vector_length(frame) in (None, self.elements(board, frame)):
            return exc
        kind = self.kind(exc.step)
        if kind == LOCAL:
            expected = "an empty vector: it is a local step of periodic averaging (--sync-every)"
        else:
            expected = f"the full vector of {self.param_count} values: it is {'an' if kind == EXACT else 'a'} {kind} step"
        return GradientRefused(f"board {board.board_id} sent a vector of the wrong size for step {exc.step}, which "
                               f"takes {expected} ({exc})", step=exc.step)

    def vector_kept(self, board: BoardState, step: int, vector: np.ndarray, *, refused: bool = False) -> None:
        if self.kind(step) == EXACT:  # a local step's vector is empty, a sync step's a parameter delta
            super().vector_kept(board, step, vector, refused=refused)

    def folds(self, step: int) -> bool:
        return self.kind(step) == EXACT  # a sync step's weights are the samples since the last average

    def reduce(self, step: int, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None,
               boards: Sequence[BoardState] = ()) -> Reduced:
        kind = self.kind(step)
        if kind == LOCAL:  # nothing to average: every board that answered took its own step
            return Reduced(list(range(len(grads))), [])
        # a sync step's vectors are parameter deltas, weighted by the samples since the last average
        return self.reducer.reduce(grads, squares, scale_by_samples=kind == EXACT)

    def counts(self, step: int) -> list[int] | None:
        # the frame's n is the weight (samples since the last average); this step's batch is the split's
        return self._schedule.batch_sizes_at(step) if self.kind(step) == SYNC else None

    def vector(self, step: int) -> StepVector:
        return self._empty if self.kind(step) == LOCAL else self._full


class PipelineVector(StepVector):
    """A pipeline step's result: on the wire, one stage's averaged gradient (stage 0's, which its boards step on and
    a later stage of one board ignores, keeping its own; or a later group's, which its boards step on), and for the
    replica (which trains the whole model) the reducer's full float32 sum."""

    __slots__ = ("_runs", "_wire")

    def __init__(self, reducer: GradientReducer, stage0: Sequence[tuple[int, int, int]], elements: int) -> None:
        self._reducer = reducer
        self._runs = list(stage0)
        self._wire = np.zeros(elements, dtype=numpy_dtype(reducer.wire_dtype))
        self.tensor = encode_array(self._wire)  # a fixed array: described once

    def to_wire(self) -> np.ndarray:
        total = self._reducer.sum
        for src, dst, count in self._runs:  # stage 0's values of the full sum, in stage 0's vector order
            cast_into(self._wire[src:src + count], total[dst:dst + count])
        return self._wire

    def to_float32(self, wire: np.ndarray) -> np.ndarray:
        return self._reducer.sum  # not what travelled: the replica takes every stage's gradient


class PipelineStages(ExchangeMode):
    """Pipeline stages (issue 35): stage 0's boards (the layout's ``group``) train stage 0 data-parallel, each on its
    slice; every later board trains one stage over the whole batch, or a later stage's group over the units each of its
    boards runs (``protocol.stage_routes``), averaged by samples as stage 0's (and answered to its boards).

    Stage 0's vectors are averaged, sample-weighted, into stage 0's slots of the replica's vector (and
    go back to stage 0's boards as the step's result); every later stage's vector is scattered into its
    slots (``layout``); values no stage covers stay 0. A step needs every board's vector: one missing
    or refused makes the step refuse every vector (the replica cannot take a model's gradient with a
    stage, or part of stage 0's batch, left out).

    Args:
        reducer: the job's reducer, made for the replica's vector (``layout.full_elements``, no buffers).
        schedule: the job's batch splits: the global batch on stage 0's board, 0 on the others.
        layout: each board's vector length and slots.
        boards: the job's boards in board order (the roster's: the reduce names the stages that did not answer).

    Raises:
        ExchangeError: the reducer, the batch sizes or the boards do not match the layout.
    """

    def __init__(self, reducer: GradientReducer, schedule: SplitSchedule, layout: PipelineLayout,
                 boards: Sequence[BoardState]) -> None:
        super().__init__(reducer, schedule)
        if reducer.param_count != layout.full_elements or reducer.buffer_elements:
            raise ExchangeError(f"a pipelined job's vector is the replica's {layout.full_elements} trainable parameters "
                                f"without buffers, not {reducer.param_count} values with {reducer.buffer_elements} of "
                                "buffers: pass param_count=layout.full_elements and no buffers")
        layout.check_batch_sizes(schedule.initial)
        if len(boards) != layout.boards:
            raise ExchangeError(f"the pipeline layout has {layout.boards} boards, the job {len(boards)}")
        self.layout = layout
        self._sync = layout.sync if layout.sync is not None and layout.sync.sparse else None
        # the later stages of one board: with a sparse sync, their state at checkpoints (a later group's gradient
        # goes every step, averaged as stage 0's)
        self._own = [b for b in range(layout.group, layout.boards) if not layout.averaged(b)]
        if self._sync is not None and self._own:  # a state step's frame: the stage's gradient, parameters and optimizer state
            self.param_count = max(self.param_count, *(layout.max_state_elements(b) for b in self._own))
        self._states: dict[int, tuple[int, np.ndarray]] = {}  # board index -> (step, a state step's state), copied
        # The run's cut of a welcome to a board's own stage (its weights and optimizer state): a board holds no other
        # stage's (``coordinator.pipeline.piped_run.PipedRun.stage_welcome``); None: the whole state
        self.trim: Callable[[int, Welcome], Welcome] | None = None
        self._boards = list(boards)
        self._pipeline_vector = PipelineVector(reducer, layout.slots[0], layout.elements[0])
        # each later group's answer: its average, in its boards' vector order (the other boards get stage 0's)
        self._group_vectors: list[tuple[StepVector, tuple[int, ...]]] = []
        for k in range(1, len(layout.sizes)):
            if layout.sizes[k] > 1:
                first = layout.stage_boards(k)[0]
                self._group_vectors.append((PipelineVector(reducer, layout.slots[first], layout.elements[first]),
                                            tuple(layout.stage_boards(k))))
        # an averaged vector widened, before its weight
        self._scratch = np.zeros(max(layout.elements[b] for b in range(layout.boards) if layout.averaged(b)),
                                 dtype=np.float32)
        self._counts = list(schedule.initial)  # stage 0's boards their slices, the later stages' boards 0

    def kind(self, step: int) -> StepKind:
        return EXACT

    def elements(self, board: BoardState, frame: dict[str, Any]) -> int:
        own = self.layout.elements[board.index]
        sync, step = self._sync, frame.get("step") if isinstance(frame, dict) else None
        if sync is None or self.layout.averaged(board.index) or type(step) is not int:
            return own
        kind = sync.kind(step)
        if kind == NOTHING:
            return 0
        if kind == STATE:  # the gradient, then the parameters and optimizer state: their length is the board's layout's
            length = _vector_length(frame)
            if length is not None and 2 * own <= length <= self.layout.max_state_elements(board.index):
                return length
            return 2 * own
        return own

    def hello_param_count(self, board: BoardState) -> int:
        return self.layout.elements[board.index]

    def expected_n(self, board: BoardState, step: int) -> int:
        if board.index < self.layout.group:
            return super().expected_n(board, step)  # stage 0's board: its slice
        if self.layout.rows:  # a later stage's board: the samples of the units it runs (the whole batch, alone)
            return self.layout.rows[board.index]
        return self.layout.global_batch

    def refused(self, board: BoardState, frame: dict[str, Any], exc: GradientRefused) -> GradientRefused:
        """A vector of the wrong length says what the board's stage takes."""
        if _vector_length(frame) in (None, self.elements(board, frame)):
            return exc
        what = f"{self.elements(board, frame)} values"
        if self._sync is not None and not self.layout.averaged(board.index) and type(exc.step) is int:
            what = {NOTHING: "no values at this step (its state goes at checkpoints)",
                    STATE: f"its gradient, parameters and optimizer state at this step (at least "
                           f"{2 * self.layout.elements[board.index]} values)"}.get(self._sync.kind(exc.step), what)
        return GradientRefused(f"board {board.board_id} sent a vector of the wrong size for step {exc.step}: its "
                               f"pipeline stage {board.index} takes {what} ({exc})", step=exc.step)

    def vector_kept(self, board: BoardState, step: int, vector: np.ndarray, *, refused: bool = False) -> None:
        return None  # a stage's vector is not a whole-model gradient: nothing to audit

    def folds(self, step: int) -> bool:
        return False

    def reduce(self, step: int, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None,
               boards: Sequence[BoardState] = ()) -> Reduced:
        """Scatter each stage's vector into the reducer's zeroed sum; refuse a non-finite or implausible one, and
        every one when a stage's vector is missing or refused."""
        total, slots = self.reducer.sum, self.layout.slots
        total.fill(0.0)
        limit = min(self.reducer.max_grad_norm ** 2, sys.float_info.max)  # so that an Inf square is never within it
        refused: list[tuple[int, str]] = []
        present: set[int] = set()
        if len(boards) != len(grads):
            raise ExchangeError(f"step {step}: a pipelined step's reduce needs each vector's board")
        layout = self.layout
        totals: dict[int, int] = {}  # an averaged stage's samples this step (stage 0's: the global batch)
        for (_, n), b in zip(grads, boards):
            if layout.averaged(b.index):
                stage = layout.stage_of(b.index)
                totals[stage] = totals.get(stage, 0) + n
        scratch = self._scratch
        for i, ((vector, n), board) in enumerate(zip(grads, boards)):
            square = 0.0
            averaged = layout.averaged(board.index)
            if not averaged and self._sync is not None:
                kind = self._sync.kind(step)
                if kind == NOTHING:  # nothing from this stage's board this step: it trained, the replica waits for its state
                    present.add(board.index)
                    continue
                if kind == STATE:
                    own = self.layout.elements[board.index]
                    self._states[board.index] = (step, np.array(vector[own:], dtype=np.float32))
            weight = np.float32(n / max(totals.get(layout.stage_of(board.index), 0), 1)) if averaged else None
            for src, dst, count in slots[board.index]:
                if weight is not None:  # a board of a group: its share of the average (its samples of the step)
                    part = scratch[src:src + count]
                    cast_into(part, vector[src:src + count])
                    square += float(np.dot(part, part))
                    total[dst:dst + count] += part * weight
                else:
                    part = total[dst:dst + count]
                    cast_into(part, vector[src:src + count])
                    square += float(np.dot(part, part))
            why = refusal_reason(square, limit)
            if why is not None:
                refused.append((i, why))
            else:
                present.add(board.index)
        missing = [b for b in self._boards if b.index not in present]
        if not missing:
            return Reduced(list(range(len(grads))), [])
        lacking = ", ".join(f"stage {b.index} (board {b.board_id})" for b in missing)
        why_all = f"step {step} lacks the gradient of {lacking}: a pipeline step needs every stage's"
        taken = {i for i, _ in refused}
        return Reduced([], refused + [(i, why_all) for i in range(len(grads)) if i not in taken])

    def counts(self, step: int) -> list[int] | None:
        return self._counts  # the batch once (stage 0's slices): every stage's vector is over the same samples

    def vector(self, step: int) -> StepVector:
        return self._pipeline_vector

    def answers(self, step: int) -> list[tuple[StepVector, tuple[int, ...]]] | None:
        """Each later group's boards their group's average (the other boards :meth:`vector`'s, stage 0's)."""
        return self._group_vectors or None

    def welcome(self, welcome: Welcome, board: BoardState | None = None) -> Welcome:
        return welcome if self.trim is None or board is None else self.trim(board.index, welcome)

    def take_states(self, step: int) -> dict[int, np.ndarray]:
        """The later stages' parameters and optimizer state their boards sent with ``step`` (a state step), by stage
        (1 to S-1); each is handed out once. Empty at other steps."""
        stage_of = {b: self.layout.stage_of(b) for b in self._own}
        taken = {stage_of[b]: state for b, (at, state) in self._states.items() if at == step}
        self._states = {b: kept for b, kept in self._states.items() if kept[0] > step}
        return taken


def select_mode(reducer: GradientReducer, schedule: SplitSchedule, *, sync: SyncSchedule | None = None,
                overlap: bool = False, accumulate: int = 1, aggregate: str = "mean",
                pipeline: PipelineLayout | None = None, boards: Sequence[BoardState] = ()) -> ExchangeMode:
    """The mode a job's settings ask for: pipeline stages (``pipeline``, with the job's ``boards`` in board order),
    periodic averaging (``sync`` with ``every`` > 1), overlap, a robust aggregate (``aggregate`` other than
    ``mean``), or dense exact.

    Raises:
        ExchangeError: both periodic averaging and overlap (overlap streams every step's gradient;
            a local step has none), a robust aggregate with either, a pipeline with any of them or with
            ``accumulate`` above 1, a pipeline that does not match the job, or ``accumulate`` below 1.
    """
    if pipeline is not None:
        others = [what for what, used in (("--sync-every", sync is not None and sync.periodic), ("--overlap", overlap),
                                          (f"--aggregate {aggregate}", aggregate != "mean"),
                                          (f"--accumulate-grad-batches {accumulate}", accumulate != 1)) if used]
        if others:
            raise ExchangeError(f"a pipelined job exchanges each stage's gradient of every step; it cannot be combined "
                                f"with {', '.join(others)}: leave {'them' if len(others) > 1 else 'it'} out")
        return PipelineStages(reducer, schedule, pipeline, boards)
    if aggregate != "mean":
        if (sync is not None and sync.periodic) or overlap:
            raise ExchangeError(f"--aggregate {aggregate} reduces each step's gradients; it cannot be combined with "
                                "--sync-every or --overlap")
        return RobustAggregate(reducer, schedule, aggregate, accumulate=accumulate)
    if sync is not None and sync.periodic:
        if overlap:
            raise ExchangeError("overlap streams every step's gradient, and periodic averaging's local steps send none: "
                                "choose one of them")
        return PeriodicAveraging(reducer, sync, schedule, accumulate=accumulate)
    if overlap:
        return OverlapStream(reducer, schedule, accumulate=accumulate)
    return DenseExact(reducer, schedule, accumulate=accumulate)


def _vector_length(frame: Any) -> int | None:
    """How many values a grad frame's vector holds, if it says so plainly (a decoded array or a flat tensor map)."""
    g = frame.get("g") if type(frame) is dict else None
    if isinstance(g, np.ndarray):
        return int(g.size)
    shape = g.get("shape") if isinstance(g, dict) else None
    return shape[0] if isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int else None


__all__ = ["DenseExact", "EmptyVector", "ExchangeMode", "OverlapStream", "PeriodicAveraging", "PipelineStages",
           "PipelineVector", "RobustAggregate", "StepVector", "select_mode"]
