"""Audits by recomputation: a board's vector for a step, compared with the one its slice gives on the coordinator.

Two threads take part:

* the exchange's (the event loop): :meth:`Auditor.tap` sees every vector the exchange keeps for a
  step (``ExchangeMode.vector_kept``) and copies those of the boards due for an audit at that step
  (``coordinator.audit.schedule``, whose next audit of the board it draws there and then), with every
  board's batch size at that step; and it copies every
  vector the reduce refuses (an implausible norm), due or not: such a refusal is rare, and a board
  that lied at a step no audit drew must not escape by lying louder afterwards;
* the replica's Trainer: :meth:`Auditor.check` runs before the step's average is applied, computes
  each copied board's vector again (``coordinator.audit.recompute``) and compares the two.

A vector passes when its gradient, and its float buffers, are within :func:`tolerance` of the
recomputed ones (relative L2 distance), and its integer buffers are the same bytes. Honest boards
differ from the coordinator by the order their CPUs sum in (about 1e-6 relative in float32; the
cast to float16 or bfloat16 on the wire adds its rounding). A vector that does not pass is an
:class:`AuditFailure`: the run (``coordinator.run.training``) leaves the board out and rolls back
(``coordinator.audit.rollback``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgefleet.coordinator.audit.recompute import AuditData, recompute_vector
from edgefleet.coordinator.audit.schedule import AuditSchedule

log = logging.getLogger(__name__)

RTOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}  # relative L2 an honest board's vector stays within
# An audit recomputes with one torch thread. With more, OpenMP's idle workers spin after every parallel region, on a
# coordinator whose cores the boards' processes (or the lab's) already share: on the lab, audits at 0.25 of a core
# by the fit's own CPU count cost the coordinator 0.5 of a core in all. One thread is the cheapest per audit and
# keeps the CPU the fit counts the CPU the audits take.
AUDIT_THREADS = 1
ATOL_PER_ELEMENT = 1e-7  # an all-but-zero gradient: the distance allowed is this times sqrt(elements) at least


def tolerance(wire_dtype: str) -> float:
    """The relative L2 distance an honest board's vector stays within, for vectors sent as ``wire_dtype``."""
    return RTOL.get(wire_dtype, RTOL["bfloat16"])


@dataclass(frozen=True)
class AuditFailure:
    """A board's vector for a step is not what its slice gives.

    Attributes:
        board_id: The board.
        step: The step it sent the vector for.
        part: ``gradient``, ``buffers`` or ``integer buffers``: what differs.
        distance: The relative L2 distance of that part (inf for integer buffers).
        scale: The sent gradient's norm over the recomputed one's.
    """

    board_id: str
    step: int
    part: str
    distance: float
    scale: float

    def describe(self) -> str:
        if self.part == "integer buffers":
            return f"board {self.board_id} failed its audit at step {self.step}: its integer buffers differ from those its slice gives"
        return (f"board {self.board_id} failed its audit at step {self.step}: its {self.part} differs from the one its slice "
                f"of the batch gives on the coordinator by {_figure(self.distance)} (relative L2; its gradient's norm is "
                f"{_figure(self.scale)}x the recomputed one's)")


