"""What a user's LightningModule asks of training, checked before any board starts.

edgefleet trains a module with DDP's mathematics: every board and the coordinator's replica take
the same optimizer step with the fleet's averaged gradient, and Lightning steps the schedulers
the same way on each of them. A feature that cannot be honoured exactly is refused here, naming
the feature and what to do instead, so that nothing different is ever trained in silence.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.lightning_api import installed_packages, overrides, package_of
from edgefleet.workloads.module_audit import audit_training_metrics

log = logging.getLogger(__name__)


@dataclass
class OptimizerSetup:
    """The module's one optimizer and its LR scheduler configs, as Lightning parses ``configure_optimizers()``.

    Attributes:
        optimizer: The optimizer; its ``param_groups`` fix the order of the exchanged gradient.
        schedulers: Lightning's ``LRSchedulerConfig`` of each scheduler (interval, frequency, monitor).
    """

    optimizer: torch.optim.Optimizer
    schedulers: list[Any]


@contextlib.contextmanager
def _attached_trainer(model: Any, trainer: Any = None) -> Iterator[None]:
    """A never-fitted Trainer attached while ``configure_optimizers`` runs: ``trainer``, else a bare one of the module's package.

    Modules may read ``self.trainer`` there (e.g. ``estimated_stepping_batches``): a run passes the
    Trainer of ``workloads.module_setup.prepare_module``, which carries the run's figures; without a
    Trainer Lightning refuses to parse the optimizers at all.
    """
    if model._trainer is not None:
        yield
        return
    if trainer is not None:
        model.trainer = trainer
        try:
            yield
        finally:
            model.trainer = None
        return
    package = package_of(model)
    quiet = logging.getLogger(package.__name__)
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # no "GPU available: ..." banner for a Trainer that never runs
    try:
        model.trainer = package.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                        enable_model_summary=False, devices=1)
    finally:
        quiet.setLevel(level)
    try:
        yield
    finally:
        model.trainer = None


def optimizer_setup(model: Any, trainer: Any = None) -> OptimizerSetup:
    """The module's optimizer and schedulers, every return form of ``configure_optimizers`` understood.

    ``trainer``: what ``self.trainer`` is meanwhile (``workloads.module_setup.prepare_module``'s, with the
    run's figures); None attaches a bare Trainer (profiling, where no run exists yet).

    Raises:
        ConfigError: manual optimization, no optimizer, or more than one.
    """
    if not model.automatic_optimization:
        raise ConfigError("the module uses manual optimization (self.automatic_optimization = False): edgefleet "
                          "exchanges gradients between backward and Lightning's optimizer step, which manual "
                          "optimization does not have; use automatic optimization (return the loss from training_step)")
    optimizer_module = __import__(f"{package_of(model).__name__}.core.optimizer", fromlist=["_"])
    try:
        with _attached_trainer(model, trainer), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers, schedulers = optimizer_module._init_optimizers_and_lr_schedulers(model)
    except ConfigError:
        raise
    except Exception as exc:
        message = str(exc)
        if "multiple optimizers" in message or "automatic optimization" in message:
            raise _several_optimizers(None) from None
        if "empty parameter list" in message:
            raise ConfigError(f"configure_optimizers() found no parameters ({message}): edgefleet ran the module's "
                              "setup('fit') and configure_model() first, as Trainer.fit does, and neither built a "
                              "layer with parameters; build the layers in __init__, setup or configure_model") from exc
        raise ConfigError(f"configure_optimizers() failed: {type(exc).__name__}: {message}") from exc
    if len(optimizers) != 1:
        raise _several_optimizers(len(optimizers))
    optimizer = optimizers[0]
    if type(optimizer).__name__ == "_MockOptimizer":
        raise ConfigError("configure_optimizers() returned None: the module has no optimizer to train with")
    return OptimizerSetup(optimizer=optimizer, schedulers=list(schedulers))


def _several_optimizers(count: int | None) -> ConfigError:
    return ConfigError(f"configure_optimizers() returns {count or 'several'} optimizers: edgefleet trains with "
                       "exactly one (Lightning's automatic optimization does too); put the parameter groups into one "
                       "optimizer, e.g. torch.optim.Adam([{'params': a.parameters()}, {'params': b.parameters(), "
                       "'lr': 1e-4}])")


_CALLBACK_KINDS = ("EarlyStopping", "ModelCheckpoint")  # Lightning's callbacks the fleet has its own way for
_CALLBACKS_ADVICE = ("instead of EarlyStopping on a validation accuracy, edge-coordinator train --target-accuracy "
                     "FRACTION; instead of ModelCheckpoint, the run's own checkpoints (--checkpoint-every) and model.pt; "
                     "remove any other callback")


def _callback_kind(callback: Any) -> str | None:
    """``EarlyStopping`` or ``ModelCheckpoint`` for those Lightning callbacks (or subclasses, either package), else None."""
    for kind in _CALLBACK_KINDS:
        if any(isinstance(callback, getattr(package.callbacks, kind)) for package in installed_packages()):
            return kind
    return None


def _callback_advice(callbacks: list[Any]) -> str:
    """What to do instead of each callback, in their order, each said once."""
    advice: list[str] = []
    others: list[str] = []
    for callback in callbacks:
        kind, name = _callback_kind(callback), type(callback).__name__
        monitor = str(getattr(callback, "monitor", None) or "")
        if kind == "EarlyStopping" and "acc" in monitor.lower():
            advice.append(f"instead of {name} on {monitor}, edge-coordinator train --target-accuracy FRACTION (the run "
                          "stops after the first epoch whose validation accuracy reaches it)")
        elif kind == "EarlyStopping":
            advice.append(f"instead of {name}{f' on {monitor}' if monitor else ''}, a fixed --epochs or --steps "
                          "(edge-coordinator train --target-accuracy stops a run on a validation accuracy)")
        elif kind == "ModelCheckpoint":
            advice.append(f"instead of {name}, the run's own checkpoints (checkpoint.pt every --checkpoint-every "
                          "steps) and model.pt")
        else:
            others.append(name)
    if others:
        advice.append(f"remove {', '.join(dict.fromkeys(others))}")
    return "; ".join(dict.fromkeys(advice))


def _check_no_module_callbacks(model: Any, trainer: Any = None) -> None:
    """Refuse a module whose ``configure_callbacks`` returns callbacks (an override that returns none passes).

    Lightning adds them to every Trainer that fits the module: every board's and the replica's. The
    method is called as ``Trainer.fit`` calls it (after setup, ``self.trainer`` attached), only to name them.
    """
    if not overrides(model, "configure_callbacks"):
        return
    name = f"{type(model).__qualname__}.configure_callbacks()"
    why = ("Lightning adds the callbacks it returns to every Trainer that fits the module, here every board's and "
           "the coordinator's replica's, where they would see other figures than under Trainer.fit (an EarlyStopping "
           "would end the replica's or a board's Trainer on its own, a ModelCheckpoint would write files on every board)")
    try:
        with _attached_trainer(model, trainer), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            returned = model.configure_callbacks()
    except Exception as exc:  # the callbacks cannot be named: the method is
        raise ConfigError(f"{name} is overridden (calling it here failed: {type(exc).__name__}: {exc}): {why}. "
                          f"Leave configure_callbacks out for the fleet run: {_CALLBACKS_ADVICE}") from None
    if not returned:
        return
    callbacks = list(returned) if isinstance(returned, Sequence) else [returned]  # one Callback: as Lightning takes it
    names = ", ".join(dict.fromkeys(type(callback).__name__ for callback in callbacks))
    raise ConfigError(f"{name} returns {names}: {why}. Leave configure_callbacks out for the fleet run: "
                      f"{_callback_advice(callbacks)}")


def check_trainable(model: Any, trainer: Any = None) -> OptimizerSetup:
    """Refuse what the fleet cannot train exactly; the module's optimizer setup otherwise (``trainer``: as :func:`optimizer_setup`).

    Raises:
        ConfigError: naming the feature and what to do instead.
    """
    audit_training_metrics(model)  # a torchmetrics Metric on the boards' side would be logged from one slice
    setup = optimizer_setup(model, trainer)
    if isinstance(setup.optimizer, torch.optim.LBFGS):
        raise ConfigError("the optimizer is LBFGS, which evaluates the loss several times per step; every board "
                          "would exchange a gradient at each evaluation. Use a first-order optimizer (SGD, Adam, ...)")
    _check_no_module_callbacks(model, trainer)
    return setup


__all__ = ["OptimizerSetup", "check_trainable", "optimizer_setup"]
