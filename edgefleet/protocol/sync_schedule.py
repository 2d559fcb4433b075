"""Which steps of a run average the boards' models: the one schedule both sides of periodic averaging follow.

Periodic averaging (post-local SGD, Lin et al. 2020; PyTorch's ``PostLocalSGDOptimizer``) trains the
first ``warmup`` steps exactly (every step averages the boards' gradients, DDP's mathematics), then
lets each board step its optimizer on its own batch's gradient and averages the boards' parameters
only every ``every`` steps. A step is one of three kinds:

* ``exact``: before the warm-up's end (or ``every == 1``, the default: every step): gradients are averaged;
* ``local``: each board steps on its own gradient; the exchange carries an empty vector both ways;
* ``sync``: a local step after which the boards' parameters (and float buffers) are averaged.

A step ``s >= warmup`` is a sync step when ``(s - warmup + 1) % every == 0``, when it is the last step of
an epoch (validation and checkpoints see an averaged model) or the last step of the run. The board's
worker and the coordinator (exchange and replica) both decide with :func:`is_sync_step`, so they never
disagree on what a frame of a given step must hold. What a sync step does with the average is the
schedule's ``outer`` optimizer (``protocol.outer_optimizer``: the plain average, or DiLoCo's outer SGD).
No torch, no numpy: the protocol's rules only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from edgefleet.protocol.outer_optimizer import PLAIN_AVERAGE, OuterOptimizer

StepKind = Literal["exact", "local", "sync"]
EXACT: Final = "exact"
LOCAL: Final = "local"
SYNC: Final = "sync"


def is_exact_step(step: int, *, every: int, warmup: int) -> bool:
    """Whether ``step`` averages gradients (DDP's mathematics): always with ``every == 1``, else before ``warmup``."""
    return every <= 1 or step < warmup


def is_sync_step(step: int, *, every: int, warmup: int, steps_per_epoch: int, total_steps: int) -> bool:
    """Whether ``step`` is a local step after which the boards' parameters are averaged.

    Args:
        step: The global step (0-based).
        every: Average every this many local steps (1: never local, so never a sync step).
        warmup: Exact steps before the first local one.
        steps_per_epoch: Optimizer steps in an epoch (an epoch's last step always averages).
        total_steps: Steps of the run (its last step always averages).
    """
    if is_exact_step(step, every=every, warmup=warmup):
        return False
    return ((step - warmup + 1) % every == 0 or (steps_per_epoch > 0 and (step + 1) % steps_per_epoch == 0)
            or step + 1 >= total_steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncSchedule:
    """A run's averaging schedule (see the module's docstring); ``every == 1`` is the exact mode."""

    every: int = 1           # average the boards' parameters every this many local steps; 1 = exact throughout
    warmup: int = 0          # exact steps first (post-local SGD's warm-up)
    steps_per_epoch: int = 0  # an epoch's last step always averages (0: no epochs to honour)
    total_steps: int = 0     # the run's last step always averages
    outer: OuterOptimizer = PLAIN_AVERAGE  # what a sync step does with the average (DiLoCo's outer SGD, or nothing)

    def __post_init__(self) -> None:
        if self.every < 1 or self.warmup < 0 or self.steps_per_epoch < 0 or self.total_steps < 0:
            raise ValueError(f"sync schedule every={self.every} warmup={self.warmup} steps_per_epoch="
                             f"{self.steps_per_epoch} total_steps={self.total_steps} is out of range")
        if self.outer.stepped and self.every <= 1:
            raise ValueError(f"outer optimizer {self.outer.name} needs every > 1 (a sync step to take it at)")

    @property
    def periodic(self) -> bool:
        """Whether any step of the run may be local (``every > 1``)."""
        return self.every > 1

    def kind(self, step: int) -> StepKind:
        """``exact``, ``local`` or ``sync`` for ``step``."""
        if is_exact_step(step, every=self.every, warmup=self.warmup):
            return EXACT
        if is_sync_step(step, every=self.every, warmup=self.warmup, steps_per_epoch=self.steps_per_epoch,
                        total_steps=self.total_steps):
            return SYNC
        return LOCAL

    def averaged_after(self, step: int) -> bool:
        """Whether every replica holds the same model after ``step`` (an exact or a sync step)."""
        return self.kind(step) != LOCAL

    def describe(self) -> str:
        """The mode in words, for notes and ``result.json``."""
        if not self.periodic:
            return "exact (gradients averaged every step)"
        if self.outer.stepped:
            return (f"DiLoCo, every {self.every} steps after {self.warmup} exact steps: "
                    f"{self.outer.describe()}")
        return f"local SGD, averaging every {self.every} steps after {self.warmup} exact steps"


__all__ = ["EXACT", "LOCAL", "SYNC", "StepKind", "SyncSchedule", "is_exact_step", "is_sync_step"]
