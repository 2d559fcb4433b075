"""The board's side of periodic averaging (local SGD): the model as it was at the last average.

Between averages a board steps its optimizer on its own gradients. At a sync step it sends how far
it moved since the last average (the anchor minus its parameters and float buffers now), the
exchange averages those deltas weighted by the samples each board trained on since then, and the
board sets its model to the anchor minus the average delta, which becomes its new anchor. Every
board (and the coordinator's replica, which holds the anchor itself) thus continues from the same
model. ``protocol.sync_schedule`` says which steps those are.

Imported only by the training worker (it needs torch).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from edgefleet.workloads.params import assign_values, flatten_values

log = logging.getLogger(__name__)


class ParameterAnchor:
    """The trainable parameters and float buffers at the last average, flat in float32, and the samples since.

    Args:
        tensors: The trainable parameters, then the float buffers, in the exchange's order.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.values = np.zeros(sum(t.numel() for t in tensors), dtype=np.float32)
        self.samples = 0  # trained on since the anchor was taken: this board's weight in the next average
        self.taken = False

    def take(self) -> None:
        """The model as it is now becomes the anchor (a board's first local step: the model every board holds)."""
        flatten_values(self.tensors, self.values)
        self.samples, self.taken = 0, True

    @torch.no_grad()
    def delta_into(self, out: np.ndarray) -> np.ndarray:
        """``out`` = anchor - the model now (float32, the exchange's layout); returns ``out``."""
        flatten_values(self.tensors, out)
        np.subtract(self.values, out, out=out)
        return out

    @torch.no_grad()
    def apply(self, average_delta: np.ndarray) -> None:
        """The model and the anchor become anchor - ``average_delta`` (the fleet's average); the sample count restarts."""
        np.subtract(self.values, average_delta, out=self.values)
        assign_values(self.tensors, self.values)
        self.samples = 0


__all__ = ["ParameterAnchor"]
