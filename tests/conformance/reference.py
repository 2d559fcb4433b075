"""The reference for correctness: the same module trained by plain single-process Lightning.

``lightning_reference`` fits a case with ``Trainer.fit`` on one CPU process, feeding it the
global batches edgefleet's fleet is meant to see: epoch ``e`` visits the samples in the
order ``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))``, cut into
``n // global_batch`` batches (the incomplete last block is dropped). This file is
independent of edgefleet's code on purpose.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch
import pytorch_lightning
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

VAL_BATCH = 64


@dataclass
class Case:
    """One conformance case: a module, its training data and the Trainer flags it uses."""

    name: str
    model: str  # "tests.conformance.modules:OwnCtorNet"
    model_options: dict = field(default_factory=dict)
    dataset: str | None = None  # "tests.conformance.data:make_classification"
    dataset_options: dict = field(default_factory=dict)
    datamodule: str | None = None  # "tests.conformance.data:ClassificationDataModule"
    datamodule_options: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)  # {"gradient_clip_val": 0.5, ...}

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.datamodule is None):
            raise ValueError(f"case {self.name!r}: give exactly one of dataset and datamodule")


def load(spec: str) -> Any:
    """The object named by ``"package.module:Name"``."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class EpochPermutation(Sampler[int]):
    """All ``n`` indices in epoch ``e``'s order: ``randperm(n)`` seeded with ``seed + e``."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class GlobalBatchSampler(Sampler[list[int]]):
    """One epoch of global batches: block ``k`` is positions ``[k*B, (k+1)*B)`` of the epoch's order.

    Lightning calls ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler``,
    not on the batch sampler itself, so the permutation lives in ``self.sampler``;
    ``set_epoch`` here forwards to it for callers that use the batch sampler directly.
    """

    def __init__(self, n: int, global_batch: int, seed: int) -> None:
        if global_batch <= 0 or n < global_batch:
            raise ValueError(f"need 0 < global_batch <= n, got global_batch={global_batch}, n={n}")
        self.sampler = EpochPermutation(n, seed)
        self.global_batch = global_batch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        for k in range(len(self)):
            yield order[k * self.global_batch:(k + 1) * self.global_batch]

    def __len__(self) -> int:
        return self.sampler.n // self.global_batch


@dataclass
class CaseData:
    """What a case trains and validates on."""

    train_set: Dataset
    collate_fn: Callable
    val_loader: Callable[[], DataLoader]  # built only when the module validates


def case_data(case: Case) -> CaseData:
    """The case's training data and collate_fn, and a maker of its validation loader."""
    if case.dataset is not None:
        factory = load(case.dataset)

        def val_loader() -> DataLoader:
            return DataLoader(factory(split="val", **case.dataset_options), batch_size=VAL_BATCH,
                              collate_fn=default_collate)

        return CaseData(factory(split="train", **case.dataset_options), default_collate, val_loader)
    dm = load(case.datamodule)(**case.datamodule_options)
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    return CaseData(loader.dataset, loader.collate_fn, dm.val_dataloader)


def overrides(model: torch.nn.Module, hook: str) -> bool:
    """Whether the user's class (not Lightning's base class) defines ``hook``."""
    for klass in type(model).__mro__:
        if klass.__module__.split(".")[0] in ("pytorch_lightning", "lightning"):
            return False
        if hook in vars(klass):
            return True
    return False


def trainer_class(model: torch.nn.Module) -> type:
    """``pytorch_lightning.Trainer`` for a ``pytorch_lightning`` module, else ``lightning.pytorch.Trainer``."""
    if isinstance(model, pytorch_lightning.LightningModule):
        return pytorch_lightning.Trainer
    return lightning.pytorch.Trainer


