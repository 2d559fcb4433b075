"""The coordinator's replica takes Lightning's steps: fed the gradients a plain Lightning run computed,
it ends with that run's parameters, also when stopped mid-epoch and resumed from its state."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from edgefleet.coordinator.run.replica import Replica, ReplicaError
from edgefleet.workloads.fleet_trainer import TrainerOptions
from tests.conformance import reference
from tests.conformance.cases import CASES
from tests.conformance.reference import Case, case_data, load, relative_l2, state_of

STEPS, GLOBAL_BATCH, SEED = 20, 24, 3
# Schedulers by step and by epoch, clipping, a short accumulation window at every epoch's end.
NAMES = ("step_scheduler", "epoch_scheduler", "clip_norm", "accumulate", "lightning_import", "adam")


class _Gradients(pl.Callback):
    """Records the gradient every optimizer step of a Lightning run takes (before clipping, as the boards send it)."""

    def __init__(self) -> None:
        self.grads: list[np.ndarray] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy())


def _lightning_run(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, torch.Tensor], list[np.ndarray]]:
    recorder = _Gradients()
    original = reference.trainer_class

    def with_recorder(model: torch.nn.Module) -> Callable[..., Any]:
        trainer_type = original(model)
        return lambda **flags: trainer_type(callbacks=[recorder], **flags)

    monkeypatch.setattr(reference, "trainer_class", with_recorder)
    model, _ = reference.fit_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    return state_of(model), recorder.grads


def _replica(case: Case, seed: int) -> Replica:
    torch.manual_seed(seed)
    batches = len(case_data(case).train_set) // GLOBAL_BATCH
    return Replica(load(case.model)(**case.model_options), options=TrainerOptions(**case.trainer),
                   batches_per_epoch=batches, total_steps=STEPS)


@pytest.mark.parametrize("name", NAMES)
def test_the_replica_steps_as_lightning_does_and_resumes_mid_epoch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.name == name)
    expected, grads = _lightning_run(case, monkeypatch)
    assert len(grads) == STEPS
    first = _replica(case, SEED)
    for grad in grads[:7]:  # 7: mid-epoch for every case (5 or 10 batches an epoch)
        first.apply(grad)
    state = first.state_dict()
    first.close()
    resumed = _replica(case, seed=99)  # other initial weights: the state must bring back everything
    resumed.load_state_dict(state)
    for grad in grads[7:]:
        resumed.apply(grad)
    resumed.close()
    assert resumed.step == STEPS
    assert relative_l2(state_of(resumed.model), expected) <= 1e-6
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(_final_lr(case, monkeypatch))


def _final_lr(case: Case, monkeypatch: pytest.MonkeyPatch) -> float:
    model, _ = reference.fit_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    return float(model.trainer.optimizers[0].param_groups[0]["lr"])


def test_gradients_in_another_order_give_other_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.name == "step_scheduler")
    expected, grads = _lightning_run(case, monkeypatch)
    replica = _replica(case, SEED)
    for grad in reversed(grads):
        replica.apply(grad)
    replica.close()
    assert relative_l2(state_of(replica.model), expected) > 1e-3


def test_a_failing_hook_of_the_module_is_reported_not_hung() -> None:
    class Broken(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            raise ValueError("the module's own hook failed")

    replica = Replica(Broken(), batches_per_epoch=4, total_steps=10)
    with pytest.raises(ReplicaError, match="the module.s own hook failed"):
        replica.apply(np.zeros(3, dtype=np.float32))
    replica.close()


def test_the_fallback_validation_builds_no_graph() -> None:
    """A module without a validation_step is scored by ``Replica.evaluate``, under no_grad as Lightning validates:
    no autograd graph per batch, and no "requires_grad ... to a scalar" warning in the coordinator's output."""
    seen: list[bool] = []

    class NoValidation(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return self.layer(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    replica = Replica(NoValidation(), batches_per_epoch=4, total_steps=10)
    try:
        batches = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 1]))] * 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's warning for float() of a tensor in the graph fails the test
            figures = replica.evaluate(batches)
        assert figures is not None and seen == [False, False]
        loss, accuracy = figures
        assert loss > 0.0 and 0.0 <= accuracy <= 1.0
        assert torch.is_grad_enabled() and replica.model.training  # both as they were
    finally:
        replica.close()


def test_a_replica_that_may_lag_returns_before_its_step_is_done_and_drain_waits_for_it() -> None:
    release = threading.Event()

    class Slow(pl.LightningModule):
        """Its optimizer step waits for the test: an audit or a slow step on the coordinator."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            assert release.wait(timeout=60), "never released"

    replica = Replica(Slow(), batches_per_epoch=10, total_steps=10)
    try:
        assert replica.may_lag
        grad = np.ones(3, dtype=np.float32)
        replica.apply(grad, wait=False)
        replica.apply(grad, wait=False)
        grad[:] = 100.0  # the exchange reuses its buffer: the replica took a copy
        assert replica.step == 2  # both queued, neither done: the calls returned while the first one waits
        weights = replica.model.layer.weight.detach().clone()
        release.set()
        replica.drain()
        assert torch.allclose(replica.model.layer.weight, weights - 2 * 0.5 * torch.ones_like(weights))
    finally:
        release.set()
        replica.close()
