"""The board's side of periodic averaging (local SGD): the model as it was at the last average.

Between averages a board steps its optimizer on its own gradients. At a sync step it sends how far
it moved since the last average (the anchor minus its parameters and float buffers now), the
exchange averages those deltas weighted by the samples each board trained on since then, and the
board sets its model to the anchor minus the average delta, which becomes its new anchor. Every
board (and the coordinator's replica, which holds the anchor itself) thus continues from the same
model. ``protocol.sync_schedule`` says which steps those are.

Integer buffers (``num_batches_tracked``) have no delta to average: the vector's last elements carry
the board's own, as bytes (``workloads.params.pack_int_buffers``), and every board takes the first
contributing board's from the result (DDP's rule, as at an exact step).

Imported only by the training worker (it needs torch); never on the agent's idle path.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from edgefleet.workloads.outer_step import OuterStep
from edgefleet.workloads.params import assign_values, flatten_values, int_buffer_bytes, pack_int_buffers, unpack_int_buffers

log = logging.getLogger(__name__)


class ParameterAnchor:
    """The trainable parameters and float buffers at the last average, flat in float32, and the samples since.

    Args:
        tensors: The trainable parameters, then the float buffers, in the exchange's order.
        int_buffers: The integer buffers, whose bytes end the exchanged vector (never a delta).
        outer: DiLoCo's outer step over the trainable parameters at the tensors' head; None: the plain average.
    """

    def __init__(self, tensors: list[torch.Tensor], int_buffers: list[torch.Tensor] | None = None,
                 outer: OuterStep | None = None) -> None:
        self.tensors = tensors
        self.outer = outer
        self.int_buffers = int_buffers or []
        self.values = np.zeros(sum(t.numel() for t in tensors), dtype=np.float32)
        self.size = self.values.size + int_buffer_bytes(self.int_buffers)  # the exchanged vector's
        self.samples = 0  # trained on since the anchor was taken: this board's weight in the next average
        self.taken = False

    def take(self) -> None:
        """The model as it is now becomes the anchor (a board's first local step: the model every board holds)."""
        flatten_values(self.tensors, self.values)
        self.samples, self.taken = 0, True

    @torch.no_grad()
    def delta_into(self, out: np.ndarray) -> np.ndarray:
        """``out`` = anchor - the model now, then the integer buffers' bytes (float32, the exchange's layout); returns ``out``."""
        deltas = out[:self.values.size]
        flatten_values(self.tensors, deltas)
        np.subtract(self.values, deltas, out=deltas)
        pack_int_buffers(self.int_buffers, out[self.values.size:self.size])
        return out

    @torch.no_grad()
    def apply(self, average_delta: np.ndarray) -> None:
        """The model and the anchor become anchor - ``average_delta`` (the fleet's average), or with DiLoCo the anchor
        moved by the outer step; the integer buffers the first contributing board's (the result's last elements); the
        sample count restarts."""
        if self.outer is not None:
            self.outer.apply(self.values, average_delta)
        else:
            np.subtract(self.values, average_delta[:self.values.size], out=self.values)
        assign_values(self.tensors, self.values)
        unpack_int_buffers(self.int_buffers, average_delta[self.values.size:self.size])
        self.samples = 0


__all__ = ["ParameterAnchor"]