def fit_reference(case: Case, *, steps: int, global_batch: int, seed: int,
                  callbacks: list | None = None) -> tuple[torch.nn.Module, DataLoader]:
    """Fits the case with plain Lightning; returns the trained module and its training loader.

    A DataModule case is fitted with ``datamodule=`` (its ``train_dataloader`` replaced, on the instance,
    by the global-batch loader), so that Lightning calls the DataModule's batch-transfer hooks on the
    training and validation batches, as it does for a user's run.
    """
    data = case_data(case)
    torch.manual_seed(seed)
    model = load(case.model)(**case.model_options)
    loader = DataLoader(data.train_set, batch_sampler=GlobalBatchSampler(len(data.train_set), global_batch, seed),
                        collate_fn=data.collate_fn, num_workers=0)
    # The reference is plain single-process Lightning on this machine's CPU, by definition (not a board).
    flags: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    if callbacks:
        flags["callbacks"] = callbacks
    validate = overrides(model, "validation_step")
    if not validate:
        flags["limit_val_batches"] = 0
    flags.update(case.trainer)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    try:
        trainer = trainer_class(model)(**flags)
        if case.datamodule is None:
            trainer.fit(model, train_dataloaders=loader, val_dataloaders=data.val_loader() if validate else None)
        else:
            datamodule = load(case.datamodule)(**case.datamodule_options)
            datamodule.train_dataloader = lambda: loader
            trainer.fit(model, datamodule=datamodule)
    finally:
        # Trainer(deterministic=True) switches torch's global flag on and leaves it on.
        torch.use_deterministic_algorithms(deterministic_before)
    return model, loader


@dataclass
class ReferenceRun:
    """What plain Lightning ends with: the module's state and the values it logged (``trainer.callback_metrics``)."""

    state: dict[str, torch.Tensor]
    metrics: dict[str, float]


def lightning_run(case: Case, *, steps: int, global_batch: int, seed: int) -> ReferenceRun:
    """``lightning_reference``'s state together with the metrics Lightning reports after ``fit``."""
    model, _ = fit_reference(case, steps=steps, global_batch=global_batch, seed=seed)
    metrics = {name: float(value) for name, value in model.trainer.callback_metrics.items()}
    return ReferenceRun(state_of(model), metrics)


