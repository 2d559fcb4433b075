"""A pipeline stage's parameters and optimizer state as one flat float32 vector, and back (issue 35).

A later stage's board sends it at the stage's state steps (``protocol.stage_sync``), after the
stage's gradient; the coordinator's replica loads it into its own copy of the stage before taking
the same optimizer step with that gradient. The layout is fixed by the two sides' own objects, never
by the frame: the stage's parameters (in the optimizer's order, as the gradient), then, parameter by
parameter, each of its optimizer state's values under their sorted keys (a tensor's values, a
number as one value). Both sides ran the same optimizer on the same parameters from the same state
(the welcome's, the first step's gradient), so their states have the same keys and shapes; a vector
of another length is refused, naming both lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edgefleet.protocol.errors import DecodeError

log = logging.getLogger(__name__)


def _entries(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """The optimizer's state values of ``param`` that travel: tensors and plain numbers, by sorted key."""
    state = optimizer.state.get(param, {})
    return [(key, state[key]) for key in sorted(state, key=str)
            if isinstance(state[key], torch.Tensor) or type(state[key]) in (int, float)]


def _size(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


def state_elements(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """The vector's length for ``params`` under ``optimizer``'s state now."""
    return sum(p.numel() + sum(_size(v) for _, v in _entries(p, optimizer)) for p in params)


@torch.no_grad()
def pack_stage_state(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *,
                     out: np.ndarray | None = None) -> np.ndarray:
    """``params``' values, then their optimizer state's, as one float32 vector: written into ``out`` (of
    :func:`state_elements` values) where given, so that a large stage is not held twice more while it is packed."""
    vector = out if out is not None else np.empty(state_elements(params, optimizer), dtype=np.float32)
    target = torch.from_numpy(vector)
    at = 0
    values: list[Any] = [*params, *(value for p in params for _, value in _entries(p, optimizer))]
    for value in values:
        if isinstance(value, torch.Tensor):
            n = value.numel()
            target[at:at + n].copy_(value.detach().reshape(-1))
        else:
            n = 1
            target[at] = float(value)
        at += n
    if at != vector.size:
        raise ValueError(f"the stage's state takes {at} values, not the {vector.size} given")
    return vector


@torch.no_grad()
def load_stage_state(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, vector: np.ndarray,
                     *, stage: int) -> None:
    """Set ``params`` and their optimizer state from ``vector`` (:func:`pack_stage_state`'s layout).

    Raises:
        DecodeError: the vector's length is not this side's layout's, or it holds a value that is not finite.
    """
    expected = state_elements(params, optimizer)
    if vector.size != expected:
        raise DecodeError(f"stage {stage}'s state holds {vector.size} values; its parameters and optimizer state here "
                          f"take {expected}: the board's optimizer is not the replica's (another version of the module?)")
    if not np.isfinite(vector).all():
        raise DecodeError(f"stage {stage}'s state holds a value that is not finite: its board diverged or lies")
    at = 0
    for p in params:
        n = p.numel()
        p.copy_(torch.from_numpy(vector[at:at + n]).reshape(p.shape).to(p.device, p.dtype))
        at += n
    for p in params:
        for key, value in _entries(p, optimizer):
            n = _size(value)
            part = vector[at:at + n]
            at += n
            if isinstance(value, torch.Tensor):
                value.copy_(torch.from_numpy(part).reshape(value.shape).to(value.device, value.dtype))
            else:
                optimizer.state[p][key] = type(value)(part[0])


__all__ = ["load_stage_state", "pack_stage_state", "state_elements"]
