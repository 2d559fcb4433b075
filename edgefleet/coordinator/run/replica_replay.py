"""Which of a module's training hooks need what ``training_step`` produced, and the replica's replay of it.

The coordinator's replica runs the module's hooks in its own Trainer but computes no gradient: its
``training_step`` does nothing, and its batches are placeholders. That is exact for hooks that only
look at the model (an EMA of the weights in ``on_train_batch_end``, a schedule), but a hook that
reads the batch, ``training_step``'s outputs, or what ``training_step`` stored on the module (the
Lightning 2.x pattern: ``self.training_step_outputs.append(loss)`` in ``training_step``, stacked in
``on_train_epoch_end``) would see nothing, or crash the run.

For such a module the replica *replays* ``training_step``: its batches are the run's real global
batches, and its ``training_step`` runs the module's own forward on them under ``torch.no_grad``
(no backward: the boards' averaged gradient is what the optimizer takes). The hooks then get what
``Trainer.fit`` gives them on the same global batch: the batch, the outputs
(``{"loss": loss / accumulate_grad_batches, ...}``, as Lightning passes them) and whatever
``training_step`` stored. What the replayed ``training_step`` logs is dropped: the boards' values,
averaged over their samples, are logged instead (``coordinator.run.replica``). The cost is one forward
pass of the global batch on the coordinator per step, paid only by modules that need it
(:func:`replay_reason`).

The decision is made from the hooks' bytecode: a batch hook that loads its ``batch`` or
``outputs`` argument, or an ``on_train_epoch_end``/``on_train_epoch_start`` while ``training_step``
assigns attributes of the module or touches one holding a list, dict or set. A hook that cannot be
inspected counts as needing it.
"""

from __future__ import annotations

import dis
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from edgefleet.workloads.lightning_api import overrides

log = logging.getLogger(__name__)

BATCH_HOOKS = {"on_train_batch_start": ("batch",), "on_train_batch_end": ("outputs", "batch")}
EPOCH_HOOKS = ("on_train_epoch_end", "on_train_epoch_start")
_CONTAINERS = (list, dict, set)


@dataclass(frozen=True)
class ReplayData:
    """The run's training data as the coordinator holds it, for replaying ``training_step`` on the global batches.

    Attributes:
        dataset: The training set (the same on every board in global data mode).
        collate_fn: The user's collate function.
        global_indices: Maps a batch counted from the start of training to its global batch's indices.
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    global_indices: Callable[[int], list[int]]


def user_function(model: Any, name: str) -> Any:
    """The module's own ``name`` (a plain function), or None when Lightning's default is in force."""
    if not overrides(model, name):
        return None
    function = getattr(type(model), name, None)
    return getattr(function, "__func__", function)


def _instructions(function: Any) -> list[dis.Instruction] | None:
    try:
        return list(dis.get_instructions(function))
    except TypeError:
        return None


def _loads(function: Any, names: tuple[str, ...]) -> bool:
    """Whether ``function`` reads any of its arguments ``names`` (True when it cannot be inspected)."""
    instructions = _instructions(function)
    if instructions is None:
        return True
    for instruction in instructions:
        if instruction.opname.startswith("LOAD_FAST") or instruction.opname == "LOAD_DEREF":
            argument = instruction.argval
            loaded = argument if isinstance(argument, tuple) else (argument,)  # LOAD_FAST_LOAD_FAST (3.13)
            if any(name in loaded for name in names):
                return True
    return False


def stores_on_module(model: Any, function: Any) -> bool:
    """Whether ``function`` (``training_step``) assigns an attribute or touches a container attribute of the module."""
    instructions = _instructions(function)
    if instructions is None:
        return True
    for instruction in instructions:
        if instruction.opname == "STORE_ATTR":
            return True
        if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            value = model.__dict__.get(instruction.argval)
            if isinstance(value, _CONTAINERS):
                return True
    return False


def replay_reason(model: Any) -> str:
    """Why the replica must replay ``training_step`` for this module ("": it need not)."""
    for hook, arguments in BATCH_HOOKS.items():
        function = user_function(model, hook)
        if function is not None and _loads(function, arguments):
            return f"{hook} reads its {' or '.join(arguments)}"
    step = user_function(model, "training_step")
    for hook in EPOCH_HOOKS:
        if user_function(model, hook) is not None and (step is None or stores_on_module(model, step)):
            return f"{hook} may use what training_step keeps on the module"
    return ""


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while the replica replays training_step: the boards' values are logged instead."""


