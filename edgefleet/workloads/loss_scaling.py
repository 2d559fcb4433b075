"""``--precision 16-mixed`` with DDP's rule: one loss scale for the fleet, an overflow on any board skips the step on all.

Under DDP every rank scales its loss by the same factor, the ranks' scaled gradients are averaged,
and the scaler unscales the average: a gradient that overflowed on any rank makes the average
non-finite, so every rank skips that optimizer step and halves its scale alike, and the scales
stay equal. The fleet does the same with the exchange in between:

* each board runs Lightning's own ``MixedPrecision("16-mixed")`` with a ``torch.amp.GradScaler``
  (on a CPU board too: torch's CPU autocast runs float16, where ``Trainer(precision="16-mixed")``
  on a CPU alone would switch to bf16 and a fleet of CPU and GPU boards would train two ways);
* the scaler unscales the board's gradient before ``on_before_optimizer_step``, where the board
  sends it; an overflowed gradient travels as it is (Inf or NaN);
* the coordinator's reduce makes the whole gradient part of the result NaN when any board's
  overflowed (``coordinator.exchange.gradient_reduce``, ``loss_scaled``); every replica then
  marks the step overflowed or not from the result alone (:func:`mark_overflow`), so its
  ``GradScaler.step`` skips the optimizer step exactly where every other replica does and its
  ``update`` moves the scale alike;
* the coordinator's replica computes no gradient: :func:`precision_plugin` gives it a
  ``MixedPrecision`` that steps with the averaged gradient (:func:`_replica_class`);
* the scale travels with the state: ``checkpoint.pt`` keeps it, ``--resume`` restores it, and a
  board joining mid-run gets it in its welcome.

The found-Inf flags live in ``GradScaler._per_optimizer_states``, torch's (private, stable since
1.6) record of what ``unscale_`` found; :func:`mark_overflow` overwrites them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

LOSS_SCALED_PRECISIONS = ("16-mixed",)
_WHOLE = ("growth_interval", "_growth_tracker")  # a GradScaler's state fields that are counts


def amp_device(accelerator: str) -> str:
    """torch's device type for autocast and the scaler of a Trainer on ``accelerator`` (``gpu`` or ``cpu``)."""
    return "cuda" if accelerator == "gpu" else "cpu"


def new_scaler(accelerator: str, state: Mapping[str, float] | None = None) -> torch.amp.GradScaler:
    """A GradScaler for ``accelerator``, at ``state`` (``GradScaler.state_dict()``: the fleet's scale now) if given."""
    device = amp_device(accelerator)
    scaler = torch.amp.GradScaler(device)
    if state:
        scaler.load_state_dict({name: int(value) if name in _WHOLE else float(value) for name, value in state.items()})
    scaler.scale(torch.zeros((), device=device))  # makes its scale tensor now: the replica never scales a loss
    return scaler


def scaler_state(scaler: torch.amp.GradScaler) -> dict[str, float | int]:
    """The scaler's state as plain numbers (it travels in a welcome and sits in ``checkpoint.pt``)."""
    return {name: int(value) if name in _WHOLE else float(value) for name, value in scaler.state_dict().items()}


@functools.cache
def _replica_class(base: type) -> type:
    """``base`` (a Lightning package's ``MixedPrecision``) for the coordinator's replica, which computes no gradient.

    Lightning skips the scaler's step when ``training_step`` returned None, as the replica's does:
    here the (empty) closure runs, ``unscale_`` marks the optimizer unscaled before any gradient
    is there, ``_after_closure`` runs ``on_before_optimizer_step`` (where the replica takes the
    average and marks the overflow) and clipping, then the scaler steps and updates as on a board.
    """

    class ReplicaMixedPrecision(base):  # type: ignore[misc]  # a class of the module's Lightning package
        def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
            closure()
            self.scaler.unscale_(optimizer)
            self._after_closure(model, optimizer)
            output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return output

    return ReplicaMixedPrecision


def precision_plugin(package: ModuleType, accelerator: str, scaler: torch.amp.GradScaler, *, replica: bool = False) -> Any:
    """``package``'s ``MixedPrecision("16-mixed")`` on ``accelerator`` with ``scaler``; the replica's kind if ``replica``."""
    base = package.plugins.precision.MixedPrecision
    cls = _replica_class(base) if replica else base
    return cls("16-mixed", amp_device(accelerator), scaler=scaler)


def overflowed(values: np.ndarray) -> bool:
    """Whether the result's gradient part ``values`` is non-finite: some board's gradient overflowed this step."""
    return not bool(np.isfinite(values).all())


def mark_overflow(scaler: torch.amp.GradScaler, optimizer: Any, found: bool) -> None:
    """Make ``scaler``'s ``step`` and ``update`` see ``found`` (an overflow on any board) for ``optimizer``'s step.

    Called after ``unscale_`` (Lightning's, before ``on_before_optimizer_step``) and once the fleet's
    gradient is in place: what ``unscale_`` found in this replica's own gradient no longer counts.
    """
    state = scaler._per_optimizer_states[id(optimizer)]
    flags = state["found_inf_per_device"]
    for flag in flags.values():
        flag.fill_(1.0 if found else 0.0)
    if not flags:  # no gradient was there when it unscaled (the replica's)
        device = scaler._scale.device if scaler._scale is not None else torch.device("cpu")
        flags[device] = torch.full((), 1.0 if found else 0.0, dtype=torch.float32, device=device)


def unscaled(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> float:
    """The loss before the scaler scaled it (``on_before_backward`` sees the scaled loss under 16-mixed)."""
    value = float(loss.detach())
    return value if scaler is None else value / scaler.get_scale()


__all__ = [
    "LOSS_SCALED_PRECISIONS",
    "amp_device",
    "mark_overflow",
    "new_scaler",
    "overflowed",
    "precision_plugin",
    "scaler_state",
    "unscaled",
]
