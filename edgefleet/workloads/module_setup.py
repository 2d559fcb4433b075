"""What ``Trainer.fit`` does to a module before its first step, done once on every replica with the run's figures.

``Trainer.fit`` calls the module's ``setup("fit")``, then ``configure_model()``, then
``configure_optimizers()``, with ``self.trainer`` the Trainer of the whole run: its
``max_epochs``, ``max_steps``, ``num_training_batches``, ``accumulate_grad_batches`` and
``estimated_stepping_batches`` are the run's (Lightning's documented OneCycleLR reads the last
one). edgefleet needs the module's parameters before any Trainer of a replica runs (to count the
exchanged vector, to hand a joining board the coordinator's weights), so :func:`prepare_module`
calls ``setup`` and ``configure_model`` once, right after the module is built, with a Trainer that
carries the run's figures (:class:`RunFigures`) and the run's DataModule. The module's instance
then skips them when the replica's own ``Trainer.fit`` would call them again: they ran once, as in
``Trainer.fit``, and layers built there keep the weights the coordinator drew (seeded as
``Trainer.fit`` after ``torch.manual_seed`` would draw them) and handed to the boards.

:func:`attach_datamodule_hooks` gives a replica's Trainer the run's DataModule, so that Lightning
takes ``on_before_batch_transfer``, ``transfer_batch_to_device`` and ``on_after_batch_transfer``
from the DataModule where it overrides them, else from the module, exactly as ``Trainer.fit(model,
datamodule=dm)`` does, although the batches come from the fleet's sampler.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from edgefleet.workloads.fleet_trainer import EpochBatchSampler, TrainerOptions, make_trainer, position_of
from edgefleet.workloads.lightning_api import overrides, package_of

log = logging.getLogger(__name__)

SETUP_HOOKS = ("setup", "configure_model")


@dataclass(frozen=True)
class RunFigures:
    """The figures of a run that a module may read from ``self.trainer`` before and during training.

    Attributes:
        batches_per_epoch: Global batches in an epoch (``trainer.num_training_batches``).
        total_steps: Optimizer steps of the whole run.
        max_epochs: The run's whole epochs when it was asked for in epochs, else 0 (asked for in steps).
        options: The run's Trainer flags (``accumulate_grad_batches`` among them).
    """

    batches_per_epoch: int
    total_steps: int
    max_epochs: int = 0
    options: TrainerOptions = field(default_factory=TrainerOptions)


class Placeholders(Dataset[int]):
    """Samples that stand for the run's global batches where a Trainer needs batches but not the data:
    the figures Trainer (it never fits) and the replica's (the boards hold the data); every batch is ``[0]``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def figures_trainer(model: Any, figures: RunFigures, datamodule: Any = None) -> Any:
    """A Trainer of the module's package that reports the run's figures and is never fitted.

    Its train loader has ``batches_per_epoch`` batches of placeholders, so that
    ``num_training_batches`` and ``estimated_stepping_batches`` are the run's.
    """
    package = package_of(model)
    quiet = logging.getLogger(package.__name__)
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # no "GPU available: ..." banner for a Trainer that never runs
    # Loading its placeholder batches draws from torch's generator (a DataLoader's base seed): the layers that
    # setup/configure_model build next must draw what they draw in Trainer.fit, right after the constructor.
    rng = torch.get_rng_state()
    before = model._trainer  # connecting the Trainer attaches it to the module: only attached() does, for a while
    try:
        # CPU on every machine: this Trainer only answers questions and never fits; the board's own Trainer
        # trains on its GPU where it has one (fleet_trainer.board_accelerator)
        trainer = make_trainer(package, options=figures.options, total_steps=figures.total_steps, callbacks=[],
                               accelerator="cpu", max_epochs=figures.max_epochs)
        loader = DataLoader(Placeholders(1), batch_sampler=EpochBatchSampler(
            lambda batch: [0], position_of(0, figures.batches_per_epoch, figures.options.accumulate_grad_batches)))
        trainer._data_connector.attach_data(model, train_dataloaders=loader)
        trainer.datamodule = datamodule  # not attach_datamodule: its train_dataloader() is not the run's batches
        trainer.strategy.connect(model)
        trainer.state.fn = package.trainer.states.TrainerFn.FITTING
        trainer.training = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "does not have many workers": it loads nothing
            trainer.fit_loop.setup_data()
    finally:
        quiet.setLevel(level)
        torch.set_rng_state(rng)
        model.trainer = before
    return trainer


@contextlib.contextmanager
def attached(model: Any, trainer: Any) -> Iterator[None]:
    """``model.trainer`` is ``trainer`` inside the block (unless the module has a Trainer already)."""
    if model._trainer is not None:
        yield
        return
    model.trainer = trainer
    try:
        yield
    finally:
        model.trainer = None


def _skip_setup(stage: str) -> None:
    """The module's ``setup`` ran once already (:func:`prepare_module`)."""


def _skip_configure_model() -> None:
    """The module's ``configure_model`` ran once already (:func:`prepare_module`)."""


def prepare_module(model: Any, figures: RunFigures, datamodule: Any = None) -> Any:
    """Run the module's ``setup("fit")`` and ``configure_model()`` once, as ``Trainer.fit`` would; the figures Trainer.

    The module's instance skips both afterwards (its class is not changed). Call it right after
    building the module, before counting its parameters or loading a state into it.

    Raises:
        Whatever the module's hooks raise (the caller reports it as the module's error).
    """
    trainer = figures_trainer(model, figures, datamodule)
    with attached(model, trainer):
        if overrides(model, "setup"):
            model.setup("fit")
        if overrides(model, "configure_model"):
            with torch.device("cpu"):  # built where the coordinator draws the weights every board then loads
                model.configure_model()
    model.setup = _skip_setup
    model.configure_model = _skip_configure_model
    return trainer


class DataModuleHooks:
    """Callback hooks that give a replica's Trainer the run's DataModule for the batch-transfer hooks.

    ``trainer.fit(model, train_dataloaders=...)`` takes those hooks from the module only; with the
    DataModule attached Lightning picks each from the DataModule where it overrides it (as
    ``Trainer.fit(model, datamodule=dm)``). The DataModule's ``setup`` ran when the data was
    loaded, so it is not called again.
    """

    def __init__(self, datamodule: Any) -> None:
        self.datamodule = datamodule

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        connector = trainer._data_connector
        selector = type(connector._datahook_selector)
        connector._datahook_selector = selector(pl_module, self.datamodule)
        trainer.datamodule = self.datamodule
        self.datamodule.trainer = trainer


__all__ = ["SETUP_HOOKS", "DataModuleHooks", "Placeholders", "RunFigures", "attached", "figures_trainer",
           "prepare_module"]
