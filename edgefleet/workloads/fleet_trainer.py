"""The Lightning Trainer every replica runs: each board's and the coordinator's, with the same loop.

Every replica sees the same epochs as one process training on the global batches would: an
epoch is ``batches_per_epoch`` global batches (micro-batches when gradients are accumulated), the
optimizer steps after every ``accumulate_grad_batches`` of them and after an epoch's last one, and
Lightning steps the LR schedulers by its own rules (``interval``, ``frequency``) at the same
points on every replica. Steps are numbered globally: optimizer step ``s`` is at
:func:`position_of` ``(s)``.

A replica that starts mid-run (a resumed run, a board joining late) is put at its position in
Lightning's loop before the first batch (:class:`LoopPosition`): the epoch, the batch within the
epoch and the global step, so that ``current_epoch``, ``global_step``, ``batch_idx``, the
accumulation windows and the schedulers' frequencies continue as if it had run from the start.
That sets counters of Lightning's loops (2.x); :func:`check_loop_api` refuses an installed
Lightning whose loops lack them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import Sampler

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads import loss_scaling
from edgefleet.workloads.loss_scaling import LOSS_SCALED_PRECISIONS

log = logging.getLogger(__name__)

CLIP_ALGORITHMS = ("norm", "value")
# 16-mixed runs with DDP's rule (``workloads.loss_scaling``): one loss scale, a step skipped on every replica alike.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class TrainerOptions:
    """The Trainer flags of a job: the same on every board and on the coordinator's replica.

    Attributes:
        accumulate_grad_batches: Batches whose gradients are summed before each optimizer step.
        gradient_clip_val: Clip the averaged gradient (None: no clipping).
        gradient_clip_algorithm: ``"norm"`` (over all parameters) or ``"value"``.
        deterministic: ``torch.use_deterministic_algorithms`` on every replica.
        precision: Lightning's ``precision``: ``32-true``, ``bf16-mixed`` (autocast; fp32 weights and gradients) or
            ``16-mixed`` (float16 autocast and a loss scale, ``workloads.loss_scaling``).
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    deterministic: bool = False
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if self.accumulate_grad_batches < 1:
            raise ConfigError(f"accumulate_grad_batches = {self.accumulate_grad_batches} must be at least 1")
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            raise ConfigError(f"gradient_clip_val = {self.gradient_clip_val} must be above 0 (or not given: no clipping)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise ConfigError(f"gradient_clip_algorithm = {self.gradient_clip_algorithm!r} is not one of {CLIP_ALGORITHMS}")

    @property
    def loss_scaled(self) -> bool:
        """Whether a GradScaler scales the loss (16-mixed): the step's overflow decides on every replica alike."""
        return self.precision in LOSS_SCALED_PRECISIONS

    def trainer_kwargs(self, plugins: list[Any] | None = None) -> dict[str, Any]:
        """The Trainer's keyword arguments; ``plugins``: 16-mixed's precision plugin, which then replaces ``precision``."""
        kwargs: dict[str, Any] = {
            "accumulate_grad_batches": self.accumulate_grad_batches, "gradient_clip_val": self.gradient_clip_val,
            "gradient_clip_algorithm": self.gradient_clip_algorithm if self.gradient_clip_val else None,
            "deterministic": self.deterministic}
        if plugins:
            kwargs["plugins"] = plugins
        else:
            kwargs["precision"] = self.precision
        return kwargs


def steps_per_epoch(batches_per_epoch: int, accumulate: int) -> int:
    """Optimizer steps in an epoch of ``batches_per_epoch`` batches (Lightning steps on a short last window too)."""
    return math.ceil(batches_per_epoch / accumulate)


@dataclass(frozen=True)
class LoopPosition:
    """Where optimizer step ``global_step`` starts in Lightning's loop.

    Attributes:
        epoch: The epoch (``trainer.current_epoch``).
        batch: The first batch of the step's window, counted within the epoch.
        global_step: Optimizer steps taken before it (``trainer.global_step``).
        batches_per_epoch: Batches in every epoch.
    """

    epoch: int
    batch: int
    global_step: int
    batches_per_epoch: int

    @property
    def first_batch(self) -> int:
        """The window's first batch counted from the start of training (the data plan's step)."""
        return self.epoch * self.batches_per_epoch + self.batch


def position_of(step: int, batches_per_epoch: int, accumulate: int = 1) -> LoopPosition:
    """The loop position of optimizer step ``step``."""
    per_epoch = steps_per_epoch(batches_per_epoch, accumulate)
    epoch, window = divmod(step, per_epoch)
    return LoopPosition(epoch=epoch, batch=window * accumulate, global_step=step, batches_per_epoch=batches_per_epoch)


class _EpochSetter:
    """What Lightning calls ``set_epoch`` on: it looks at ``batch_sampler.sampler``, never at the batch sampler itself."""

    def __init__(self, owner: EpochBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class EpochBatchSampler(Sampler[list[int]]):
    """One epoch of a replica's batches per iteration; Lightning tells it the epoch (``set_epoch``).

    Batch ``j`` of epoch ``e`` is ``indices_of(e * batches_per_epoch + j)``. The first epoch
    iterated starts at ``start.batch`` (a replica that joins mid-epoch); ``len()`` is always the
    whole epoch, as Lightning counts the skipped batches as done (:class:`LoopPosition`).

    Args:
        indices_of: Maps a batch counted from the start of training to this replica's dataset indices.
        start: Where this replica starts.
        before_batch: Called with the batch's number (from the start of training) just before its
            samples are loaded: the data's random generators are seeded there (``workloads.seeding``),
            so a random augmentation draws the same whenever the batch is loaded (Lightning loads one
            batch ahead, and a resumed run loads its first batches before any step).
    """

    def __init__(self, indices_of: Callable[[int], list[int]], start: LoopPosition,
                 before_batch: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self._indices_of = indices_of
        self._before_batch = before_batch
        self.start = start
        self.batches_per_epoch = start.batches_per_epoch
        self.epoch = start.epoch
        self.sampler = _EpochSetter(self)  # Lightning calls set_epoch on a DataLoader's batch_sampler.sampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.start.batch if self.epoch == self.start.epoch else 0
        base = self.epoch * self.batches_per_epoch
        for batch in range(first, self.batches_per_epoch):
            indices = self._indices_of(base + batch)
            if self._before_batch is not None:
                self._before_batch(base + batch)
            yield indices

    def __len__(self) -> int:
        return self.batches_per_epoch


def check_loop_api(trainer: Any) -> None:
    """Refuse a Lightning whose loops lack the counters :class:`LoopPosition` sets.

    Raises:
        ConfigError: naming the installed version and the one edgefleet was tested with.
    """
    try:
        loop = trainer.fit_loop
        loop.epoch_progress.current.processed  # noqa: B018 - attribute checks
        loop.epoch_loop.batch_progress.current.ready  # noqa: B018
        loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed  # noqa: B018
        loop.epoch_loop._batches_that_stepped  # noqa: B018
    except AttributeError as exc:
        raise ConfigError(f"this Lightning's training loop has no {exc.name!r}: edgefleet positions a replica in "
                          "Lightning 2.x's loop (tested with 2.6); install pytorch-lightning>=2.1,<3") from None


class LoopPositioner:
    """Callback hooks that put a Trainer at ``position`` before its first batch (see the module doc)."""

    def __init__(self, position: LoopPosition) -> None:
        self.position = position

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        position = self.position
        if position.global_step == 0:
            return
        check_loop_api(trainer)
        loop = trainer.fit_loop
        for progress in (loop.epoch_progress.current, loop.epoch_progress.total):
            progress.ready = progress.started = progress.processed = progress.completed = position.epoch
        epoch_loop = loop.epoch_loop
        optimizer = epoch_loop.automatic_optimization.optim_progress.optimizer
        optimizer.step.total.ready = optimizer.step.total.completed = position.global_step
        zero_grad = optimizer.zero_grad.total
        zero_grad.ready = zero_grad.started = zero_grad.completed = position.global_step
        epoch_loop._batches_that_stepped = position.global_step
        if position.batch == 0:
            return
        reset = epoch_loop.reset

        def reset_then_skip() -> None:  # the epoch loop zeroes its batch counters when it starts: set them after
            reset()
            del epoch_loop.reset  # once: later epochs start at their first batch
            current, total = epoch_loop.batch_progress.current, epoch_loop.batch_progress.total
            current.ready = current.started = current.processed = current.completed = position.batch
            total.ready = total.started = total.processed = total.completed = position.first_batch

        epoch_loop.reset = reset_then_skip


def board_accelerator() -> str:
    """Where a board trains: its GPU when its torch has CUDA (a Jetson), else its CPU."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def trainer_bounds(total_steps: int, max_epochs: int = 0) -> dict[str, int]:
    """The Trainer's ``max_epochs``/``max_steps`` for a run of ``total_steps``: what the user asked for.

    A run asked for in whole epochs is ``Trainer(max_epochs=E)`` (``max_steps`` -1), one asked for
    in steps is ``Trainer(max_steps=N)`` (``max_epochs`` -1), so that a module reading
    ``self.trainer.max_epochs`` or ``estimated_stepping_batches`` sees what ``Trainer.fit`` would show.
    Both end after the same optimizer step.
    """
    if max_epochs > 0:
        return {"max_epochs": max_epochs, "max_steps": -1}
    return {"max_epochs": -1, "max_steps": total_steps}


def make_trainer(package: ModuleType, *, options: TrainerOptions, total_steps: int, callbacks: list[Any],
                 accelerator: str, logger: Any = False, validate: bool = False, log_every_n_steps: int = 50,
                 max_epochs: int = 0, precision_plugin: Any = None) -> Any:
    """A replica's Trainer: no checkpoints, progress bar or sanity checks of its own (edgefleet keeps those).

    ``max_epochs`` > 0: the run was asked for in that many whole epochs (:func:`trainer_bounds`).
    ``precision_plugin``: 16-mixed's (``workloads.loss_scaling.precision_plugin``, at the fleet's loss scale);
    None with 16-mixed: one with a fresh scaler.
    """
    if options.loss_scaled and precision_plugin is None:
        precision_plugin = loss_scaling.precision_plugin(package, accelerator, loss_scaling.new_scaler(accelerator))
    return package.Trainer(accelerator=accelerator, devices=1, **trainer_bounds(total_steps, max_epochs), logger=logger,
                           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                           num_sanity_val_steps=0, limit_val_batches=1.0 if validate else 0,
                           use_distributed_sampler=False, callbacks=callbacks, log_every_n_steps=log_every_n_steps,
                           **options.trainer_kwargs([precision_plugin] if options.loss_scaled else None))


__all__ = [
    "CLIP_ALGORITHMS",
    "PRECISIONS",
    "EpochBatchSampler",
    "LoopPosition",
    "LoopPositioner",
    "TrainerOptions",
    "board_accelerator",
    "check_loop_api",
    "make_trainer",
    "position_of",
    "steps_per_epoch",
    "trainer_bounds",
]
