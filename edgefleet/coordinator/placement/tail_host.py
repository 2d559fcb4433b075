"""The tail host's arithmetic (layer placement): the tail's forward and backward over the global batch,
and the full gradient the coordinator's replica takes.

Every board's loss is the mean over its own slice (as in data-parallel training); the global batch's
loss is their sample-weighted mean, L = sum(n_i L_i) / N. So the host weighs board i's output
gradient by n_i / N before the tail's backward: the tail's parameter gradients are then the
global batch's, exactly as ``Trainer.fit`` computes them, and each board's activation gradient
(multiplied back by N / n_i) is its own loss's, which its head's backward turns into the mean
gradient the gradient exchange averages, sample-weighted, as ever.

The host runs the tail on the replica's own layers (``coordinator.run.replica``): between the
replica's steps its Trainer waits, so the tail's forward for step s sees the parameters every board
holds after step s - 1. A board whose slice reached the forward but whose head gradient did not
reach the exchange (it died in between) is taken out of the tail's gradient too: the step's
gradient is recomputed over the boards that contributed to both (:meth:`TailStep.tail_gradient`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from edgefleet.workloads.layer_cut import ModelCut
from edgefleet.workloads.params import BufferSet

log = logging.getLogger(__name__)


class TailStep:
    """One step's tail: the forward over the boards' slices (board order), then the backward.

    Args:
        cut: the replica's model, cut.
        slices: each board's activation for the step, by board id, in board order.
    """

    def __init__(self, cut: ModelCut, slices: dict[str, np.ndarray]) -> None:
        self.cut = cut
        self.boards = list(slices)
        self.sizes = [int(a.shape[0]) for a in slices.values()]
        self._inputs = [torch.from_numpy(np.array(a, dtype=np.float32)).requires_grad_(True) for a in slices.values()]
        self._output: torch.Tensor | None = None
        self._raw: dict[str, torch.Tensor] = {}  # each answering board's output gradient, as it sent it
        self._param_grads: list[torch.Tensor | None] = []
        self._param_grads_for: list[str] = []

    def forward(self) -> dict[str, np.ndarray]:
        """The tail's output over the global batch, each board's slice (by board id)."""
        with torch.enable_grad():
            output = self.cut.tail(torch.cat(self._inputs) if len(self._inputs) > 1 else self._inputs[0])
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the tail's output is a {type(output).__name__}, not a tensor")
        self._output = output
        parts = torch.split(output.detach(), self.sizes)
        return {board: part.numpy() for board, part in zip(self.boards, parts)}

    def backward(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each answering board's activation gradient, given its loss's output gradient (boards absent from
        ``grads`` contribute nothing to this step's tail gradient)."""
        self._raw = {b: torch.from_numpy(np.array(grads[b], dtype=np.float32)) for b in self.boards if b in grads}
        answered = list(self._raw)
        weights = self._weights(answered)
        inputs = [x for b, x in zip(self.boards, self._inputs) if b in self._raw]
        found = self._grad([*inputs, *self._trained()], weights)
        self._param_grads, self._param_grads_for = list(found[len(inputs):]), answered
        return {b: (g * (1.0 / weights[b])).numpy() if g is not None else np.zeros(x.shape, np.float32)
                for b, g, x in zip(answered, found[:len(inputs)], inputs)}

    def tail_gradient(self, contributed: Sequence[str]) -> list[torch.Tensor | None]:
        """The tail parameters' gradients over the boards that also ``contributed`` their head's gradient
        (in ``cut.tail_params`` order among those that require grad; None: unused by the tail)."""
        keep = [b for b in self._param_grads_for if b in set(contributed)]
        if keep != self._param_grads_for:
            log.info("placement: recomputing the tail's gradient without %s (no head gradient this step)",
                     ", ".join(b for b in self._param_grads_for if b not in keep))
            self._param_grads = (list(self._grad(self._trained(), self._weights(keep))) if keep
                                 else [None] * len(self._trained()))
            self._param_grads_for = keep
        return self._param_grads

    def _trained(self) -> list[torch.nn.Parameter]:
        return [p for p in self.cut.tail_params if p.requires_grad]

    def _grad(self, wrt: Sequence[torch.Tensor], weights: dict[str, float]) -> tuple[torch.Tensor | None, ...]:
        """d(sum of the weighted boards' losses)/d``wrt``: each board's output gradient weighted by n_i / N."""
        assert self._output is not None, "forward first"
        shape = self._output.shape[1:]
        grad_out = torch.cat([self._raw[b] * weights[b] if b in weights else torch.zeros(n, *shape)
                              for b, n in zip(self.boards, self.sizes)])
        return torch.autograd.grad(self._output, wrt, grad_outputs=grad_out, retain_graph=True, allow_unused=True)

    def release(self) -> None:
        """Free the step's graph."""
        self._output, self._raw, self._inputs = None, {}, []

    def _weights(self, boards: Sequence[str]) -> dict[str, float]:
        total = sum(n for b, n in zip(self.boards, self.sizes) if b in boards)
        return {b: n / total for b, n in zip(self.boards, self.sizes) if b in boards}


