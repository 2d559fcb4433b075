"""The coordinator's own replica of the model: it takes every step the boards take, so it can write
checkpoints, hand the current state to a board that joins late, and validate the model.

The replica is the user's module in a Lightning Trainer of its own (``workloads.fleet_trainer``),
run in a thread: the same loop as every board's, so Lightning's own code clips the averaged
gradient, steps the optimizer, steps the LR schedulers (interval, frequency, the module's
``lr_scheduler_step``), calls the module's hooks and runs its ``validation_step`` at the end of
every epoch, logging with ``self.log`` to the run's logger. Only the forward and backward passes
are left out: the replica's ``training_step`` does nothing, and at the optimizer step it takes
the fleet's averaged gradient instead (:meth:`Replica.apply`).

A module whose training hooks need what ``training_step`` produced (the batch, its outputs, what
it kept on the module) gets a replica that replays ``training_step``'s forward on the real global
batches (``coordinator.run.replica_replay``); every other module's replica sees placeholder batches,
kept away from the batch-transfer hooks. The module's ``setup`` and ``configure_model`` ran once
with the run's figures before the replica's Trainer starts (``workloads.module_setup``), and the
replica seeds its generators before every batch from the run's seed (``workloads.seeding``).

Periodic averaging (``protocol.sync_schedule``): at a local step the replica takes no optimizer
step (its gradients are None, so its optimizer moves nothing; its LR schedulers step as the
boards' do); at a sync step its parameters and float buffers become themselves minus the fleet's
average delta (with DiLoCo: moved by the outer optimizer, ``workloads.outer_step``, whose momentum
buffer the replica keeps, checkpoints and hands to joining boards), as every board's do, so it always
holds the last average. A checkpoint written
between averages is that of the last average: its step, and the schedulers and learning rates as
they were then (:meth:`Replica.state_dict`).
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import typing
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from edgefleet.coordinator.run.replica_replay import PlaceholderBatches, Replay, ReplayData, replay_reason
from edgefleet.coordinator.run.stage_keeper import StageKeeper
from edgefleet.protocol.errors import ConfigError, DecodeError, EdgeTrainError
from edgefleet.protocol.sync_schedule import EXACT, LOCAL, SYNC, SyncSchedule
from edgefleet.workloads import loss_scaling
from edgefleet.workloads.fleet_trainer import EpochBatchSampler, LoopPositioner, TrainerOptions, make_trainer, position_of
from edgefleet.workloads.lightning_api import callback_class, overrides, package_of
from edgefleet.workloads.module_checkpoint import extra_for_wire, module_extra, restore_extra, saves_extra
from edgefleet.workloads.module_setup import DataModuleHooks, Placeholders, RunFigures, prepare_module
from edgefleet.workloads.outer_step import OuterStep
from edgefleet.workloads.params import (
    BufferSet,
    assign_grads,
    assign_values,
    exchange_size,
    flatten_values,
    gradient_order,
    restore_optimizer_state,
    restore_scheduler_states,
    scheduler_states,
    to_numpy_tree,
    trainable_params,
    unpack_int_buffers,
)
from edgefleet.workloads.preflight import check_trainable
from edgefleet.workloads.seeding import REPLICA_RANK, BatchSeeder, StepSeeding

log = logging.getLogger(__name__)

# The replica's Trainer runs on this machine's CPU: it applies averaged gradients that arrive as
# host arrays, and the coordinator is a laptop or a server, not a training board.
REPLICA_ACCELERATOR = "cpu"
_STOP = object()
# Steps the replica may trail the exchange by where nothing waits for it (``apply(wait=False)``): an audit or a slow
# optimizer step on the coordinator is absorbed over the next steps instead of lengthening the one it lands on.
LAG_STEPS = 4


class ReplicaError(EdgeTrainError):
    """The replica's Trainer failed (the module's own hook raised, or its code differs from the boards')."""