def lightning_reference(case: Case, *, steps: int, global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The module's ``state_dict`` after ``steps`` optimizer steps of plain Lightning (CPU clones)."""
    model, _ = fit_reference(case, steps=steps, global_batch=global_batch, seed=seed)
    return state_of(model)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model.state_dict()``."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def build_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Builds the layers a module makes in ``setup("fit")`` or ``configure_model()``, in Lightning's order, as
    ``fit`` does before ``configure_optimizers`` (no Trainer: hooks that read ``self.trainer`` do not fit here)."""
    if overrides(model, "setup"):
        model.setup("fit")
    if overrides(model, "configure_model"):
        model.configure_model()
    return model


def initial_state(case: Case, *, seed: int) -> dict[str, torch.Tensor]:
    """The case's module as constructed (after ``torch.manual_seed(seed)``) and built, before any training."""
    torch.manual_seed(seed)
    return state_of(build_layers(load(case.model)(**case.model_options)))


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over the floating-point tensors of ``b`` (parameters and float buffers)."""
    diff = norm = 0.0
    for key, ref in b.items():
        if not torch.is_floating_point(ref):
            continue
        ref64 = ref.detach().double()
        diff += float((a[key].detach().double() - ref64).pow(2).sum())
        norm += float(ref64.pow(2).sum())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / norm)


def integer_mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``b``'s integer (and bool) tensors that ``a`` lacks or holds with another value, dtype or shape."""
    return [key for key, ref in b.items() if not torch.is_floating_point(ref) and not ref.is_complex()
            and (key not in a or a[key].dtype != ref.dtype or not torch.equal(a[key].cpu(), ref))]


def global_batches(sampler: GlobalBatchSampler, steps: int) -> Iterator[tuple[int, list[int]]]:
    """``steps`` global batches from ``sampler`` as (batch within its epoch, sample indices), epoch after epoch."""
    step = 0
    while True:
        for batch_idx, indices in enumerate(sampler):
            if step == steps:
                return
            yield batch_idx, indices
            step += 1
        sampler.set_epoch(sampler.epoch + 1)


def ddp_reference(case: Case, *, steps: int, batch_sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    """DDP's rule for a module with BatchNorm, in one process: the reference where a split batch cannot match a whole one.

    Each step every rank r normalises with the statistics of its own slice (``batch_sizes[r]``
    consecutive samples of the global batch) and starts its forward with rank 0's buffers (DDP
    broadcasts them from rank 0 before every forward); the gradients are averaged weighted by
    the slices' sizes; afterwards every rank holds rank 0's buffers. That holds for integer buffers
    too: ``num_batches_tracked`` counts one per step. Plain torch, SGD-like optimizers from
    ``configure_optimizers`` returning one optimizer, no schedulers.
    """
    data = case_data(case)
    torch.manual_seed(seed)
    model = build_layers(load(case.model)(**case.model_options))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer), "ddp_reference takes a bare optimizer"
    total = sum(batch_sizes)
    sampler = GlobalBatchSampler(len(data.train_set), total, seed)
    buffers = [b for _, b in model.named_buffers()]  # DDP broadcasts every buffer, num_batches_tracked too
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for batch_idx, indices in global_batches(sampler, steps):
        rank0 = [b.detach().clone() for b in buffers]
        after_rank0: list[torch.Tensor] = []
        summed = [torch.zeros_like(p) for p in params]
        start = 0
        for rank, size in enumerate(batch_sizes):
            for buffer, value in zip(buffers, rank0):
                buffer.data.copy_(value)
            batch = data.collate_fn([data.train_set[i] for i in indices[start:start + size]])
            model.zero_grad(set_to_none=True)
            model.training_step(batch, batch_idx).backward()
            for acc, p in zip(summed, params):
                acc.add_(p.grad, alpha=size / total)
            if rank == 0:
                after_rank0 = [b.detach().clone() for b in buffers]
            start += size
        for p, grad in zip(params, summed):
            p.grad = grad
        for buffer, value in zip(buffers, after_rank0):
            buffer.data.copy_(value)
        optimizer.step()
    return state_of(model)


@dataclass
class AmpReference:
    """DDP's rule under 16-mixed: the final state, the steps every rank skipped, and the scaler's state at the end."""

    state: dict[str, torch.Tensor]
    skipped: list[int]
    scaler: dict[str, Any]


def ddp_amp_reference(case: Case, *, steps: int, batch_sizes: list[int], seed: int) -> AmpReference:
    """DDP with ``precision="16-mixed"`` in one process (on this machine's CPU: torch's float16 autocast and GradScaler).

    Each rank computes its slice's loss under float16 autocast (as Lightning's ``MixedPrecision``
    does, without the autocast cache), scales it by the one shared scale and runs backward; the
    scaled gradients are averaged weighted by the slices' sizes (DDP's all-reduce); the scaler
    unscales the average, skips the step if any element is not finite (an overflow on any rank)
    and updates the scale, the same on every rank. Plain torch, one optimizer, no schedulers.
    """
    data = case_data(case)
    torch.manual_seed(seed)
    model = build_layers(load(case.model)(**case.model_options))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer), "ddp_amp_reference takes a bare optimizer"
    scaler = torch.amp.GradScaler("cpu")
    total = sum(batch_sizes)
    sampler = GlobalBatchSampler(len(data.train_set), total, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    skipped: list[int] = []
    model.train()
    for step, (batch_idx, indices) in enumerate(global_batches(sampler, steps)):
        summed = [torch.zeros_like(p) for p in params]
        start = 0
        for size in batch_sizes:
            batch = data.collate_fn([data.train_set[i] for i in indices[start:start + size]])
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = model.training_step(batch, batch_idx)
            scaler.scale(loss).backward()
            for acc, p in zip(summed, params):
                acc.add_(p.grad, alpha=size / total)
            start += size
        for p, grad in zip(params, summed):
            p.grad = grad
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
    return AmpReference(state_of(model), skipped, scaler.state_dict())