class FullGradient:
    """Puts the head's averaged vector and the tail's gradient together in the replica's vector order.

    The head's vector is its gradient, then its layers' buffers (``workloads.params.BufferSet`` of the
    head's layers: the first contributing board's, or their average, as ``--sync-buffers`` says); the
    replica's is every parameter's gradient, then every buffer. The head's buffers are set on the
    replica's layers and then every buffer is read back: the tail's are the ones its forward just moved
    on the replica's own layers (BatchNorm in the tail sees the whole global batch).

    Args:
        exchanged: the replica's parameters in its vector's order (``Replica.exchanged``).
        cut: the replica's model, cut (which parameters and layers are the head's).
        buffers: the replica's buffers as its vector carries them (``Replica.buffers``).
    """

    def __init__(self, exchanged: Sequence[torch.nn.Parameter], cut: ModelCut, buffers: BufferSet | None = None) -> None:
        head = {id(p) for p in cut.head_params}
        self._slots: list[tuple[bool, int, int]] = []  # (from the head's vector?, where in it, elements)
        head_at = 0
        for p in exchanged:
            if id(p) in head:
                self._slots.append((True, head_at, p.numel()))
                head_at += p.numel()
            else:
                self._slots.append((False, 0, p.numel()))
        self.head_grad_elements = head_at
        self.head_buffers = BufferSet(cut.head_layers())
        self.head_elements = head_at + self.head_buffers.elements  # the head's vector: what the exchange carries
        self.grad_elements = sum(n for _, _, n in self._slots)
        self._buffers = buffers if buffers is not None else BufferSet()
        self.elements = self.grad_elements + self._buffers.elements
        self._tail_index = {id(p): i for i, p in enumerate(p for p in cut.tail_params if p.requires_grad)}
        self._exchanged = list(exchanged)

    def combine(self, head: np.ndarray, tail: Sequence[torch.Tensor | None]) -> np.ndarray:
        """The replica's vector: the head's average and the tail's gradient (zeros for a parameter the tail left
        unused), then every buffer (the head's from ``head``, the tail's as its forward left them)."""
        out = np.zeros(self.elements, dtype=np.float32)
        at = 0
        for p, (from_head, where, n) in zip(self._exchanged, self._slots):
            if from_head:
                out[at:at + n] = head[where:where + n]
            else:
                index = self._tail_index.get(id(p), len(tail))
                grad = tail[index] if index < len(tail) else None
                if grad is not None:
                    out[at:at + n] = grad.detach().reshape(-1).numpy()
            at += n
        if self._buffers:
            if self.head_buffers:
                self.head_buffers.assign_from(head[self.head_grad_elements:self.head_elements])
            self._buffers.flatten_into(out[self.grad_elements:])
        return out


__all__ = ["FullGradient", "TailStep"]