class _Stopped(Exception):
    """Ends the replica's fit when the run stops before its last step."""


def _no_training_step(*args: Any, **kwargs: Any) -> None:
    """The replica's training_step: the boards compute the gradient, the replica takes their average."""
    return None


class _LoggedNames:
    """Wraps ``log`` on the replica's copy of the module: which names its own hooks log, validation's apart.

    The replica's validation and its own training hooks (``on_train_epoch_end`` ...) log into the
    same ``callback_metrics``; the run reports the first as ``val_metrics``, the second with the
    training values.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.original = model.log
        self.validation: set[str] = set()
        self.training: set[str] = set()  # logged by the module's own training hooks on the replica

    def log(self, name: str, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(self.model, "_current_fx_name", None) or ""
        if "validation" in hook:
            self.validation.add(name)
        elif hook != "on_before_optimizer_step":  # the driver logs the boards' training_step values there
            self.training.add(name)
        return self.original(name, *args, **kwargs)

    def install(self) -> None:
        self.model.log = self.log

    def remove(self) -> None:
        self.model.__dict__.pop("log", None)


class _ReplicaDriver:
    """Callback hooks of the replica's Trainer: restore state at start, take each averaged gradient, note validation."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._training_names: set[str] = set()  # logged here from the boards' training_step, with Lightning's suffixes
        self._validation_started = time.perf_counter()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        replica = self.replica
        optimizer = trainer.optimizers[0]
        replica.optimizer, replica.schedulers = optimizer, list(trainer.lr_scheduler_configs)
        replica.params = trainable_params(optimizer)
        replica.exchanged = gradient_order(replica.params, overlap=replica.overlap)
        if replica.stage_keeper is not None:
            replica.stage_keeper.bind(optimizer)
        if replica._saved is not None:
            restore_optimizer_state(optimizer, to_numpy_tree(replica._saved["optimizer"]))
            restore_scheduler_states(replica.schedulers, replica._saved.get("schedulers", []))
            replica._saved = None

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        replica = self.replica
        step, avg, result = replica._next_gradient()
        replica.step_lrs[step] = [float(group["lr"]) for group in optimizer.param_groups]  # what this step uses
        kind = replica.sync.kind(step) if replica.sync is not None else EXACT
        if kind == EXACT:
            if replica.auditor is not None and result is not None:  # before the step: the boards' model, as they began it
                replica.auditor.check(step, pl_module, replica.exchanged, [*result.contributors, *result.refused],
                                      period_s=result.wall_s)
            assign_grads(replica.exchanged, avg)
            if replica.stage_keeper is not None:  # a pipeline's later stages, which send their state at checkpoints
                replica.stage_keeper.before_step(step, optimizer, replica.stage_states.pop(step, {}))
            if replica.scaler is not None:  # 16-mixed: skipped here exactly where the boards skip it
                loss_scaling.mark_overflow(replica.scaler, optimizer, loss_scaling.overflowed(avg[:replica._grad_elements]))
            if replica.buffers:  # the first contributing board's (integer ones always), or the float ones' average
                replica.buffers.assign_from(avg[replica._grad_elements:])
        else:  # periodic averaging: no step of its own (no gradient: the optimizer moves nothing)
            for param in replica.params:
                param.grad = None
            if kind == SYNC:
                replica._take_average_delta(avg)
        if result is not None:  # what training_step logged on the boards, weighted by their samples
            for name, value in result.logs.items():
                on_step, on_epoch, prog_bar = result.log_flags[name]
                replica.log_flags[name] = (on_step, on_epoch, prog_bar)
                self._training_names.update((name, f"{name}_step", f"{name}_epoch"))
                pl_module.log(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar,
                              batch_size=result.n_total)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._validation_started = time.perf_counter()
        if self.replica.validation_threads is not None:
            threads = self.replica.validation_threads()
            if threads != torch.get_num_threads():
                log.debug("validating with %d torch thread(s) (was %d)", threads, torch.get_num_threads())
                torch.set_num_threads(threads)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.replica.validation_s += time.perf_counter() - self._validation_started
        metrics = {}
        own_training = self.replica.logged.training - self.replica.logged.validation
        for name, value in trainer.callback_metrics.items():
            if name in self._training_names or name in own_training:
                continue
            try:
                metrics[name] = float(value)
            except (TypeError, ValueError):
                continue
        self.replica.val_metrics = metrics
        self.replica._validated_at = trainer.global_step
        replica = self.replica
        if replica.stops_at is not None and replica._taken and not trainer.sanity_checking and replica.stops_at(metrics):
            replica.stopped_after = replica._first_step + replica._taken - 1  # the step just validated


