"""When each board is audited: at least once every ``every`` steps, at steps no board can predict.

Each board's next audit is drawn (``secrets``: the operating system's generator, not the run's
seeded ones) uniformly from the ``every`` steps after its last one, when that one's vector is copied
(in the exchange's thread, ahead of the replica, which may trail by a few steps). Nothing about the
draw leaves the coordinator, so a board that lies at any step risks being recomputed at it, and one
that lies at ``m`` steps escapes with probability at most ``(1 - 1/every)**m``.

``every`` is fitted to the cost: an audit computes one board's slice again on the coordinator.
A board's audits lie 1 to ``every`` steps apart, uniformly, so ``(every + 1) / 2`` on average: with
``b`` boards that is ``2 b / (every + 1)`` audits a step (not ``b / every``: that counted each gap as
the longest, and the audits took up to twice the share). After each audit :meth:`AuditSchedule.fit`
takes the median audit's CPU time ``a`` (the coordinator process's, torch's threads included) and
the median step period ``p`` (the last :data:`WINDOW` of each) and sets
``every = ceil(2 b a / (share p) - 1)`` (at least 1), so that audits take at most ``share`` of one
of the coordinator's cores on average.
"""

from __future__ import annotations

import logging
import math
import secrets
import statistics
from collections import deque

log = logging.getLogger(__name__)

START_EVERY = 4  # before the first audit has been timed
WINDOW = 20      # audit times and step periods the fit takes the median of


class AuditSchedule:
    """Which boards are audited at which step.

    Args:
        boards: The run's boards.
        share: The share of the coordinator's time audits may take, in (0, 1].
        start_step: The run's first step (a resumed run's).
        every: A fixed ``every`` instead of the fitted one (tests, ``--audit-every``); None: fitted.
    """

    def __init__(self, boards: list[str], *, share: float, start_step: int, every: int | None = None) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"audit share {share} is not in (0, 1]")
        self.share, self.fixed = share, every
        self.every = every or START_EVERY
        self._boards = len(boards)
        self._next = {board: start_step - 1 + self._draw() for board in boards}  # within the first `every` steps
        self._audit_s: deque[float] = deque(maxlen=WINDOW)
        self._period_s: deque[float] = deque(maxlen=WINDOW)

    def _draw(self) -> int:
        """Steps to the next audit: 1 to ``every``, uniformly, from the operating system's generator."""
        return 1 + secrets.randbelow(self.every)

    def due(self, board: str, step: int) -> bool:
        """Whether ``board``'s vector for ``step`` is to be computed again (a board that missed its step: the next one)."""
        due = self._next.get(board)
        return due is not None and due <= step

    def done(self, board: str, step: int) -> None:
        """``board`` was audited at ``step`` (or had nothing to audit there): draw its next audit."""
        self._next[board] = step + self._draw()

    def fit(self, audit_s: float | None, period_s: float | None) -> None:
        """Take an audit's time and a step's period (either may be None) and fit ``every`` to the share."""
        if audit_s is not None:
            self._audit_s.append(audit_s)
        if period_s is not None and period_s > 0:
            self._period_s.append(period_s)
        if self.fixed is not None or not self._audit_s or not self._period_s:
            return
        cost = self._boards * statistics.median(self._audit_s)  # CPU seconds were every board audited at every step
        every = max(1, math.ceil(2 * cost / (self.share * statistics.median(self._period_s)) - 1))
        if every != self.every:
            log.debug("audits: each board once every %d steps at most (was %d)", every, self.every)
            self.every = every


__all__ = ["START_EVERY", "WINDOW", "AuditSchedule"]
