"""The module sees the run's figures and its setup hooks once, as in ``Trainer.fit``, before anything counts its parameters."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.fleet_trainer import TrainerOptions
from edgefleet.workloads.module_setup import RunFigures, attached, prepare_module
from edgefleet.workloads.preflight import check_trainable, optimizer_setup


class LateLayers(pl.LightningModule):
    """Builds its layer in configure_model and reads the trainer's figures in configure_optimizers (OneCycleLR)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: torch.nn.Linear | None = None
        self.calls: list[str] = []
        self.figures: tuple = ()

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def configure_model(self) -> None:
        self.calls.append("configure_model")
        if self.layer is None:
            self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        t = self.trainer
        self.figures = (t.max_epochs, t.max_steps, t.num_training_batches, t.accumulate_grad_batches,
                        t.estimated_stepping_batches)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=t.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize(("max_epochs", "expected"), [(0, (-1, 9, 5, 2, 9)), (3, (3, -1, 5, 2, 9))])
def test_configure_optimizers_sees_the_runs_figures(max_epochs: int, expected: tuple) -> None:
    model = LateLayers()
    figures = RunFigures(batches_per_epoch=5, total_steps=9, max_epochs=max_epochs,
                         options=TrainerOptions(accumulate_grad_batches=2))
    trainer = prepare_module(model, figures)
    setup = optimizer_setup(model, trainer)
    assert model.figures == expected and len(setup.schedulers) == 1
    assert model.calls == ["setup:fit", "configure_model"]
    model.setup("fit"), model.configure_model()  # what the replica's own Trainer.fit calls: done already
    assert model.calls == ["setup:fit", "configure_model"] and model._trainer is None


def test_layers_built_late_draw_what_trainer_fit_draws_right_after_the_constructor() -> None:
    torch.manual_seed(5)
    expected = torch.nn.Linear(4, 2).weight.detach().clone()
    torch.manual_seed(5)
    model = LateLayers()
    prepare_module(model, RunFigures(batches_per_epoch=5, total_steps=9))
    assert model.layer is not None and torch.equal(model.layer.weight, expected)


def test_a_module_that_builds_no_layer_is_told_where_layers_may_be_built() -> None:
    class NoLayers(LateLayers):
        def configure_model(self) -> None:
            pass

    model = NoLayers()
    trainer = prepare_module(model, RunFigures(batches_per_epoch=5, total_steps=9))
    with pytest.raises(ConfigError, match="setup or configure_model"):
        optimizer_setup(model, trainer)


def test_attached_leaves_a_module_with_a_trainer_alone() -> None:
    model = LateLayers()
    trainer = prepare_module(model, RunFigures(batches_per_epoch=5, total_steps=9))
    with attached(model, trainer):
        assert model.trainer is trainer
    assert model._trainer is None


# configure_callbacks: preflight calls it as Trainer.fit does, to name what it returns, and refuses that.


class WithCallbacks(LateLayers):
    """Returns ``callbacks`` from ``configure_callbacks`` (``"fails"``: raises), noting the Trainer it saw."""

    def __init__(self, callbacks) -> None:
        super().__init__()
        self.callbacks = callbacks
        self.seen = None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_callbacks(self):
        self.seen = self.trainer
        if self.callbacks == "fails":
            raise RuntimeError("no folder")
        return self.callbacks


@pytest.mark.parametrize(("callbacks", "words"), [
    ([pl.callbacks.EarlyStopping(monitor="val_acc", mode="max"), pl.callbacks.ModelCheckpoint(dirpath="unused")],
     ("returns EarlyStopping, ModelCheckpoint:", "--target-accuracy", "--checkpoint-every", "model.pt")),
    (pl.callbacks.EarlyStopping(monitor="val_loss"), ("returns EarlyStopping:", "on val_loss", "--epochs or --steps")),
    ([pl.callbacks.LearningRateMonitor()], ("returns LearningRateMonitor:", "remove LearningRateMonitor")),
    ("fails", ("is overridden (calling it here failed: RuntimeError: no folder)", "--target-accuracy",
               "--checkpoint-every", "remove any other callback")),
])
def test_callbacks_from_configure_callbacks_are_refused_naming_them(callbacks, words: tuple[str, ...]) -> None:
    model = WithCallbacks(callbacks)
    trainer = prepare_module(model, RunFigures(batches_per_epoch=5, total_steps=9))
    with pytest.raises(ConfigError, match=r"WithCallbacks\.configure_callbacks\(\)") as refused:
        check_trainable(model, trainer)
    assert all(word in str(refused.value) for word in words), str(refused.value)
    assert model.seen is trainer and model._trainer is None  # called as Trainer.fit calls it, then detached


@pytest.mark.parametrize("callbacks", [[], None])
def test_configure_callbacks_that_returns_none_passes(callbacks) -> None:
    model = WithCallbacks(callbacks)
    trainer = prepare_module(model, RunFigures(batches_per_epoch=5, total_steps=9))
    assert check_trainable(model, trainer).optimizer is not None and model.seen is trainer