class Replay:
    """The replica's replayed ``training_step`` and the ``on_train_batch_end`` that gets its outputs.

    Args:
        model: The replica's copy of the module.
        accumulate: ``accumulate_grad_batches`` (Lightning divides the outputs' loss by it).
    """

    def __init__(self, model: Any, accumulate: int) -> None:
        self.model, self.accumulate = model, accumulate
        self._step: Callable[..., Any] = type(model).training_step.__get__(model)
        batch_end = user_function(model, "on_train_batch_end")
        self._batch_end: Callable[..., Any] | None = batch_end.__get__(model) if batch_end is not None else None
        self.outputs: dict[str, Any] = {}

    def training_step(self, *args: Any, **kwargs: Any) -> None:
        model = self.model
        before = model.__dict__.get("log")
        model.__dict__["log"] = _drop_log
        try:
            with torch.no_grad():
                output = self._step(*args, **kwargs)
        finally:
            if before is None:
                model.__dict__.pop("log", None)
            else:
                model.__dict__["log"] = before
        self.outputs = self._as_outputs(output)
        return None  # no backward, no loss: the optimizer takes the boards' averaged gradient

    def _as_outputs(self, output: Any) -> dict[str, Any]:
        """What Lightning hands ``on_train_batch_end`` for ``output`` (``ClosureResult.asdict``)."""
        if isinstance(output, torch.Tensor):
            return {"loss": (output / self.accumulate).detach().clone()}
        if isinstance(output, dict) and output.get("loss") is not None:
            loss = output["loss"]
            return {"loss": (loss / self.accumulate).detach().clone(), **{k: v for k, v in output.items() if k != "loss"}}
        return {}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> Any:
        if self._batch_end is None:
            return None
        return self._batch_end(self.outputs, batch, batch_idx)

    def install(self) -> None:
        """Put the replay in place on the replica's instance (the module's class is not changed)."""
        self.model.training_step = self.training_step
        if self._batch_end is not None:
            self.model.on_train_batch_end = self.on_train_batch_end

    def remove(self) -> None:
        for name in ("training_step", "on_train_batch_end"):
            self.model.__dict__.pop(name, None)


class PlaceholderBatches:
    """Keeps the placeholder batches of a replica that does not replay away from the batch-transfer hooks.

    Lightning sends every training batch through ``on_before_batch_transfer``,
    ``transfer_batch_to_device`` and ``on_after_batch_transfer``; a placeholder would reach the
    user's hooks (which then crash or misread it). Validation batches are real and still go through them.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._before = model._on_before_batch_transfer
        self._apply = model._apply_batch_transfer_handler

    def _training(self) -> bool:
        trainer = self.model._trainer
        return trainer is not None and bool(trainer.training)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int = 0) -> Any:
        return batch if self._training() else self._before(batch, dataloader_idx)

    def apply_batch_transfer_handler(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        return batch if self._training() else self._apply(batch, device, dataloader_idx)

    def install(self) -> None:
        self.model._on_before_batch_transfer = self.on_before_batch_transfer
        self.model._apply_batch_transfer_handler = self.apply_batch_transfer_handler

    def remove(self) -> None:
        for name in ("_on_before_batch_transfer", "_apply_batch_transfer_handler"):
            self.model.__dict__.pop(name, None)


__all__ = ["PlaceholderBatches", "Replay", "ReplayData", "replay_reason", "stores_on_module", "user_function"]
