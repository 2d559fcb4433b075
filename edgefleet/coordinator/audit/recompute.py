"""One board's vector for one step, computed again on the coordinator's replica (global data mode).

The replica holds the model every board holds at the start of step ``s`` while it waits for step
``s``'s average (``coordinator.run.replica``: its Trainer sits in ``on_before_optimizer_step``),
and the coordinator holds the data, the split and the seeds. So board ``i``'s vector for step ``s``
can be made again there, as the board made it (``agent.worker`` and ``agent.worker_exchange``):

* the slice: ``GlobalBatchPlan(...).with_split(sizes at s).indices(s, i)``, its samples loaded after
  the data's generators are seeded for that batch at rank ``i`` (``workloads.seeding``) and
  collated with the run's collate function, then sent through the batch-transfer hooks;
* the step: the generators seeded for the batch's compute at rank ``i``; the module's own
  ``training_step`` (the class's: the replica's instance holds a stand-in) under the replica's
  Trainer (``global_step``, ``current_epoch`` and the rest are the board's), with ``self.log``
  dropped; ``loss.backward()``;
* the vector: the gradients in the exchange's order (``workloads.params.gradient_order``), then the
  buffers as the forward pass left them (``workloads.params.BufferSet``).

Nothing of the replica changes: its buffers, gradients and random generators (torch, numpy,
Python's) are put back as they were, and the module's ``training_step`` is known to store nothing on
the module (``coordinator.audit.audit_scope``).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgefleet.workloads.params import BufferSet, flatten_grads
from edgefleet.workloads.seeding import BatchSeeder
from edgefleet.workloads.sharding import GlobalBatchPlan

log = logging.getLogger(__name__)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while a board's step is computed again: what the board logged went with its vector."""


@dataclass(frozen=True)
class AuditData:
    """The run's training data as the coordinator holds it, and how it is divided (global data mode).

    Attributes:
        dataset: The training set (every board's, in global data mode).
        collate_fn: The run's collate function.
        plan: The run's global batches (its initial split; a step's own split is asked for).
        seed: The run's seed (the boards' generators are seeded from it, by rank).
        batches_per_epoch: Global batches per epoch.
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    plan: GlobalBatchPlan
    seed: int
    batches_per_epoch: int


@contextlib.contextmanager
def kept_generators() -> Iterator[None]:
    """Run the block with torch's, numpy's and Python's global generators put back as they were afterwards."""
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def recompute_vector(model: Any, exchanged: list[torch.nn.Parameter], data: AuditData, *, step: int,
                     board_index: int, batch_sizes: list[int]) -> np.ndarray:
    """Board ``board_index``'s vector for ``step`` (gradient in ``exchanged``'s order, then buffers), on ``model``.

    Call it in the replica's Trainer thread while the Trainer waits for ``step``'s average (the model
    holds the parameters and buffers every board started ``step`` with). ``batch_sizes``: every board's
    batch at ``step``.
    """
    buffers = BufferSet(model)
    grad_elements = sum(p.numel() for p in exchanged)
    out = np.zeros(grad_elements + buffers.elements, dtype=np.float32)
    indices = data.plan.with_split(batch_sizes).indices(step, board_index)
    seeder = BatchSeeder(data.seed, board_index, data.batches_per_epoch)
    epoch, batch_idx = divmod(step, data.batches_per_epoch)
    kept_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    kept_grads = [p.grad for p in exchanged]
    kept_log = {name: model.__dict__[name] for name in ("log", "log_dict") if name in model.__dict__}
    try:
        with kept_generators(), torch.enable_grad():
            seeder.before_loading(step)
            batch = data.collate_fn([data.dataset[i] for i in indices])
            batch = type(model)._on_before_batch_transfer(model, batch, 0)
            batch = type(model)._apply_batch_transfer_handler(model, batch, torch.device("cpu"), 0)
            seeder.before_step(epoch, batch_idx)
            for p in exchanged:
                p.grad = None
            model.log = model.log_dict = _no_log
            output = type(model).training_step(model, batch, batch_idx)
            loss = output.get("loss") if isinstance(output, dict) else output
            if isinstance(loss, torch.Tensor):
                torch.autograd.backward(loss)
            flatten_grads(exchanged, out[:grad_elements])
            if buffers:
                buffers.flatten_into(out[grad_elements:])
    finally:
        for name in ("log", "log_dict"):
            model.__dict__.pop(name, None)
        model.__dict__.update(kept_log)
        for p, grad in zip(exchanged, kept_grads):
            p.grad = grad
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(kept_buffers[name])
    return out


__all__ = ["AuditData", "kept_generators", "recompute_vector"]