class Replica:
    """A LightningModule in its own Trainer, stepped with averaged gradients only.

    Args:
        model: The user's module (the coordinator's copy, with the initial weights).
        options: The job's Trainer flags (the boards' too).
        batches_per_epoch: Global batches per epoch.
        total_steps: Optimizer steps of the whole run.
        val_loader: Makes the validation DataLoader, or None; used only if the module has a ``validation_step``.
        logger: A Lightning logger of the module's package, or False.
        log_every_n_steps: The logger's cadence for per-step values.
        sync: The run's averaging schedule (``protocol.sync_schedule``); None: every step exact.
        overlap: The gradient vector is in reversed parameter order (``workloads.params.gradient_order``).
        validation_threads: Called before each validation: the torch threads to validate with
            (``coordinator.run.replica_threads``); None keeps the process's count.
        max_epochs: The run's whole epochs when asked for in epochs, else 0 (``workloads.fleet_trainer.trainer_bounds``).
        datamodule: The run's LightningDataModule, whose batch-transfer hooks apply (validation, replay), or None.
        seed: The run's seed: the replica seeds its generators before every batch from it; None: no seeding.
        replay_data: The run's training data, for a module whose hooks need ``training_step``'s products
            (``coordinator.run.replica_replay``); None where the coordinator does not hold it (local data mode).

    Raises:
        ConfigError: the module asks for something the fleet cannot train exactly (``workloads.preflight``),
            or for something periodic averaging cannot honour (a ReduceLROnPlateau).
    """

    def __init__(self, model: Any, *, options: TrainerOptions | None = None, batches_per_epoch: int = 1,
                 total_steps: int = 1, val_loader: Callable[[], Any] | None = None, logger: Any = False,
                 log_every_n_steps: int = 50, sync: SyncSchedule | None = None, overlap: bool = False,
                 validation_threads: Callable[[], int] | None = None, max_epochs: int = 0, datamodule: Any = None,
                 seed: int | None = None, replay_data: ReplayData | None = None) -> None:
        self.model = model
        self.validation_threads = validation_threads
        self.max_epochs, self.datamodule = max_epochs, datamodule
        self.seeder = BatchSeeder(seed, REPLICA_RANK, batches_per_epoch) if seed is not None else None
        # setup("fit") and configure_model() once, with the run's figures, as Trainer.fit calls them
        figures = prepare_module(model, RunFigures(batches_per_epoch=batches_per_epoch, total_steps=total_steps,
                                                   max_epochs=max_epochs, options=options or TrainerOptions()),
                                 datamodule)
        setup = check_trainable(model, figures)
        self.optimizer = setup.optimizer
        self.schedulers: list[Any] = list(setup.schedulers)
        self.params = trainable_params(self.optimizer)
        self.overlap = overlap
        self.exchanged = gradient_order(self.params, overlap=overlap)  # the gradient's order in the exchanged vector
        self.buffers = BufferSet(model)  # set from every result: the boards' forward passes move them
        self.buffer_count = self.buffers.elements
        self.param_count = exchange_size(self.optimizer, model)  # the exchanged vector: gradient, float buffers, integer bytes
        self._grad_elements = self.param_count - self.buffer_count
        self.options = options or TrainerOptions()
        # 16-mixed: the fleet's loss scale, moved by the replica's own steps as by every board's (DDP's rule)
        self.scaler = loss_scaling.new_scaler(REPLICA_ACCELERATOR) if self.options.loss_scaled else None
        self.batches_per_epoch, self.total_steps = batches_per_epoch, total_steps
        self.package = package_of(model)
        self.validates = val_loader is not None and _overrides_validation(model)
        self.replay_reason = replay_reason(model)
        if self.replay_reason and replay_data is None:
            raise ConfigError(f"{type(model).__name__}.{self.replay_reason}: the coordinator replays training_step on "
                              "each global batch for it, and in --data-mode local it does not hold the boards' data; "
                              "use --data-mode global, or compute what the hook needs in training_step and log it")
        self.replay_data = replay_data if self.replay_reason else None
        self._replay: Replay | PlaceholderBatches | None = None
        self.logged = _LoggedNames(model)
        self.trainer: Any = None  # the replica's Trainer, once it runs
        self.log_flags: dict[str, tuple[bool, bool, bool]] = {}  # what training_step logged on the boards: on_step, on_epoch, prog_bar
        self.plateau = any(config.reduce_on_plateau for config in self.schedulers)
        self.sync = sync if sync is not None and sync.periodic else None
        if self.sync is not None and self.plateau:
            raise ConfigError(f"--sync-every {self.sync.every}: the module's ReduceLROnPlateau decides on the coordinator "
                              "after validation, and between averages its learning rate would reach the boards a step "
                              "late; use --sync-every 1, or a scheduler that steps on its own (StepLR, CosineAnnealingLR)")
        self._anchor: np.ndarray | None = None  # sync steps: parameters and float buffers, flat, as the boards hold them
        # DiLoCo: the outer optimizer's momentum, the same on every board (computed from the same averages)
        self._outer = OuterStep(self.sync.outer, self._grad_elements) if self.sync is not None and self.sync.outer.stepped \
            else None
        self._averaged: tuple[int, list[Any], list[dict[str, Any]]] | None = None  # the last average: step, schedulers, groups
        self._val_loader = val_loader if self.validates else None
        self.logger = logger
        self.log_every_n_steps = log_every_n_steps
        self.step = 0  # the next global step
        # A decision on the validation figures that ends the run (--target-accuracy), set by the run: after the
        # validation that makes it true the Trainer takes no further step, and the steps queued behind that validation
        # (the boards went on while it ran) are dropped, so the model is Trainer.fit's stopped there.
        self.stops_at: Callable[[dict[str, float]], bool] | None = None
        self.stopped_after: int | None = None  # the step after whose validation the Trainer stopped
        self.val_metrics: dict[str, float] = {}
        self.step_lrs: dict[int, list[float]] = {}  # each taken step's learning rates, until learning_rates_at reads them
        self._validated_at = -1
        # A pipeline whose later stages send their state only at checkpoints (``coordinator.run.stage_keeper``), and
        # the states they sent, by step (put by the run before the step's apply, taken in the Trainer's thread)
        self.stage_keeper: StageKeeper | None = None
        self.stage_states: dict[int, dict[int, np.ndarray]] = {}
        self.validation_s = 0.0  # seconds of validation since take_validation_s() last read it
        self._saved: dict[str, Any] | None = None
        self._gradients: queue.Queue[Any] = queue.Queue(maxsize=LAG_STEPS)  # (step, average, result), in step order
        self._waiting = threading.Event()   # the Trainer waits for its first gradient, or has ended
        self._progress = threading.Condition()  # the Trainer finished a step, or ended
        self._taken = 0                     # gradients the Trainer took since it started (its thread's count)
        self._done = 0                      # ... and finished with (validation and hooks included)
        self._first_step = 0                # self.step when the Trainer started
        self._ended = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.auditor: Any = None  # audits by recomputation (``coordinator.audit.auditor.Auditor``), set by the run

    # ---------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the replica's Trainer and wait until it waits for the gradient of :attr:`step`.

        Raises:
            ReplicaError: the Trainer failed while starting.
        """
        if self._thread is not None:
            return
        if self.replay_data is not None:
            log.info("the replica replays training_step's forward on every global batch: %s", self.replay_reason)
            self._replay = Replay(self.model, self.options.accumulate_grad_batches)
        else:
            self.model.training_step = _no_training_step  # this copy only: the boards run the module's own
            self._replay = PlaceholderBatches(self.model)
        self._replay.install()
        self.logged.install()
        self._first_step = self.step
        self._thread = threading.Thread(target=self._fit, name="edgefleet-replica", daemon=True)
        self._thread.start()
        self._wait()
        if saves_extra(self.model):  # before any board starts: what on_save_checkpoint keeps must travel to boards
            extra_for_wire(self._module_extra(self.step), type(self.model).__name__)
        self._note_average()  # a (resumed) run that starts between averages

    def _fit(self) -> None:
        position = position_of(self.step, self.batches_per_epoch, self.options.accumulate_grad_batches)
        callbacks = [callback_class(self.package, LoopPositioner, "LoopPositioner")(position),
                     callback_class(self.package, _ReplicaDriver, "ReplicaDriver")(self)]
        if self.seeder is not None:
            callbacks.insert(1, callback_class(self.package, StepSeeding, "StepSeeding")(self.seeder))
        if self.datamodule is not None:
            callbacks.insert(1, callback_class(self.package, DataModuleHooks, "DataModuleHooks")(self.datamodule))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*does not have many workers.*")
                warnings.filterwarnings("ignore", message=".*training_step.*returned `None`.*")
                trainer = self.trainer = make_trainer(
                    self.package, options=self.options, total_steps=self.total_steps, callbacks=callbacks,
                    accelerator=REPLICA_ACCELERATOR, logger=self.logger, validate=self.validates,
                    log_every_n_steps=self.log_every_n_steps, max_epochs=self.max_epochs,
                    precision_plugin=self._precision_plugin())
                loader = self._train_loader(position)
                val = self._val_loader() if self._val_loader is not None else None
                trainer.fit(self.model, train_dataloaders=loader, val_dataloaders=val)
                if val is not None and self._validated_at != trainer.global_step:  # the run ended mid-epoch
                    trainer.validate(self.model, dataloaders=val, verbose=False)
        except _Stopped:
            pass
        except BaseException as exc:
            log.exception("the replica's Trainer failed")
            self._error = exc
        finally:
            with self._progress:
                self._ended = True
                self._done = self._taken
                self._progress.notify_all()
            self._waiting.set()

    def _precision_plugin(self) -> Any:
        """16-mixed: the replica's precision plugin, stepping with the averaged gradient at the fleet's loss scale; else None."""
        if self.scaler is None:
            return None
        return loss_scaling.precision_plugin(self.package, REPLICA_ACCELERATOR, self.scaler, replica=True)

    def _train_loader(self, position: Any) -> DataLoader[Any]:
        """The replica's batches: the real global batches when it replays training_step, else placeholders."""
        data = self.replay_data
        if data is None:
            return DataLoader(Placeholders(1), batch_sampler=EpochBatchSampler(lambda batch: [0], position))
        before = self.seeder.before_loading if self.seeder is not None else None
        return DataLoader(data.dataset, batch_sampler=EpochBatchSampler(data.global_indices, position, before_batch=before),
                          collate_fn=data.collate_fn)

    def epoch_train_metrics(self) -> dict[str, float]:
        """The epoch values (Lightning's sample-weighted means) of what training_step logged with ``on_epoch=True``,
        and what the module's own training hooks logged on the replica (``on_train_epoch_end``'s epoch figures).

        Call it after :meth:`apply` of an epoch's last step (or the run's): the replica's Trainer has
        aggregated the epoch then, and waits.
        """
        trainer = self.trainer
        if trainer is None:
            return {}
        metrics = trainer.callback_metrics
        values = {}
        for name, (_, on_epoch, _) in self.log_flags.items():
            value = metrics.get(f"{name}_epoch", metrics.get(name)) if on_epoch else None
            if value is not None:
                values[name] = float(value)
        for name in self.logged.training - self.logged.validation:  # the module's own epoch hooks on the replica
            for key in (name, f"{name}_epoch"):
                value = metrics.get(key)
                if value is not None and value.numel() == 1:
                    values[key] = float(value)
        return values

    def _next_gradient(self) -> tuple[int, np.ndarray, Any]:
        """In the Trainer's thread: every gradient taken so far is done with; take the next (its step, the average,
        the exchange's result), or stop."""
        with self._progress:
            self._done = self._taken
            self._progress.notify_all()
        self._waiting.set()
        if self.stopped_after is not None:  # a validation decided the run ends: what was queued behind it is dropped
            self._drop_queued()
            raise _Stopped
        item = self._gradients.get()
        if item is _STOP:
            raise _Stopped
        self._taken += 1
        return typing.cast(tuple[int, np.ndarray, Any], item)

    def _drop_queued(self) -> None:
        while True:
            try:
                self._gradients.get_nowait()
            except queue.Empty:
                return

    def _wait(self) -> None:
        self._waiting.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ReplicaError(f"the coordinator's replica failed: {type(self._error).__name__}: {self._error}")

    @property
    def may_lag(self) -> bool:
        """Whether :meth:`apply` may return before the step is done: every step exact (periodic averaging reads the
        replica after each average), no ReduceLROnPlateau (its learning rates go out with the next result) and no
        logger (the run logs the fleet's loss into it beside the replica's own values)."""
        return self.sync is None and not self.plateau and not self.logger

    def apply(self, avg: np.ndarray, result: Any = None, *, wait: bool = True) -> None:
        """One optimizer step with the fleet's average gradient (the same step every board takes).

        ``result`` (the exchange's ``StepResult``) brings what the boards logged in training_step.

        ``wait``: return when the step, the schedulers and (at an epoch's end) validation are done; False (only
        where :attr:`may_lag`): return once the step is queued, its average copied, while the Trainer works through
        up to :data:`LAG_STEPS` queued steps (an audit runs inside a step); :meth:`drain` waits for them.

        Raises:
            ReplicaError: the replica's Trainer failed or has already ended.
        """
        if self._thread is None:
            self.start()
        self._raise_if_failed()
        if self._ended or self.stopped_after is not None:
            # stopped_after is set before the Trainer ends, so it is read after _ended: the run ends after that step,
            # and a step the boards ran beyond it is dropped
            if self.stopped_after is not None:
                return
            raise ReplicaError(f"the coordinator's replica ended before step {self.step}")
        if not wait:
            if not self.may_lag:
                raise ValueError("apply(wait=False) needs a replica that may lag (exact steps, no ReduceLROnPlateau)")
            avg = np.array(avg, dtype=np.float32, copy=True)  # the exchange reuses its buffer for the next step
        self._gradients.put((self.step, avg, result))  # waits while LAG_STEPS steps are queued: the lag's bound
        self.step += 1
        if wait:
            self.drain()
        if self.sync is not None and self.sync.averaged_after(self.step - 1):
            self._note_average()

    def end_at_stop(self) -> None:
        """After the Trainer stopped on a validation's decision (:attr:`stopped_after`): the run continues from the step
        after it (:attr:`step`, which counted the steps applied behind the validation, is put back)."""
        if self.stopped_after is not None:
            self.drain()
            self.step = self.stopped_after + 1

    def done_through(self, step: int) -> bool:
        """Whether the Trainer has finished ``step`` (its validation and hooks included); never blocks."""
        return self._thread is None or self._ended or self._first_step + self._done > step

    def drain(self) -> None:
        """Wait until the Trainer has done every step given to it (at once where it does not lag).

        Raises:
            ReplicaError: the replica's Trainer failed.
        """
        if self._thread is not None:
            with self._progress:
                self._progress.wait_for(lambda: self._first_step + self._done >= self.step or self._ended)
        self._raise_if_failed()

    def _note_average(self) -> None:
        """Before a local step: keep what a checkpoint between averages needs (the model and optimizer state keep)."""
        if self.sync is None or self.sync.kind(self.step) != LOCAL:
            return
        self._averaged = (self.step, [copy.deepcopy(c.scheduler.state_dict()) for c in self.schedulers],
                          [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.optimizer.param_groups])

    @torch.no_grad()
    def _take_average_delta(self, delta: np.ndarray) -> None:
        """A sync step (in the Trainer's thread): parameters and float buffers = themselves - the average delta,
        computed as every board computes it (``agent.local_sgd``), so all hold the same bits; integer buffers =
        the first contributing board's (the vector's last elements carry its bytes, not a delta)."""
        tensors = [*self.params, *self.buffers.floats]
        deltas = self.param_count - self.buffers.int_elements
        if self._anchor is None:
            self._anchor = np.zeros(deltas, dtype=np.float32)
        flatten_values(tensors, self._anchor)
        if self._outer is not None:  # DiLoCo: the outer optimizer's step with the average delta as its gradient
            self._outer.apply(self._anchor, delta)
        else:
            np.subtract(self._anchor, delta[:deltas], out=self._anchor)
        assign_values(tensors, self._anchor)
        unpack_int_buffers(self.buffers.ints, delta[deltas:])

    def close(self) -> None:
        """Stop the replica's Trainer (at its next optimizer step, or it has ended already)."""
        if self._thread is None:
            return
        if not self._ended:
            self._gradients.put(_STOP)
        self._thread.join(timeout=60)
        self.model.__dict__.pop("training_step", None)
        if self._replay is not None:
            self._replay.remove()
        self.logged.remove()

    # ---------------------------------------------------------------------------------- state

    def wire_state(self) -> tuple[int, Any, Any]:
        """(next step, model state, optimizer state) as numpy trees for the exchange's welcome."""
        return self.step, to_numpy_tree(self.model.state_dict()), to_numpy_tree(self.optimizer.state_dict())

    def learning_rates(self) -> list[float]:
        """The optimizer's learning rate of each param group, now."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def learning_rates_at(self, step: int) -> list[float] | None:
        """The learning rates (one per param group) ``step`` was taken with, once the Trainer has taken it; read once."""
        return self.step_lrs.pop(step, None)

    def scheduler_wire_state(self) -> list[Any]:
        """The LR schedulers' states as numpy trees, in Lightning's order, for the exchange's welcome."""
        return scheduler_states(self.schedulers)

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint holds: now, or between averages the last average's (see the module's docstring).

        ``module``: what the module's ``on_save_checkpoint`` adds (``workloads.module_checkpoint``).
        """
        averaged = self._averaged
        if averaged is None or self.sync is None or self.sync.kind(self.step - 1) != LOCAL:
            return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedulers": [config.scheduler.state_dict() for config in self.schedulers],
                    "module": self._module_extra(self.step), **self._loss_scale_state(), **self._outer_state()}
        step, schedulers, groups = averaged  # the model and the optimizer's state have not moved since
        optimizer = self.optimizer.state_dict()
        optimizer["param_groups"] = [{**group, **saved} for group, saved in zip(optimizer["param_groups"], groups)]
        return {"step": step, "model": self.model.state_dict(), "optimizer": optimizer, "schedulers": schedulers,
                "module": self._module_extra(step), **self._loss_scale_state(), **self._outer_state()}

    def _outer_state(self) -> dict[str, Any]:
        """DiLoCo: ``{"outer": the momentum buffer}`` for the checkpoint (it moves only at sync steps, so between
        averages it is the last average's, like the model); else nothing."""
        if self._outer is None:
            return {}
        return {"outer": {name: torch.from_numpy(value) for name, value in self._outer.state().items()}}

    def outer_wire_state(self) -> dict[str, np.ndarray] | None:
        """DiLoCo: the outer optimizer's momentum now, for the welcome of a joining board; else None."""
        return self._outer.state() if self._outer is not None else None

    def _loss_scale_state(self) -> dict[str, Any]:
        """16-mixed: ``{"loss_scale": the scaler's state}`` for the checkpoint; else nothing."""
        return {"loss_scale": loss_scaling.scaler_state(self.scaler)} if self.scaler is not None else {}

    def loss_scale_wire_state(self) -> dict[str, float | int] | None:
        """16-mixed: the fleet's loss scale now, for the welcome of a joining board; else None."""
        return loss_scaling.scaler_state(self.scaler) if self.scaler is not None else None

    def _module_extra(self, step: int) -> dict[str, Any]:
        position = position_of(step, self.batches_per_epoch, self.options.accumulate_grad_batches)
        return module_extra(self.model, epoch=position.epoch, global_step=step)

    def module_wire_state(self) -> Any:
        """What the module's ``on_save_checkpoint`` adds now, for the welcome of a board joining mid-run; None: nothing.

        Raises:
            ConfigError: the hook added something that cannot travel to a board.
        """
        if self.step == 0 or not saves_extra(self.model):
            return None
        return extra_for_wire(self._module_extra(self.step), type(self.model).__name__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state, before :meth:`start` (the optimizer and schedulers are restored once the Trainer made them)."""
        self.model.load_state_dict(state["model"])
        self.step = int(state["step"])
        position = position_of(self.step, self.batches_per_epoch, self.options.accumulate_grad_batches)
        restore_extra(self.model, dict(state.get("module") or {}), epoch=position.epoch, global_step=self.step)
        if self.scaler is not None:
            if "loss_scale" not in state:
                raise ConfigError("the checkpoint holds no loss scale: it was not written by a --precision 16-mixed run; "
                                  "resume it with the --precision it was trained with")
            self.scaler.load_state_dict(dict(state["loss_scale"]))
        if self._outer is not None:
            if "outer" not in state:
                raise ConfigError("the checkpoint holds no outer optimizer state: it was not written by an "
                                  "--outer-optimizer run; resume it with the --outer-optimizer it was trained with")
            try:
                self._outer.load_state(dict(state["outer"]))
            except DecodeError as exc:
                raise ConfigError(f"the checkpoint's outer optimizer state does not fit this run: {exc}") from None
        self._saved = {"optimizer": state["optimizer"],
                       "schedulers": [to_numpy_tree(s) for s in state.get("schedulers", [])]}
        restore_optimizer_state(self.optimizer, to_numpy_tree(state["optimizer"]))  # wire_state before start

    def take_validation_s(self) -> float:
        """Seconds the replica spent in ``validation_step`` since the last call (it validates inside ``apply``)."""
        taken, self.validation_s = self.validation_s, 0.0
        return taken

    @torch.no_grad()  # as Lightning validates: no graph is built, no gradient kept
    def evaluate(self, loader: Any) -> tuple[float, float] | None:
        """(mean cross-entropy, accuracy) of a classifier on ``loader``; None if its batches are not (input, class label).

        The fallback for a module without a ``validation_step``.
        """
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        try:
            for batch in loader:
                if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                    return None
                x, y = batch
                if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.ndim != 1:
                    return None
                logits = self.model(x)
                if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != len(y):
                    return None
                loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
                total += len(y)
        finally:
            self.model.train()
        return (loss_sum / total, correct / total) if total else None


def _overrides_validation(model: Any) -> bool:
    return overrides(model, "validation_step")


__all__ = ["REPLICA_ACCELERATOR", "Replica", "ReplicaError"]
