"""DiLoCo's outer step on the flat anchor: the one computation every board and the coordinator's replica run.

At a sync step each side holds the same anchor (the model at the last average) and receives the
same sample-weighted average delta D. :class:`OuterStep` moves the anchor in place: the trainable
parameters (the first ``elements`` values) by the outer optimizer with D as its gradient
(``protocol.outer_optimizer``), the float buffers after them by the plain average. Every operation
is a float32 numpy operation in a fixed order, so all sides hold the same bits afterwards, and with
``lr == 1``, ``momentum == 0`` the result is bit for bit ``anchor - D`` (today's periodic averaging).

The momentum buffer is the only state: the replica checkpoints it and hands it to a joining board
(the welcome), which is why :meth:`OuterStep.load_state` checks what it is given.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.outer_optimizer import OuterOptimizer

log = logging.getLogger(__name__)


class OuterStep:
    """The outer optimizer's state (its momentum buffer) and its step on a flat anchor.

    Args:
        outer: The run's outer optimizer settings.
        elements: Trainable parameter values at the anchor's head (the outer step moves these; the rest are averaged).
    """

    def __init__(self, outer: OuterOptimizer, elements: int) -> None:
        self.outer = outer
        self.elements = elements
        self.momentum = np.zeros(elements if outer.stepped else 0, dtype=np.float32)
        self._update = np.zeros_like(self.momentum)  # scratch: the step before it is scaled by the learning rate

    def apply(self, anchor: np.ndarray, delta: np.ndarray) -> None:
        """``anchor`` (float32, in place) -= the outer step for the average ``delta`` (as long as ``anchor`` or longer)."""
        size = anchor.size
        if not self.outer.stepped:
            np.subtract(anchor, delta[:size], out=anchor)
            return
        n = self.elements
        grad = delta[:n]
        mu, lr = np.float32(self.outer.momentum), np.float32(self.outer.lr)
        np.multiply(self.momentum, mu, out=self.momentum)
        np.add(self.momentum, grad, out=self.momentum)                  # m = mu*m + D
        update = self._update
        if self.outer.nesterov:
            np.multiply(self.momentum, mu, out=update)
            np.add(update, grad, out=update)                            # D + mu*m
        else:
            np.copyto(update, self.momentum)                            # m
        np.multiply(update, lr, out=update)
        np.subtract(anchor[:n], update, out=anchor[:n])
        np.subtract(anchor[n:], delta[n:size], out=anchor[n:])           # float buffers: the plain average

    def state(self) -> dict[str, np.ndarray]:
        """The momentum buffer (a copy), for a checkpoint or a welcome; {} for the plain average."""
        return {"momentum": self.momentum.copy()} if self.outer.stepped else {}

    def load_state(self, state: Any) -> None:
        """Take a saved or welcomed state.

        Raises:
            DecodeError: the state is not a finite float32 momentum buffer of this model's size.
        """
        if not self.outer.stepped:
            return
        momentum: Any = state.get("momentum") if isinstance(state, dict) else None
        if momentum is not None and hasattr(momentum, "numpy"):  # a checkpoint's torch tensor
            momentum = momentum.numpy()
        if not isinstance(momentum, np.ndarray) or momentum.dtype != np.float32 or momentum.shape != (self.elements,):
            raise DecodeError(f"the outer optimizer's state is not a float32 momentum buffer of {self.elements} values")
        if not np.isfinite(momentum).all():
            raise DecodeError("the outer optimizer's momentum buffer holds a non-finite value")
        np.copyto(self.momentum, momentum)


__all__ = ["OuterStep"]
