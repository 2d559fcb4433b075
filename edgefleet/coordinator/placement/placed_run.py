"""A placed run's coordinator side: the cut checked before any board starts, the tail host's endpoint,
and each step's full gradient for the replica.

:func:`prepare` cuts the replica's model (``workloads.layer_cut``) and refuses, naming why and what to
do, what placement cannot train exactly: a ``training_step`` that calls the model's forward
other than once per batch or runs a tail layer outside ``forward``, or one whose loss with the cut
differs from the uncut model's on a sample batch (the replica's own ``training_step`` replay is
refused by the run). The check runs on the coordinator, on a copy of the random generators' state
and of the module's buffers (nothing it draws or moves changes the run).

:class:`PlacedRun` then serves the run: :attr:`server` (``coordinator.placement.tail_server``) runs
each step's activation rounds before the gradient exchange's round for the head, and
:meth:`PlacedRun.apply_with` hands the replica the head's average and the tail's gradient as one
vector in its own order, so the replica's Trainer steps every parameter as ``Trainer.fit`` would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edgefleet.coordinator.exchange.step_sum import StepResult
from edgefleet.coordinator.placement.tail_host import FullGradient, TailStep
from edgefleet.coordinator.placement.tail_server import TailServer
from edgefleet.workloads.cut_check import check_cut_forward
from edgefleet.workloads.layer_cut import CutRefused, ModelCut, cut_model
from edgefleet.workloads.params import BufferSet

log = logging.getLogger(__name__)

SAMPLE_ROWS = 2  # samples in the batch the cut is checked on
THREAD_REFIT_STEPS = 20  # steps between fitting the tail's torch threads to the free CPU


class PlacedRun:
    """One placed run: the replica's model cut, its tail endpoint (made by :meth:`serve`), the vector mapping.

    Args:
        cut: the replica's model, cut.
        exchanged: the replica's parameters in its vector's order.
        boundary, output: one sample's activation and tail-output shapes.
        buffers: the replica's buffers as its vector carries them.
    """

    def __init__(self, cut: ModelCut, exchanged: list[torch.nn.Parameter], boundary: tuple[int, ...],
                 output: tuple[int, ...], buffers: BufferSet | None = None) -> None:
        self.cut, self.boundary, self.output = cut, boundary, output
        self.full = FullGradient(exchanged, cut, buffers)
        self.head_buffers = self.full.head_buffers  # what of the exchange's vector is buffers (the head's layers')
        self.head_elements = self.full.head_elements
        self.server: TailServer | None = None
        self.threads: Callable[[], int] | None = None  # the tail's torch threads: the CPU left free (None: as set)

    def fit_threads(self, step: int) -> None:
        """Every :data:`THREAD_REFIT_STEPS` steps, give the tail's thread (the event loop's) the torch threads the
        cores others left free fit: torch's default of one per CPU seen waits at every operator's barrier when
        boards or other work share the machine (``coordinator.run.replica_threads``), and the tail is every step's
        serial part. torch's thread count is per calling thread: the replica's validation sets its own."""
        if self.threads is None or step % THREAD_REFIT_STEPS:
            return
        threads = self.threads()
        if threads != torch.get_num_threads():
            log.debug("the tail computes with %d torch thread(s) (was %d)", threads, torch.get_num_threads())
            torch.set_num_threads(threads)

    def serve(self, server: TailServer) -> TailServer:
        self.server = server
        return server

    def apply_with(self, tail: TailStep | None,
                   apply: Callable[[np.ndarray, StepResult], None]) -> Callable[[np.ndarray, StepResult], None]:
        """The exchange's ``apply`` for a placed step: the replica takes the head's average and the tail's gradient
        over the boards that contributed to both."""

        def placed_apply(head: np.ndarray, result: StepResult) -> None:
            tail_grads = tail.tail_gradient(result.contributors) if tail is not None else []
            apply(self.full.combine(head, tail_grads), result)
            if tail is not None:
                tail.release()

        return placed_apply

    def describe(self, batch_sizes: list[int]) -> str:
        """What crosses the network per step and board, both ways, for the run's note."""
        per_sample = int(np.prod(self.boundary)) + int(np.prod(self.output))
        head = self.head_elements * 4
        params = self.full.head_grad_elements
        return (f"layer placement after {self.cut.name}: the boards train {params:,} parameters, the "
                f"coordinator {self.full.grad_elements - params:,}; per step a board sends "
                f"{_kb(max(batch_sizes) * per_sample * 4 + head)} and receives as much (its activations and the "
                f"head's gradient; data-parallel: {_kb(self.full.elements * 4)} each way)")


def prepare(model: Any, cut_name: str, exchanged: list[torch.nn.Parameter], sample: Any,
            buffers: BufferSet | None = None) -> PlacedRun:
    """Cut the replica's ``model`` after ``cut_name`` and check the cut on ``sample`` (a collated batch);
    ``buffers``: the replica's, as its vector carries them.

    Raises:
        ConfigError: the cut does not exist or is not admissible, or placement cannot train this module
            exactly (the message says why and what to do).
    """
    cut = cut_model(model, cut_name)
    boundary, output = _check_on_sample(model, cut, sample)
    return PlacedRun(cut, exchanged, boundary, output, buffers)


def _check_on_sample(model: Any, cut: ModelCut, batch: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Run ``training_step`` on ``batch`` uncut and cut (locally); the boundary's and output's per-sample shapes.

    Raises:
        CutRefused: forward runs other than once, a tail layer runs outside forward, or the losses differ.
    """
    tail_modules = [m for m in cut.tail.modules() if m is not cut.tail and not list(m.children())]
    shapes: dict[str, tuple[int, ...]] = {}

    def placed_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        activation = cut.head(*args, **kwargs)
        out: torch.Tensor = cut.tail(activation)
        shapes["boundary"], shapes["output"] = tuple(activation.shape[1:]), tuple(out.shape[1:])
        return out

    seen = check_cut_forward(model, batch, placed_forward, tail_modules)
    where = f"{type(model).__name__}.training_step"
    if seen.calls != 1:
        raise CutRefused(f"--placement {cut.name}: {where} ran the model's forward {seen.calls} times on one batch; "
                         "placement sends one activation per batch: train it with --placement none")
    if seen.outside:
        raise CutRefused(f"--placement {cut.name}: {where} runs layers after the cut outside forward (a loss from "
                         "intermediate activations); they live on the coordinator: train it with --placement none")
    if not seen.same_loss():
        raise CutRefused(f"--placement {cut.name}: {where} gives the loss {seen.loss_cut} with the cut and "
                         f"{seen.loss_uncut} without on a sample batch, so the cut changes what is trained: choose "
                         "another cut or --placement none")
    return shapes["boundary"], shapes["output"]


def _kb(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n >= 10 * 1024 else f"{n / 1024:.1f} KiB"


__all__ = ["SAMPLE_ROWS", "THREAD_REFIT_STEPS", "PlacedRun", "prepare"]
