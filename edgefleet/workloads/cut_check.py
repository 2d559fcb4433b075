"""Whether a cut model trains what the uncut one does, on one sample batch (layer placement, pipeline stages).

:func:`check_cut_forward` runs the module's own ``training_step`` on a batch twice, once as it is
and once with ``forward`` replaced by the cut model's (the head and tail, or the stages in turn), on
the same random generators' state, and reports what a cut run depends on: that ``training_step``
calls ``forward`` exactly once per batch (each board sends one activation a step), that no layer
after the cut runs outside ``forward`` (a loss from intermediate activations: those layers live on
another host), and both losses. Every buffer is put back afterwards and the generators' state is
forked, so the check changes nothing the run then does. The callers word the refusals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CutCheck:
    """What one sample batch showed: ``forward`` calls through the cut, later layers run outside it, both losses."""

    calls: int
    outside: int
    loss_uncut: float | None
    loss_cut: float | None

    def same_loss(self) -> bool:
        return (self.loss_uncut is not None and self.loss_cut is not None
                and abs(self.loss_uncut - self.loss_cut) <= 1e-7 + 1e-5 * abs(self.loss_cut))


def check_cut_forward(model: Any, batch: Any, cut_forward: Callable[..., torch.Tensor],
                      later: Sequence[torch.nn.Module]) -> CutCheck:
    """Run ``model.training_step(batch, 0)`` uncut, then with ``forward`` = ``cut_forward``, counting its calls and the
    calls of the ``later`` layers (those past the first cut) made outside it."""
    seen = {"calls": 0, "inside": False, "outside": 0}

    def count_outside(module: torch.nn.Module, args: Any) -> None:
        if not seen["inside"]:
            seen["outside"] += 1

    def counted_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["calls"] += 1
        seen["inside"] = True
        try:
            return cut_forward(*args, **kwargs)
        finally:
            seen["inside"] = False

    kept = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}  # the check moves none of them
    with torch.random.fork_rng():
        state = torch.random.get_rng_state()
        reference = model.training_step(batch, 0)
        handles = [m.register_forward_pre_hook(count_outside) for m in later]
        model.forward = counted_forward
        try:
            torch.random.set_rng_state(state)
            cut = model.training_step(batch, 0)
        finally:
            model.__dict__.pop("forward", None)
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(kept[name])
    return CutCheck(calls=int(seen["calls"]), outside=int(seen["outside"]), loss_uncut=_loss(reference),
                    loss_cut=_loss(cut))


def _loss(value: Any) -> float | None:
    loss = value.get("loss") if isinstance(value, dict) else value
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


__all__ = ["CutCheck", "check_cut_forward"]
