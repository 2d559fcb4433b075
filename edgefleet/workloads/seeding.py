"""Random generators seeded from the run, so that the same seed and split give the same run, bit for bit.

A module with dropout, or data with random augmentation, draws random numbers on every board. Each
draw must depend only on what the run is, not on when a process started or what it did before:
so before every batch each replica seeds torch's generators (all devices), numpy's and Python's
with a number made from the run's seed, its place in the split, the batch's number counted from
the start of training, and what the numbers are for (loading the batch's samples, or computing
the step). A rerun with the same seed and split draws the same numbers; so does a resumed run,
from the batch it resumes at, and a board that rejoins mid-run.

What this does not give: the same model across different splits. A board draws dropout masks
for its own slice from its own stream, so 8/16/24 on three boards and 48 on one board draw
different masks for the same sample: the runs are equally valid samples of the same training,
not the same bits. Without randomness (no dropout, no random augmentation) they are the same
within summation order, as the conformance tests check.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

DATA = "data"        # seeds a batch's sample loading (random augmentation)
COMPUTE = "compute"  # seeds a batch's forward and backward (dropout, random masks)
VALIDATION = "validation"
REPLICA_RANK = -1    # the coordinator's replica: not a board's place in the split


def seed_for(run_seed: int, rank: int, batch: int, purpose: str) -> int:
    """A 63-bit seed for ``purpose`` at batch ``batch`` (from the start of training) of the replica at ``rank``.

    A hash, not a sum: seeds of neighbouring batches or boards must not give correlated streams.
    """
    digest = hashlib.blake2b(struct.pack("<qqq", run_seed, rank, batch) + purpose.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@functools.cache
def _has_cuda() -> bool:
    """Whether torch has CUDA here (asked once: the question costs more than seeding)."""
    import torch  # torch: off the worker start

    return bool(torch.cuda.is_available())


def seed_generators(seed: int) -> None:
    """Seed torch (CPU and every GPU), numpy's global generator and Python's ``random`` with ``seed``.

    Why not ``torch.manual_seed``: it also seeds every other backend torch knows of and costs about
    0.3 ms on this host, twice a batch; the CPU generator alone costs microseconds (CUDA's only
    where there is CUDA).
    """
    # numpy, torch: off the worker start
    import numpy as np
    import torch  # torch: off the worker start

    torch.default_generator.manual_seed(seed)
    if _has_cuda():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class BatchSeeder:
    """Seeds the generators of one replica before each batch's loading and before each batch's step.

    Args:
        run_seed: The run's ``--seed``.
        rank: The board's place in the split (``board_index``), or :data:`REPLICA_RANK`.
        batches_per_epoch: Global batches per epoch (to count a batch from the start of training).
    """

    def __init__(self, run_seed: int, rank: int, batches_per_epoch: int) -> None:
        self.run_seed, self.rank, self.batches_per_epoch = run_seed, rank, batches_per_epoch

    def before_loading(self, batch: int) -> None:
        """For ``EpochBatchSampler(before_batch=...)``: batch ``batch``'s samples are loaded next."""
        seed_generators(seed_for(self.run_seed, self.rank, batch, DATA))

    def before_step(self, epoch: int, batch_idx: int) -> None:
        """Batch ``batch_idx`` of epoch ``epoch`` is about to run its forward pass."""
        seed_generators(seed_for(self.run_seed, self.rank, epoch * self.batches_per_epoch + batch_idx, COMPUTE))

    def before_validation(self, global_step: int) -> None:
        """The validation after optimizer step ``global_step`` starts."""
        seed_generators(seed_for(self.run_seed, self.rank, global_step, VALIDATION))


class StepSeeding:
    """Callback hooks (``workloads.lightning_api.callback_class``) that seed before every training batch and validation.

    Callbacks' ``on_train_batch_start`` run before the module's own, so the module's hook draws from
    the seeded stream too.
    """

    def __init__(self, seeder: BatchSeeder) -> None:
        self.seeder = seeder

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seeder.before_step(trainer.current_epoch, batch_idx)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.seeder.before_validation(trainer.global_step)


def loading_hook(seeder: BatchSeeder | None) -> Callable[[int], None] | None:
    """The sampler's ``before_batch`` for ``seeder`` (None: no seeding)."""
    return seeder.before_loading if seeder is not None else None


__all__ = ["COMPUTE", "DATA", "REPLICA_RANK", "VALIDATION", "BatchSeeder", "StepSeeding", "loading_hook", "seed_for",
           "seed_generators"]
