"""One step's sum: folding gradients as they arrive, the reduce at the end, and the step's record.

:class:`StepSum` owns the arithmetic side of a step (the time side is ``coordinator.exchange.step_round``):

* the fold: when the mode allows it (:meth:`~edgefleet.coordinator.exchange.modes.ExchangeMode.folds`)
  and the vectors are small (up to ``gradient_reduce.FOLD_MAX_ELEMENTS``), each board's vector is
  added to the sum as it arrives, in board order (a later board waits for an earlier one), with
  the weights of every board's count at its last contribution. If a board answers with another
  count, is refused or is missing, the fold stops and the step is summed in full at the end; a
  complete fold gives the same bits as the full sum (``GradientReducer.add_weighted``);
* the reduce: which boards answered, were late (each board's count of deadlines missed in a row,
  ``BoardState.missed_in_row``, for the step round to drop a stalled board) or were refused, the
  mode's reduce of the answered vectors in board order (so the result does not depend on arrival
  order), the refusals it adds;
* the step's record, :class:`StepResult`: contributors, sample counts (the mode's
  :meth:`~edgefleet.coordinator.exchange.modes.ExchangeMode.counts`), the sample-weighted loss and
  logged values, each board's compute time, and the step's kind.

It reads the boards' kept gradients (``BoardState.grad``, views into their read buffers) and clears
them once the step is reduced. It opens no socket and reads no clock but the step's wall time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from edgefleet.coordinator.exchange.board_state import BoardState, ExchangeError
from edgefleet.coordinator.exchange.gradient_reduce import FOLD_MAX_ELEMENTS, GradientReducer, Reduced, sample_weights
from edgefleet.coordinator.exchange.modes import ExchangeMode
from edgefleet.coordinator.exchange.overflow_watch import OverflowWatch
from edgefleet.protocol.sync_schedule import EXACT, StepKind

log = logging.getLogger(__name__)


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
    overflowed: list[str] = field(default_factory=list)  # 16-mixed: contributors whose gradient overflowed (step skipped)


@dataclass(slots=True)
class _Fold:
    """The open step's average, summed in board order as gradients arrive (small gradients only).

    Weights come from each board's sample count at its last contribution; if a board answers with
    another count, is refused or is missing, the fold stops and the step is summed in full at the end.
    """

    step: int
    boards: list[BoardState]      # welcomed at the step's start, in board order
    ns: list[int]                 # the sample counts the weights assume
    weights: list[np.float32]
    squares: list[float] = field(default_factory=list)  # of the gradients summed so far

    @property
    def complete(self) -> bool:
        return len(self.squares) == len(self.boards)


class StepSum:
    """Sums a step's vectors from the boards in ``in_order`` with ``mode``'s reduce, into ``reducer``'s sum."""

    def __init__(self, in_order: list[BoardState], mode: ExchangeMode, reducer: GradientReducer) -> None:
        self._in_order, self._mode, self._reducer = in_order, mode, reducer
        self._foldable = reducer.param_count <= FOLD_MAX_ELEMENTS
        self._overflows = OverflowWatch() if reducer.loss_scaled else None
        self._fold: _Fold | None = None
        self._fold_weights: tuple[list[int], list[np.float32]] = ([], [])  # the last fold's counts and weights

    def start(self, step: int) -> None:
        """Sum ``step``'s gradients as they arrive, when they are small and every board's count is known."""
        self._fold = None
        boards = [b for b in self._in_order if b.welcomed]
        ns = [b.last_n for b in boards]
        if not self._foldable or not boards or 0 in ns or not self._mode.folds(step):
            return
        if self._fold_weights[0] != ns:  # the counts rarely change: the weights are made once
            self._fold_weights = (ns, sample_weights(ns))
        self._fold = _Fold(step, boards, ns, self._fold_weights[1])
        self.arrived(step)  # gradients that came early

    def arrived(self, open_step: int | None) -> None:
        """Add the gradients that arrived, as far as board order allows (a later board waits for an earlier one).

        Called for every frame: without an open fold for ``open_step`` it returns at once."""
        fold = self._fold
        if fold is None or fold.step != open_step:
            return
        while not fold.complete:
            i = len(fold.squares)
            board = fold.boards[i]
            if board.grad is None or board.n != fold.ns[i]:
                return  # not here yet, refused, or another count: summed in full at the end if need be
            fold.squares.append(self._reducer.add_weighted(board.grad, fold.weights[i], first=i == 0))

    def reduce(self, step: int, started: float) -> StepResult:
        """Reduce ``step`` into the reducer's sum (``started``: its monotonic start); the step's record.

        Raises:
            ExchangeError: no board contributed a usable vector.
        """
        mode = self._mode
        refused: dict[str, str] = {}
        late: list[str] = []
        answered: list[BoardState] = []
        for board in self._in_order:  # fixed order: deterministic sums
            if not board.welcomed:
                continue
            if board.grad is not None:
                answered.append(board)
                board.missed_in_row = 0
            elif board.answered_step != step:
                late.append(board.board_id)
                board.missed_in_row += 1
                board.flags.append(f"step {step}: missed the deadline")
            else:
                refused[board.board_id] = board.refusal
                board.missed_in_row = 0
        fold, self._fold = self._fold, None
        folded = (fold is not None and fold.step == step and fold.complete and fold.boards == answered
                  and all(b.n == n for b, n in zip(answered, fold.ns)))
        grads = [(b.grad, b.n) for b in answered if b.grad is not None]
        outcome = mode.reduce(step, grads, fold.squares if folded and fold is not None else None, answered)
        if len(outcome.overflowed) == 1 and len(outcome.kept) > 1 and self._overflows is not None:
            outcome = self._lone_overflow(step, outcome, answered, grads)
        for i, why in outcome.refused:  # rare: NaN, Inf or an implausible norm
            board = answered[i]
            if board.grad is not None:  # the audits check it: a liar must not hide behind a refusal
                mode.vector_kept(board, step, board.grad, refused=True)
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
        step_sizes = mode.counts(step)
        for board in kept:  # one pass: this runs once per step on the exchange's critical path
            if step_sizes is None:
                n = board.last_n = board.n
            else:  # the mode's count for this step (periodic averaging's sync step: the split's batch)
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
        return StepResult(step=step, n_total=total, loss=weighted_loss / total, contributors=contributors, late=late,
                          refused=refused, compute_s=compute, wall_s=time.monotonic() - started, batch_sizes=sizes,
                          logs={name: s / w for name, (s, w) in logged.items() if math.isfinite(s / w)},
                          log_flags=log_flags, kind=mode.kind(step),
                          overflowed=[answered[i].board_id for i in outcome.overflowed])

    def _lone_overflow(self, step: int, outcome: Reduced, answered: list[BoardState],
                       grads: list[tuple[np.ndarray, int]]) -> Reduced:
        """One board's gradient alone overflowed: the step is skipped, or (:class:`OverflowWatch`) that gradient refused."""
        assert self._overflows is not None
        lone = outcome.overflowed[0]
        why = self._overflows.lone(answered[lone].board_id, step)
        if why is None:
            return outcome
        others = [i for i in range(len(grads)) if i != lone]
        again = self._mode.reduce(step, [grads[i] for i in others], None, [answered[i] for i in others])
        return Reduced([others[i] for i in again.kept], [*[(others[i], w) for i, w in again.refused], (lone, why)],
                       tuple(others[i] for i in again.overflowed))


__all__ = ["StepResult", "StepSum"]
