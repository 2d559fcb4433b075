"""16-mixed: a board whose gradient alone overflows again and again is refused, not obeyed.

Under DDP's rule (``workloads.loss_scaling``) one board's overflowed gradient skips the step on
every board and halves the fleet's loss scale. Honest boards overflow alone only while the scale
settles at the start (a board with a small slice has larger per-sample gradients) and about once
per growth interval after that (the scaler doubles the scale every 2,000 clean steps and the next
overflow halves it back). A board with valid keys that sent an Inf gradient at every step would
stop the model and drive the scale towards zero. So a board whose gradient alone overflowed at
more than :data:`LONE_OVERFLOW_LIMIT` of the last :data:`LONE_OVERFLOW_WINDOW` steps has its next
lone overflow refused (flagged and named like any refused gradient): the step goes on with the
other boards' gradients instead of being skipped.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

LONE_OVERFLOW_WINDOW = 2000  # steps: torch's GradScaler growth interval
LONE_OVERFLOW_LIMIT = 16     # lone overflows of one board tolerated within the window (the scale settling, growth)


class OverflowWatch:
    """Counts each board's lone overflows within a sliding window of steps."""

    def __init__(self, window: int = LONE_OVERFLOW_WINDOW, limit: int = LONE_OVERFLOW_LIMIT) -> None:
        self.window, self.limit = window, limit
        self._steps: dict[str, deque[int]] = {}

    def lone(self, board_id: str, step: int) -> str | None:
        """``board_id``'s gradient alone overflowed at ``step``: why it is refused now, or None (skip the step)."""
        steps = self._steps.setdefault(board_id, deque())
        while steps and steps[0] <= step - self.window:
            steps.popleft()
        if len(steps) >= self.limit:
            return (f"its gradient alone overflowed at {len(steps)} of the last {self.window} steps while every other "
                    "board's was finite (16-mixed): refused instead of skipping the step again")
        steps.append(step)
        return None


__all__ = ["LONE_OVERFLOW_LIMIT", "LONE_OVERFLOW_WINDOW", "OverflowWatch"]
