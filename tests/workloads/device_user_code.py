"""A user's module code, as a file of its own: the frames torch's device errors are raised through.

Each function builds a tensor the way a module's ``forward`` does and then fails the way torch
fails on a GPU board when that tensor stayed on the CPU (there is no GPU here to fail for real).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import nn


def positions_forward(x: torch.Tensor, message: str) -> torch.Tensor:
    """A forward that adds CPU-made positions to its input (the Jetson's message raised by hand)."""
    positions = torch.arange(x.shape[1])  # no device=: on a GPU board it stays on the CPU
    if message:
        raise RuntimeError(message)  # what x + positions raises there
    return x + positions


def forward_through_stdlib(message: str) -> torch.Tensor:
    """The error raised by a standard-library frame (a Future) called from the user's code."""
    future: Future[torch.Tensor] = Future()
    future.set_exception(RuntimeError(message))
    return future.result()  # the user's line


def forward_through_torch() -> nn.Module:
    """An error raised inside torch's own Python code, called from the user's code."""
    return nn.Linear(2, 2).get_submodule("missing")  # the user's line