def _figure(x: float) -> str:
    """``2,000``, ``1.5``, ``0.00312``: a ratio as a person reads it."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _distance(sent: np.ndarray, ref: np.ndarray) -> tuple[float, bool]:
    """Relative L2 distance of ``sent`` from ``ref``, and whether it is beyond the absolute floor.

    A ``ref`` that is not finite (the model diverged on every board alike) judges nothing: (0, False); a
    ``sent`` that is not finite where ``ref`` is: (inf, True)."""
    if not np.isfinite(ref).all():
        return 0.0, False
    if not np.isfinite(sent).all():
        return float("inf"), True
    diff = float(np.linalg.norm(sent.astype(np.float64) - ref.astype(np.float64)))
    norm = float(np.linalg.norm(ref.astype(np.float64)))
    floor = ATOL_PER_ELEMENT * np.sqrt(max(ref.size, 1))
    return (diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))), diff > floor


class Auditor:
    """Audits one run's boards (see the module's docstring).

    Args:
        boards: The run's boards, in board order (a board's index is its place here).
        data: The run's training data and its division.
        schedule: When each board is audited.
        wire_dtype: The vectors' dtype on the wire (the tolerance).
        grad_elements: Where the gradient ends and the buffers begin in a vector.
        float_buffer_elements: How many of the buffers' elements are float values (the rest: integer bytes).
        sizes_at: Every board's batch size at a step (the exchange's split schedule).
    """

    def __init__(self, boards: list[str], data: AuditData, schedule: AuditSchedule, *, wire_dtype: str,
                 grad_elements: int, float_buffer_elements: int, sizes_at: Callable[[int], list[int]]) -> None:
        self.boards, self.data, self.schedule = list(boards), data, schedule
        self._index = {board: i for i, board in enumerate(boards)}
        self.rtol = tolerance(wire_dtype)
        self._grad_elements, self._float_end = grad_elements, grad_elements + float_buffer_elements
        self._sizes_at = sizes_at
        self._ints_exact = wire_dtype == "float32"  # integer buffers travel as bytes: a narrower wire rounds them
        self._lock = threading.Lock()
        self._copies: dict[int, dict[str, np.ndarray]] = {}  # step -> board -> its vector (float32 copy)
        self._sizes: dict[int, list[int]] = {}
        self.failures: list[AuditFailure] = []
        self.audits: dict[str, int] = dict.fromkeys(boards, 0)  # passed audits per board
        self.audit_s = 0.0  # CPU time spent recomputing (this process's, all its threads)
        self.disabled = ""  # why audits stopped: the module could not be stepped again here (no board is blamed)

    # ------------------------------------------------------------------------ the exchange's thread
    def tap(self, board_id: str, step: int, vector: np.ndarray, refused: bool = False) -> None:
        """The exchange keeps ``board_id``'s ``vector`` for ``step`` (or refused it): copy it if the board is due for
        an audit, or if it was refused."""
        due = self.schedule.due(board_id, step)
        if not refused and not due:
            return
        if due:  # the next audit is drawn now, not when the replica checks this one: it may trail by a few steps, and
            self.schedule.done(board_id, step)  # until it checks, every step of the board would come up as due
        copy = np.array(vector, dtype=np.float32, copy=True)
        with self._lock:
            self._copies.setdefault(step, {})[board_id] = copy
            if step not in self._sizes:
                self._sizes[step] = list(self._sizes_at(step))

    # ------------------------------------------------------------------------ the replica's thread
    def check(self, step: int, model: Any, exchanged: list[torch.nn.Parameter], boards: list[str],
              period_s: float | None = None) -> None:
        """Before ``step``'s average is applied: audit the copied vectors of ``boards`` (the step's contributors and
        the boards whose vector the reduce refused).

        ``period_s`` is the step's wall time as the exchange saw it (``StepResult.wall_s``), which the schedule's fit
        takes as the step period. Not the time between two calls here: the replica may trail the exchange by a few
        steps and then works through the queued ones back to back, so that gap shrinks after every audit, and a fit
        on it chose ever more audits (0.55 of a core where 0.25 was asked)."""
        with self._lock:
            copies = self._copies.pop(step, {})
            sizes = self._sizes.pop(step, None)
            for stale in [s for s in self._copies if s < step]:  # steps that ended without an average
                del self._copies[stale]
                self._sizes.pop(stale, None)
        threads = torch.get_num_threads()
        if threads != AUDIT_THREADS and any(board in copies for board in boards):
            torch.set_num_threads(AUDIT_THREADS)  # this thread's only (torch's count is per thread): see AUDIT_THREADS
        try:
            audit_s = self._check_boards(step, model, exchanged, boards, copies, sizes)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.schedule.fit(audit_s, period_s)

    def _check_boards(self, step: int, model: Any, exchanged: list[torch.nn.Parameter], boards: list[str],
                      copies: dict[str, np.ndarray], sizes: list[int] | None) -> float | None:
        """Recompute and compare each of ``boards``' copied vectors; the longest recomputation's CPU time (or None)."""
        audit_s: float | None = None
        for board in boards:
            sent = copies.get(board)
            if sent is None or sizes is None or self.disabled:
                continue
            started = time.process_time()  # the process's CPU: torch's own threads count too
            try:
                ref = recompute_vector(model, exchanged, self.data, step=step, board_index=self._index[board],
                                       batch_sizes=sizes)
            except Exception as exc:  # the user's module outside its board's loop: stop auditing, blame no board
                self.disabled = (f"audits stopped at step {step}: computing board {board}'s gradient again here failed "
                                 f"({type(exc).__name__}: {exc})")
                log.warning("%s", self.disabled, exc_info=True)
                break
            spent = time.process_time() - started
            self.audit_s += spent
            audit_s = spent if audit_s is None else max(audit_s, spent)
            failure = self._compare(board, step, sent, ref)
            if failure is None:
                self.audits[board] += 1
                log.debug("audit: board %s's vector for step %d matches (%.1f ms)", board, step, spent * 1e3)
            else:
                log.warning("audit: %s", failure.describe())
                self.failures.append(failure)
        return audit_s

    def _compare(self, board: str, step: int, sent: np.ndarray, ref: np.ndarray) -> AuditFailure | None:
        g, f = self._grad_elements, self._float_end
        distance, beyond = _distance(sent[:g], ref[:g])
        ref_norm = float(np.linalg.norm(ref[:g]))
        scale = float(np.linalg.norm(sent[:g])) / ref_norm if ref_norm > 0 else float("inf")
        if beyond and distance > self.rtol:
            return AuditFailure(board, step, "gradient", distance, scale)
        if f > g:
            distance, beyond = _distance(sent[g:f], ref[g:f])
            if beyond and distance > self.rtol:
                return AuditFailure(board, step, "buffers", distance, scale)
        if self._ints_exact and sent.size > f and sent[f:].view(np.uint32).tobytes() != ref[f:].view(np.uint32).tobytes():
            return AuditFailure(board, step, "integer buffers", float("inf"), scale)
        return None

    def take_failures(self) -> list[AuditFailure]:
        """The failures found so far (each once)."""
        failures, self.failures = self.failures, []
        return failures

    def describe(self) -> str:
        """The run's note about audits."""
        fixed = (f"at a random step within every {self.schedule.fixed}" if self.schedule.fixed else
                 f"at random steps, as often as {self.schedule.share:.0%} of a core of this machine allows")
        return (f"audits: each board's gradient is computed again here from its slice of the batch {fixed}; a board whose "
                "gradient differs is left out and the run starts again from step 0 without it")


__all__ = ["ATOL_PER_ELEMENT", "AUDIT_THREADS", "RTOL", "AuditFailure", "Auditor", "tolerance"]
