"""The training driver: start the job on the boards, run every step through the exchange, keep
the replica, checkpoints and metrics, and end with a result the user can read and a model file.

Ctrl-C (or SIGTERM) stops at a step boundary: the boards are told to stop, the checkpoint holds the
last applied step, and ``edge-coordinator train --resume RUN_DIR`` continues from there.

Adapting during training (global data mode, two boards or more, ``--rebalance``): every step's
per-board compute times go to a :class:`~coordinator.run.rebalance.Rebalancer`; when a board's
time per sample drifts past the threshold it proposes new batch sizes with the same sum, which the
exchange announces for a step two steps ahead. That step's record in ``metrics.jsonl`` gets a
``"rebalance"`` entry (old and new sizes, the drift, the step they apply from) and the user a note.
The global batch of every step is unchanged, so the trained model is too (up to fp32 summation
order). The splits are part of the checkpoint: a resumed run keeps the one in force.

Periodic averaging (``--sync-every H``, ``protocol.sync_schedule``) is opt-in and changes the
mathematics: the exchange, the replica and the boards follow one schedule; each step's record in
``metrics.jsonl`` says its kind, ``result.json`` the mode, and a run stopped between averages
resumes from the last average.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import math
import signal
import socket
import ssl
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edgefleet.coordinator.audit.auditor import AuditFailure
from edgefleet.coordinator.audit.run_audits import run_audits
from edgefleet.coordinator.control.board_channel import BoardChannel
from edgefleet.coordinator.control.fleet_select import check_boards_ready
from edgefleet.coordinator.exchange.modes import PipelineStages
from edgefleet.coordinator.exchange.server import ExchangeError, ExchangeServer, StepResult
from edgefleet.coordinator.pipeline.piped_run import PipedRun
from edgefleet.coordinator.pipeline.piped_run import prepare as prepare_pipeline
from edgefleet.coordinator.pipeline.replan import Comeback, Replanned, replan
from edgefleet.coordinator.pipeline.stage_plan import parse_stage_plan
from edgefleet.coordinator.placement.placed_run import SAMPLE_ROWS, PlacedRun, prepare
from edgefleet.coordinator.placement.tail_server import TailServer
from edgefleet.coordinator.run.checkpoints import (
    CHECKPOINT,
    MetricsLog,
    RunDirError,
    atomic_torch_save,
    atomic_write_json,
    check_new_run_dir,
    load_checkpoint,
    make_run_dir,
    remove_stale_temps,
    save_checkpoint,
    write_error,
)
from edgefleet.coordinator.run.job_spec import JobSpec, batches_per_epoch
from edgefleet.coordinator.run.rebalance import Rebalancer
from edgefleet.coordinator.run.replica import Replica
from edgefleet.coordinator.run.replica_replay import ReplayData
from edgefleet.coordinator.run.replica_threads import FreeCpuThreads
from edgefleet.coordinator.run.run_logger import PendingLines, board_scalars, close_logger, lr_scalars, make_logger, step_scalars
from edgefleet.coordinator.run.slowdown import slowdown_cause
from edgefleet.coordinator.run.stage_keeper import StageKeeper
from edgefleet.coordinator.run.stage_reviser import StageReviser
from edgefleet.protocol.codec import encode_value
from edgefleet.protocol.errors import ConfigError, DecodeError
from edgefleet.protocol.exchange_auth import HelloChecker
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.jobs import StopCommand, TrainCommand
from edgefleet.protocol.signing import HMAC_ALGORITHM, CoordinatorKeys
from edgefleet.protocol.split_schedule import SplitSchedule
from edgefleet.protocol.stage_sync import STATE, StageSync
from edgefleet.transport.exchange_tls import make_job_certificate
from edgefleet.transport.settings import BrokerSettings
from edgefleet.workloads.layer_timing import input_sampler
from edgefleet.workloads.sharding import GlobalBatchPlan
from edgefleet.workloads.training_data import load_training_data

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 180.0  # a Raspberry Pi needs tens of seconds to import torch and Lightning
REJOIN_EVERY_S = 30.0   # a board that left and is online again is asked back at most this often ...
MAX_REJOINS = 3         # ... and this many times in a run
REJECT_GRACE_S = 3.0    # a board that refused a command for the job fails unless it accepts one within this long
# The first steps after a (re)start are slow (allocations, caches, Lightning's first-batch work):
# they would make a poor reference for the rebalancer, so it starts watching after them.
REBALANCE_WARMUP_STEPS = 2
ACCURACY_KEYS = ("val_acc", "val_accuracy", "val/acc", "val/accuracy")  # a validation_step's accuracy, as commonly logged


@dataclass
class StepView:
    """What the progress display shows after each step."""

    step: int
    total_steps: int
    loss: float | None
    val_accuracy: float | None
    samples_per_s: float
    board_compute_s: dict[str, float]
    late: list[str]
    refused: dict[str, str]
    batch_sizes: dict[str, int] = field(default_factory=dict)  # each contributor's samples this step
    shown: dict[str, float] = field(default_factory=dict)  # logged with prog_bar=True (training_step, validation_step)


# A pipeline's state step (--stage-sync checkpoint): its later stages' gradient, parameters and Adam's two moments (at
# most, float32) are waited for at 10 Mbit/s (a slow edge link) on top of the step's deadline, for at most 10 minutes
STATE_COPIES = 4
STATE_BYTES_PER_S = 1.25e6
MAX_STATE_WAIT_S = 600.0
NEXT_PLAN_WAIT_S = 15.0  # a run followed by a re-planned one waits this long for its stops' acks and its boards' idle
BOARD_WORDS_WAIT_S = 3.0  # a step no board completed: how long the run waits for a board's word on why
STAGE_WORDS_WAIT_S = 1.0  # a pipeline's board left: its worker's failure comes as its link closes, if it comes at all
OFFLINE_WAIT_S = 20.0  # how long a pipeline that lost a board waits to learn which agent went offline
OFFLINE_POLL_S = 0.5


@dataclass
class TrainOutcome:
    run_dir: Path
    result: dict[str, Any]
    interrupted: bool
    rolled_back: list[AuditFailure] = field(default_factory=list)  # boards that failed an audit: the run goes back
    replan: Replanned | None = None  # a pipeline lost a board for good: the run goes on with this plan, from its step
    lost_at: float | None = None     # when (time.monotonic()) the pipeline lost it: recovery is counted from there
    comeback: Comeback | None = None  # the planned pipeline and the boards it waits for (``pipeline.replan``)
    revised: bool = False  # ``replan`` revises the pipeline around a board that slowed (``run.stage_reviser``)


def exchange_host_for(broker: BrokerSettings) -> str:
    """The local address that reaches the broker; boards on the broker's network reach it too."""
    if broker.host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((broker.host, broker.port))  # UDP connect sends nothing; it picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "0.0.0.0"


def _checkpointed_splits(saved: Any, run_dir: Path) -> list[BatchSplit]:
    """The batch splits a checkpoint recorded. Raises ConfigError: the checkpoint holds something else."""
    try:
        if not isinstance(saved, list):
            raise DecodeError(f"splits is a {type(saved).__name__}, not a list")
        return [BatchSplit.from_wire(s) for s in saved]
    except DecodeError as exc:
        raise ConfigError(f"{run_dir}: the checkpoint's batch splits are unreadable ({exc}); "
                          "resume from an intact copy or start a new run") from None


def _refuse_a_finished_run(run_dir: Path) -> None:
    """A run that stopped at its target accuracy is complete: --resume has nothing to continue."""
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return
    reached = result.get("target_reached") if isinstance(result, dict) else None
    if isinstance(reached, dict) and not result.get("interrupted"):
        raise ConfigError(f"{run_dir} is complete: it reached its target accuracy at step {reached.get('step')}; "
                          "nothing to resume (start a new run with a higher --target-accuracy to train on)")


STEADY_SKIP_STEPS = 3  # steps a run (or a resumed run) takes to warm up, left out of its steady samples/s


def _val_accuracy(metrics: dict[str, float]) -> float | None:
    """The accuracy a validation logged (the first of :data:`ACCURACY_KEYS`), or None."""
    return next((metrics[k] for k in ACCURACY_KEYS if k in metrics), None)


def _stops_at_target(target: float, metrics: dict[str, float]) -> bool:
    """The replica stops after a validation whose accuracy reaches ``target``, or that gives none (the run cannot judge
    it and stops there: ``TrainingRun._check_target``)."""
    accuracy = _val_accuracy(metrics)
    return accuracy is None or accuracy >= target


class SteadyRate:
    """Samples/s once warm: from the end of the first ``skip_steps`` steps, validation time left out."""

    def __init__(self, *, skip_steps: int) -> None:
        self.skip_steps = skip_steps
        self._since: float | None = None
        self._samples = 0
        self._validating_s = 0.0
        self._now = 0.0

    def add(self, index: int, samples: int, now: float) -> None:
        """Step ``index`` (0 = the run's first) of ``samples`` ended at ``now``."""
        if index + 1 == self.skip_steps or (self._since is None and index + 1 > self.skip_steps):
            self._since, self._samples, self._validating_s = now, 0, 0.0
        elif self._since is not None:
            self._samples += samples
        self._now = now

    def exclude(self, validating_s: float) -> None:
        """A validation held up the steps for ``validating_s``: not training time."""
        if self._since is not None:
            self._validating_s += validating_s

    def samples_per_s(self) -> float | None:
        if self._since is None or self._samples == 0:
            return None
        busy = self._now - self._since - self._validating_s
        return round(self._samples / busy, 2) if busy > 0 else None


class _Adaptation:
    """The batch split in force, the rebalancer that changes it, and the forced split of ``force_split``.

    Args:
        spec: The run.
        splits: Splits already announced (a resumed run's, from its checkpoint), in step order.
        first_step: The step this (possibly resumed) run starts at.
    """

    def __init__(self, spec: JobSpec, splits: list[BatchSplit], first_step: int) -> None:
        self.spec = spec
        self.schedule = SplitSchedule(spec.batch_sizes, splits)
        # With accumulation a step is a window of batches on each board: a re-split starts with a window
        # (the boards translate the step into its first batch).
        self.enabled = spec.rebalance and spec.data_mode == "global" and len(spec.boards) > 1 and not spec.pipeline
        self.watch_from = first_step + REBALANCE_WARMUP_STEPS
        self.explain: Callable[[str], str] | None = None  # a slowed board's likely cause (set once the channel is open)
        self.rebalancer = self._rebalancer(self.latest()) if self.enabled else None
        self.records: list[dict[str, Any]] = []

    def _rebalancer(self, sizes: list[int]) -> Rebalancer:
        return Rebalancer(dict(zip(self.spec.boards, sizes)), threshold=self.spec.rebalance_threshold,
                          explain=lambda board: self.explain(board) if self.explain is not None else "cause unknown")

    @property
    def splits(self) -> list[BatchSplit]:
        """The splits announced (a resumed run's, then this run's), in step order."""
        return self.schedule.splits

    def latest(self) -> list[int]:
        """The newest split's sizes (possibly not in force yet), by board index."""
        splits = self.schedule.splits
        return list(splits[-1].batch_sizes) if splits else list(self.schedule.initial)

    def at(self, step: int) -> list[int]:
        """The batch sizes in force at ``step``, by board index."""
        return self.schedule.batch_sizes_at(step)

    def after_step(self, r: StepResult, exchange: ExchangeServer) -> dict[str, Any] | None:
        """Feed step ``r`` to the rebalancer; announce a new split if it (or the test hook) asks. The record, if so."""
        forced = self.spec.force_split
        if forced is not None and exchange.next_split_step == forced.from_step:
            sizes = list(forced.batch_sizes)
            record = self._announce(r.step, sizes, exchange, drift={}, message="forced re-split (test hook)")
            if self.enabled:
                self.rebalancer = self._rebalancer(sizes)  # a fresh reference at the new sizes
            return record
        if self.rebalancer is None or r.step < self.watch_from or set(r.contributors) != set(self.spec.boards):
            return None  # steps some board missed say little about the fleet's balance
        accumulate = self.spec.accumulate_grad_batches  # a board's n is its batch size times the window's batches
        decision = self.rebalancer.observe(r.compute_s, step=r.step,
                                           batch_sizes={b: n // accumulate for b, n in r.batch_sizes.items()},
                                           steps_left=self.spec.total_steps - exchange.next_split_step)
        if decision is None:
            return None
        sizes = [decision.new_batch_sizes[b] for b in self.spec.boards]
        return self._announce(r.step, sizes, exchange, drift={b: round(d, 4) for b, d in decision.drift.items()},
                              message=decision.message, current_step_s=round(decision.current_step_s, 6),
                              predicted_step_s=round(decision.predicted_step_s, 6))

    def _announce(self, step: int, sizes: list[int], exchange: ExchangeServer, **why: Any) -> dict[str, Any]:
        old = self.latest()
        from_step = exchange.announce_split(sizes)
        self.schedule.add(from_step, sizes)
        record = {"step": step, "from_step": from_step, "old_batch_sizes": dict(zip(self.spec.boards, old)),
                  "new_batch_sizes": dict(zip(self.spec.boards, sizes)), **why}
        self.records.append(record)
        return record


def check_board_credentials(spec: JobSpec, fleet_key: bytes) -> None:
    """Refuse boards that would join the exchange with a bearer token, unless the job allows them (``--allow-token-boards``).

    A board proves itself with its own key (``--board-keys``) or, under a legacy shared HMAC fleet key, with that
    key; any other board would be given a token in its signed command, which anyone who reads the broker can read.

    Raises:
        ConfigError: naming those boards and the two ways on.
    """
    keys = CoordinatorKeys.from_bytes(fleet_key)
    if spec.allow_token_boards or keys.board_keys:  # with --board-keys, a board missing there is refused by name later
        return
    checker = HelloChecker(board_keys=keys.board_keys, hmac_key=keys.secret if keys.algorithm == HMAC_ALGORITHM else None)
    tokens = [board for board in spec.boards if not checker.proves_with_key(board)]
    if tokens:
        raise ConfigError(f"board(s) {', '.join(tokens)} have no key of their own here (--board-keys, or [security] "
                          "board_keys_dir): they would join the exchange with a token in their signed command, which anyone "
                          "who reads the broker can read and use to take their place and receive the model. Give each board "
                          "a key of its own (security.board_key_file; the Ansible role makes it) and this coordinator their "
                          "public keys with --board-keys (docs/security.md), or pass --allow-token-boards to accept the risk")


@dataclass(frozen=True, slots=True)
class _HeldStep:
    """A step the exchange has done whose record waits for the replica (its validation, at an epoch's end)."""

    result: StepResult
    elapsed: float                  # seconds since this attempt started, when the step's result was in
    rebalance: dict[str, Any] | None
    samples: int                    # samples trained in this attempt up to this step
    epoch_end: bool
    waited: bool                    # the exchange waited for the replica's step (its validation on the critical path)
    at: float = field(default_factory=time.monotonic)  # when the step's result was in (monotonic)


class TrainingRun:
    """One run, fresh or resumed."""

    def __init__(self, spec: JobSpec, *, run_dir: Path, broker: BrokerSettings, fleet_key: bytes,
                 on_step: Callable[[StepView], None], on_note: Callable[[str], None], resume: bool = False,
                 busy_wait_s: float = 0.0, on_join: Callable[[str, int, int], None] | None = None,
                 recovering_since: float | None = None, comeback: Comeback | None = None, revised: bool = False) -> None:
        from edgefleet.workloads.registry import build_model  # Lightning and the built-in models: only when a run starts

        if not spec.resolved:
            raise ValueError("a run needs a resolved job (train_job.resolve_job fixes its boards, batch sizes and length)")
        if not resume:  # before anything is loaded or any board is asked: a run directory is never mixed up
            check_new_run_dir(run_dir)
        check_board_credentials(spec, fleet_key)  # before any board is asked: no bearer token unless the user said so
        self.spec, self.run_dir, self.broker, self.fleet_key = spec, run_dir, broker, fleet_key
        self.busy_wait_s = busy_wait_s  # after a rollback: the boards may still be ending the attempt thrown away
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.on_step, self.on_note = on_step, on_note
        self.on_join = on_join  # (board, boards joined so far, boards of the job) as each joins the exchange
        self.data = load_training_data(dataset=spec.dataset, dataset_options=spec.dataset_options,
                                       datamodule=spec.datamodule, datamodule_options=spec.datamodule_options)
        options = dict(spec.model_options) | ({"lr": spec.lr} if spec.lr is not None else {})
        torch.manual_seed(spec.seed)  # the replica's initial weights; boards receive them, never re-draw them
        model = build_model(spec.model, options, data=self.data.train)
        if spec.target_accuracy is not None and self.data.val_loader is None:
            raise ConfigError("--target-accuracy needs validation data, and this dataset or DataModule has no validation "
                              "split: give one with a validation split (e.g. digits) or leave the flag out")
        self.batches_per_epoch = spec.batches_per_epoch or batches_per_epoch(spec, len(self.data.train), spec.batch_sizes)
        self.replica = Replica(model, options=spec.trainer_options, batches_per_epoch=self.batches_per_epoch,
                               total_steps=spec.total_steps, val_loader=self.data.val_loader,
                               logger=make_logger(spec.logger, model, run_dir), log_every_n_steps=spec.log_every_n_steps,
                               sync=spec.sync_schedule, overlap=spec.overlap,
                               validation_threads=None if spec.threads else FreeCpuThreads().threads,
                               max_epochs=spec.max_epochs, datamodule=self.data.datamodule, seed=spec.seed,
                               replay_data=self._replay_data())
        self.placed = self._placement() if spec.placement else None
        self.piped = self._pipeline() if spec.pipeline else None
        # a pipeline is revised around a board that slows for good (--rebalance, as a data-parallel run's split)
        self.reviser = (StageReviser(spec.pipeline, spec.batch_sizes, spec.micro_batches, model=self.replica.model,
                                     sample=input_sampler(self.data.train, self.data.collate_fn),
                                     total_steps=spec.total_steps, on_note=on_note)
                        if self.piped is not None and spec.rebalance else None)
        self._stage_lost = False  # a pipelined step came without a stage's gradient: the run stops
        self._user_stop = False
        self._lost: tuple[float, list[str]] = (0.0, [])  # when, and the boards that sent nothing
        self.recovering_since = recovering_since  # a re-planned pipeline's start: its first step ends the recovery
        self.revised = revised  # ... re-planned around a board that slowed, not one that was lost
        self.comeback = comeback  # a re-planned pipeline: the boards it lost, watched, and the plan it returns to
        self._returned: list[str] = []  # of those, the ones online again: the run stops at its next whole step
        self._failures: dict[str, str] = {}  # what each board said when its part of the job failed
        self._next_plan = False  # the run ends into a re-planned run of the same job
        self.recovery_s: float | None = None
        self.audits = run_audits(spec, model, self.data.train, self.data.collate_fn, run_dir=run_dir,
                                 batches_per_epoch=self.batches_per_epoch)
        self.history: list[dict[str, Any]] = []
        self._held: deque[_HeldStep] = deque()  # steps done whose record waits for the replica's validation
        self.val_accuracy: float | None = None
        self.val_loss: float | None = None
        self.val_metrics: dict[str, float] = {}
        self.train_metrics: dict[str, float] = {}  # each name's last value logged in training_step
        self._announced_lrs: list[float] = []
        self._fallback_accuracy = True
        self.elapsed_before_s = 0.0
        self.join_s: float | None = None  # from the commands sent until every board joined the exchange
        self.target_reached: dict[str, Any] | None = None  # the epoch end that reached spec.target_accuracy
        self._steady = SteadyRate(skip_steps=STEADY_SKIP_STEPS)
        self.dropped_samples = 0  # samples of steps run past the validation that ended the run (never applied)
        if spec.target_accuracy is not None:
            self.replica.stops_at = functools.partial(_stops_at_target, spec.target_accuracy)
        self.checkpointed_step: int | None = None  # the step the newest checkpoint on disk continues from
        splits: list[BatchSplit] = []
        if resume:
            _refuse_a_finished_run(run_dir)
            remove_stale_temps(run_dir)
            state = load_checkpoint(run_dir)
            self.replica.load_state_dict(state["replica"])
            torch.set_rng_state(state["torch_rng"])
            self.val_accuracy, self.val_loss = state.get("val_accuracy"), state.get("val_loss")
            self.val_metrics = dict(state.get("val_metrics", {}))
            self.train_metrics = dict(state.get("train_metrics", {}))
            self.elapsed_before_s = float(state.get("elapsed_s", 0.0))
            splits = _checkpointed_splits(state.get("splits", []), run_dir)
            self.checkpointed_step = self.replica.step
        try:
            if resume:
                MetricsLog.truncate_after(run_dir / "metrics.jsonl", self.replica.step)
            else:
                make_run_dir(run_dir)
                atomic_write_json(run_dir / "config.json", spec.to_json())
            self.metrics = MetricsLog(run_dir / "metrics.jsonl")
            self.lines = PendingLines(self.metrics.write, self.replica.learning_rates_at)  # each line with its step's lr
        except RunDirError as exc:
            raise exc.with_advice(self._next_move()) from None
        # a later stage of several boards sends its group's gradient every step: the sparse sync is the others'
        single = {k: params for k, params in enumerate(self.piped.staged.params)
                  if k > 0 and self.piped.plan.sizes[k] == 1} if self.piped is not None else {}
        if self.piped is not None and spec.stage_sync == "checkpoint" and single:  # from the step the run starts at
            sync = StageSync(every=spec.checkpoint_every, steps_per_epoch=spec.steps_per_epoch,
                             total_steps=spec.total_steps, start=self.replica.step)
            self.piped.sync_stages(sync)
            self.replica.stage_keeper = StageKeeper(sync, single)
        self.adapt = _Adaptation(spec, splits, self.replica.step)
        self._stop = asyncio.Event()
        self.flags: dict[str, list[str]] = {}
        self.streamed_steps: dict[str, int] = {}  # --overlap: each board's gradients sent during backward
        self._board_commands: dict[str, dict[str, Any]] = {}  # each board's train command, to ask it back after it left
        self._invited: dict[str, tuple[int, float]] = {}       # board -> (times asked back, when last)

    def request_stop(self) -> None:
        self._user_stop = True  # Ctrl-C, SIGTERM: the run ends here, even while a lost board is being planned around
        self._stop.set()

    def _replay_data(self) -> ReplayData | None:
        """The global batches, for a replica that replays training_step (global data mode: the coordinator holds them)."""
        if self.spec.data_mode != "global":
            return None
        sizes = [b for b in self.spec.batch_sizes if b > 0]  # a pipeline's stage hosts hold no data
        plan = GlobalBatchPlan(len(self.data.train), sizes, self.spec.seed)
        return ReplayData(dataset=self.data.train, collate_fn=self.data.collate_fn, global_indices=plan.global_indices)

    def _placement(self) -> PlacedRun:
        """The replica's model cut as ``--placement`` asks, checked on a sample batch (refused before any board starts)."""
        if self.replica.replay_reason:
            raise ConfigError(f"--placement {self.spec.placement}: {type(self.replica.model).__name__}."
                              f"{self.replica.replay_reason}, so the coordinator replays training_step, which a placed "
                              "run cannot yet: train it with --placement none")
        sample = self.data.collate_fn([self.data.train[i] for i in range(min(SAMPLE_ROWS, len(self.data.train)))])
        placed = prepare(self.replica.model, self.spec.placement, list(self.replica.exchanged), sample, self.replica.buffers)
        placed.threads = None if self.spec.threads else FreeCpuThreads().threads  # --threads fixes them
        return placed

    def _pipeline(self) -> PipedRun:
        """The replica's model cut into ``--pipeline``'s stages, checked on a sample batch (refused before any board
        starts)."""
        if self.replica.replay_reason:
            raise ConfigError(f"--pipeline: {type(self.replica.model).__name__}.{self.replica.replay_reason}, so the "
                              "coordinator replays training_step, which a pipelined run cannot yet: train it data-parallel")
        sample = self.data.collate_fn([self.data.train[i] for i in range(min(SAMPLE_ROWS, len(self.data.train)))])
        return prepare_pipeline(self.replica.model, parse_stage_plan(self.spec.pipeline), self.spec.micro_batches,
                                list(self.replica.exchanged), sample, self.spec.batch_sizes)

    def _pipeline_field(self, channel: BoardChannel, checker: HelloChecker) -> dict[str, Any] | None:
        """Each command's pipeline: the stages' boards, where they listen and their public keys (None: no pipeline).

        Raises:
            ConfigError: a stage's board has no Ed25519 key on this coordinator, or reports no address.
        """
        if self.piped is None:
            return None
        keys: dict[str, str] = {}
        hosts: dict[str, str] = {}
        for board in self.spec.boards:
            known = (checker.board_keys or {}).get(board)
            if not known:
                raise ConfigError(f"--pipeline: board {board} has no key of its own on this coordinator; the stages' "
                                  "links prove and encrypt with each board's Ed25519 key: give its public key in "
                                  f"--board-keys ({board}.pub) and set security.board_key_file on the board")
            keys[board] = bytes(known[0]).hex()
            caps = channel.caps.get(board)
            address = getattr(caps, "address", "") if caps is not None else ""
            if not address:
                raise ConfigError(f"--pipeline: board {board} reports no address its neighbours can reach it at: update "
                                  "its edge-agent, or set [training] address in its config")
            hosts[board] = address
        self.on_note(self.piped.describe())
        return self.piped.spec(hosts, keys, self.spec.pipeline_ports()).to_dict()

    def _pipeline_apply(self, apply: Callable[[Any, StepResult], None],
                        exchange: ExchangeServer) -> Callable[[Any, StepResult], None]:
        """The replica's ``apply`` for a pipelined step: only with every stage's gradient (and at a state step, the
        later stages' state, handed to the replica first). A stage's board that left (its worker failed, its link to
        a neighbour broke) ends the run at the last complete step, with its checkpoint: a pipeline cannot step
        without one of its stages."""

        def piped_apply(vector: Any, result: StepResult) -> None:
            missing = [b for b in self.spec.boards if b not in result.contributors]
            if not missing:
                if self.replica.stage_keeper is not None and isinstance(exchange.mode, PipelineStages):
                    states = exchange.mode.take_states(result.step)
                    if states:
                        self.replica.stage_states[result.step] = states
                apply(vector, result)
                return
            self._lose_stage(result.step, missing, "")

        return piped_apply

    def _lose_stage(self, step: int, missing: list[str], why: str) -> None:
        """A pipelined step came without every board's gradient: the run stops after the step before it."""
        self._stage_lost = True
        self._lost = (time.monotonic(), list(missing))
        self._stop.set()
        named = ", ".join(missing) or "of the pipeline"
        self.on_note(f"step {step}: board(s) {named} sent no gradient{f' ({why})' if why and not missing else ''}, and a "
                     f"pipeline cannot step without all of its boards: stopping "
                     f"{f'after step {step - 1}' if step else 'before its first step'}. Bring the board "
                     "back and --resume continues from the checkpoint, or --resume with --pipeline (other boards) "
                     "continues without it")

    def _check_target(self, step: int, elapsed_s: float) -> None:
        """After an epoch's validation: note the run as done if it reached ``target_accuracy``. If the
        validation gives no accuracy the target cannot be judged: the run stops at this step boundary
        with its checkpoint, as Ctrl-C would, saying why."""
        target = self.spec.target_accuracy
        if target is None or self.target_reached is not None:
            return
        if self.val_accuracy is None:
            self.on_note("--target-accuracy: this run's validation gives no accuracy (log val_acc or val_accuracy in "
                         "validation_step); stopping here. Set target_accuracy to null in the run's config.json and "
                         "resume it to train its full length")
            self._stop.set()
            return
        if self.val_accuracy >= target:
            self.target_reached = {"step": step, "epoch": (step + 1) // self.spec.steps_per_epoch,
                                   "val_accuracy": self.val_accuracy, "elapsed_s": round(elapsed_s, 3)}

    def _flush_steps(self, *, wait: bool) -> None:
        """Record the held steps in order: an epoch's last step once the replica has validated it (``wait``: wait for it).

        A step is held from its result until its figures are all there: only an epoch's last one waits (for its
        validation, which the replica may run while the boards go on); the steps after it wait behind it so that
        metrics.jsonl stays in step order.
        """
        while self._held:
            held = self._held[0]
            step = held.result.step
            val_s, validated = None, None
            if held.epoch_end:
                if not wait and not self.replica.done_through(step):
                    return
                if wait:
                    self.replica.drain()
                evaluating = time.monotonic()
                self._evaluate()  # the replica's validation_step ran in its thread: its time is added
                val_s = time.monotonic() - evaluating + self.replica.take_validation_s()
                if held.waited:  # it held up the steps: the steady rate leaves it out
                    self._steady.exclude(val_s)
                validated = held.elapsed + (time.monotonic() - held.at)  # when the figures were in: the steps went on
                self._check_target(step, self.elapsed_before_s + validated)
            self._held.popleft()
            result, elapsed = held.result, held.elapsed
            self._record(result, elapsed, held.rebalance, val_s, validated)
            self.on_step(StepView(step=step, total_steps=self.spec.total_steps, loss=result.loss,
                                  val_accuracy=self.val_accuracy,
                                  samples_per_s=held.samples / elapsed if elapsed > 0 else 0.0,
                                  board_compute_s=result.compute_s, late=result.late, refused=result.refused,
                                  batch_sizes=result.batch_sizes,
                                  shown={name: value for name, value in result.logs.items()
                                         if result.log_flags[name][2]}))
            if self.replica.stopped_after == step:  # the run ends here (its target): drop the steps run beyond it
                self._drop_held()
                return

    def _drop_held(self) -> None:
        """The steps the boards ran while the replica validated the step the run ends at: never applied (the replica
        stopped there), never recorded, not counted; the run continues, and ends, from the step after it."""
        if self._held:
            dropped = [h.result.step for h in self._held]
            self.dropped_samples += sum(h.result.n_total for h in self._held)
            self._held.clear()
            log.info("dropped steps %d-%d, run by the boards while the replica validated", dropped[0], dropped[-1])
        self.replica.end_at_stop()

    def _rolled_back(self, exchange: ExchangeServer) -> TrainOutcome | None:
        """A board failed an audit (its verdict may come a few steps late): the run ends to roll back; else None."""
        failures = self.audits.failures()
        if not failures:
            return None
        exchange.finished = True  # the model every board holds may carry its lies: back to before them, without it
        for failure in failures:
            self.on_note(failure.describe())
        return TrainOutcome(self.run_dir, {}, interrupted=False, rolled_back=failures)

    def _evaluate(self) -> None:
        """The epoch's validation figures: the module's own (its validation_step ran in the replica), else accuracy."""
        if self.replica.validates:
            metrics = self.replica.val_metrics
            self.val_metrics = dict(metrics)
            self.val_loss = metrics.get("val_loss")
            self.val_accuracy = _val_accuracy(metrics)
        elif self.data.val_loader is not None and self._fallback_accuracy:
            figures = self.replica.evaluate(self.data.val_loader())
            if figures is None:
                self._fallback_accuracy = False  # not a classifier of (input, label) batches: nothing to measure
                self.on_note("no validation: the module has no validation_step and its data is not (input, class "
                             "label) pairs; add a validation_step to see validation metrics")
                return
            self.val_loss, self.val_accuracy = figures
            self.val_metrics = {"val_loss": self.val_loss, "val_acc": self.val_accuracy}

    def _follow_plateau(self, exchange: ExchangeServer) -> None:
        """A ReduceLROnPlateau stepped in the replica (where its metric is): send its learning rates to the boards."""
        if not self.replica.plateau:
            return
        lrs = self.replica.learning_rates()
        if lrs != self._announced_lrs:
            exchange.announce_lrs(lrs)
            self._announced_lrs = lrs

    def _log_step(self, r: StepResult, interval_s: float | None) -> None:
        """The step in the run's logger: the fleet's loss (the boards' training_step losses, weighted by their samples)
        and samples/s, each board's compute time and samples/s, the learning rates (``run_logger``)."""
        logger = self.replica.logger
        if logger:  # a logger keeps the replica from lagging: the step is taken, its rates are known
            lrs = self.replica.step_lrs.get(r.step)
            logger.log_metrics(step_scalars(loss=r.loss, samples=r.n_total, interval_s=interval_s, compute_s=r.compute_s,
                                            batch_sizes=r.batch_sizes,
                                            lrs=lr_scalars(type(self.replica.optimizer).__name__, lrs) if lrs else {}),
                               step=r.step)

    def log_board_sample(self, board: str, power_w: float | None, cpu_percent: float | None, temp_c: float | None) -> None:
        """A board's telemetry sample in the run's logger, at the step the run is at (called from the power log's thread)."""
        if self.replica.logger:
            self.replica.logger.log_metrics(board_scalars(board, power_w=power_w, cpu_percent=cpu_percent, temp_c=temp_c),
                                            step=self.replica.step)

    def _checkpoint(self, elapsed_s: float) -> None:
        self.lines.flush()  # the replica has taken every step so far
        self.metrics.sync()  # every step the checkpoint covers is in metrics.jsonl on disk first
        state = self._checkpoint_state(elapsed_s)
        save_checkpoint(self.run_dir, state)
        self.checkpointed_step = int(state["replica"]["step"])

    def _checkpoint_state(self, elapsed_s: float) -> dict[str, Any]:
        self.replica.drain()  # every step given to it is done (it may trail the exchange)
        replica = self.replica.state_dict()  # between averages: the last average's (its step is the one resumed)
        return {"replica": replica, "torch_rng": torch.get_rng_state(), "val_accuracy": self.val_accuracy,
                "val_loss": self.val_loss, "val_metrics": self.val_metrics, "train_metrics": self.train_metrics,
                "elapsed_s": elapsed_s, "splits": [s.to_wire() for s in self.adapt.splits]}

    def _next_move(self) -> str:
        """What the user does after the run directory could not be written: resume, or start again."""
        if self.checkpointed_step is not None and (self.run_dir / CHECKPOINT).exists():
            return (f"the checkpoint of step {self.checkpointed_step} is intact: then continue with "
                    f"edge-coordinator train --resume {self.run_dir}")
        return f"nothing was checkpointed yet: then remove {self.run_dir} and start the run again"

    def _disk_error(self, exc: BaseException) -> RunDirError | None:
        """``exc`` as a run-directory error with the way on, if it is one (a full disk from Lightning's logger too)."""
        if isinstance(exc, RunDirError):
            return exc.with_advice(self._next_move())
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            target = Path(exc.filename) if isinstance(exc.filename, str) else self.run_dir / "logs"
            return write_error(target, exc, None).with_advice(self._next_move())
        return None

    def _welcome_state(self) -> tuple[int, Any, Any]:
        self.replica.drain()  # a joining board starts from the model every board holds now
        step, model_state, optimizer_state = self.replica.wire_state()
        return step, encode_value(model_state), encode_value(optimizer_state)

    def _welcome_extra(self) -> dict[str, Any]:
        schedulers = self.replica.scheduler_wire_state()
        extra: dict[str, Any] = {"schedulers": encode_value(schedulers)} if schedulers else {}
        module_state = self.replica.module_wire_state()  # a board joining mid-run loads what on_save_checkpoint kept
        if module_state is not None:
            extra["module_state"] = module_state
        loss_scale = self.replica.loss_scale_wire_state()  # 16-mixed: a joining board starts at the fleet's scale
        if loss_scale is not None:
            extra["loss_scale"] = loss_scale
        outer = self.replica.outer_wire_state()  # DiLoCo: a joining board steps on with the fleet's outer momentum
        if outer is not None:
            extra["outer_state"] = encode_value(outer)
        return extra

    def _exchange_security(self) -> tuple[HelloChecker, ssl.SSLContext | None]:
        """Each board's credential for the exchange, and the TLS server context of a certificate made for this run."""
        keys = CoordinatorKeys.from_bytes(self.fleet_key)
        cert = make_job_certificate(self.spec.run_id) if self.spec.exchange_tls else None
        checker = HelloChecker(board_keys=keys.board_keys, hmac_key=keys.secret if keys.algorithm == HMAC_ALGORITHM else None,
                               tls_sha256=cert.sha256 if cert is not None else "")
        for board in self.spec.boards:
            checker.token_for(board)  # decided now, so that the note below names every board given a token
        if checker.token_boards:  # allowed (--allow-token-boards): said at every run
            self.on_note(f"--allow-token-boards: board(s) {', '.join(checker.token_boards)} join the exchange with a token in "
                         "their signed command, which whoever reads the broker can read and use to take their place: give "
                         "each board a key of its own (security.board_key_file) and the coordinator the public keys "
                         "(--board-keys; docs/security.md)")
        if cert is None:
            self.on_note("the exchange runs without TLS (--no-exchange-tls): gradients cross the network in clear")
        return checker, (cert.server_context() if cert is not None else None)

    async def _serve_tail(self, host: str, checker: HelloChecker, tls: ssl.SSLContext | None) -> int:
        """A placed run's activation endpoint, on the exchange's host (its port; 0: data-parallel, none)."""
        if self.placed is None:
            return 0
        server = self.placed.serve(TailServer(job_id=self.spec.run_id, boards=list(self.spec.boards), cut=self.placed.cut,
                                              boundary=self.placed.boundary, output=self.placed.output,
                                              global_batch=sum(self.spec.batch_sizes), checker=checker, tls=tls))
        self.on_note(self.placed.describe(list(self.spec.batch_sizes)))
        return await server.start(host, 0)

    def _commands(self, host: str, port: int, checker: HelloChecker, tail_port: int = 0,
                  pipeline: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        s = self.spec
        return {board: TrainCommand(job_id=s.run_id, board_id=board, exchange_host=host, exchange_port=port,
                                    token=checker.token_for(board), exchange_tls_sha256=checker.tls_sha256,
                                    model=s.model, model_options=s.model_options, dataset=s.dataset,
                                    dataset_options=s.dataset_options, datamodule=s.datamodule,
                                    datamodule_options=s.datamodule_options, board_index=i, batch_sizes=list(s.batch_sizes),
                                    seed=s.seed, total_steps=s.total_steps, data_mode=s.data_mode, lr=s.lr,
                                    wire_dtype=s.wire_dtype, threads=s.threads, batches_per_epoch=self.batches_per_epoch,
                                    max_epochs=s.max_epochs,
                                    accumulate_grad_batches=s.accumulate_grad_batches,
                                    gradient_clip_val=s.gradient_clip_val,
                                    gradient_clip_algorithm=s.gradient_clip_algorithm,
                                    deterministic=s.deterministic, precision=s.precision, sync_every=s.sync_every,
                                    sync_warmup=s.sync_schedule.warmup, outer_optimizer=s.outer.name,
                                    outer_lr=s.outer.lr, outer_momentum=s.outer.momentum, overlap=s.overlap,
                                    placement=s.placement,
                                    tail_port=tail_port, pipeline=pipeline).to_dict()  # TRAIN_SCHEMA_VERSION
                for i, board in enumerate(s.boards)}

    async def run(self) -> TrainOutcome:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        awaited = sorted(self.comeback.lost - set(self.spec.boards)) if self.comeback is not None else []
        channel = BoardChannel(self.broker, self.fleet_key, [*self.spec.boards, *awaited])  # and the lost, watched
        self.adapt.explain = functools.partial(slowdown_cause, telemetry=channel.telemetry, caps=channel.caps)
        checker, tls = self._exchange_security()
        buffers = self.replica.buffers if self.placed is None else self.placed.head_buffers  # placed: the head's layers'
        exchange = ExchangeServer(job_id=self.spec.run_id, token="", tls=tls, checker=checker,
                                  boards=list(zip(self.spec.boards, self.spec.batch_sizes)),
                                  param_count=self.replica.param_count if self.placed is None else self.placed.head_elements,
                                  wire_dtype=self.spec.wire_dtype,
                                  welcome_state=self._welcome_state, welcome_extra=self._welcome_extra,
                                  buffer_elements=buffers.elements, buffer_sync=self.spec.sync_buffers,
                                  int_buffer_elements=buffers.int_elements,
                                  splits=self.adapt.splits, sync=self.spec.sync_schedule, overlap=self.spec.overlap,
                                  accumulate_grad_batches=self.spec.accumulate_grad_batches, aggregate=self.spec.aggregate,
                                  loss_scaled=self.spec.trainer_options.loss_scaled,
                                  pipeline=self.piped.layout if self.piped is not None else None)
        if self.piped is not None and isinstance(exchange.mode, PipelineStages):  # each board its own stage's state
            piped = self.piped
            exchange.mode.trim = lambda index, welcome: piped.stage_welcome(index, welcome, self.replica.optimizer)
        self.replica.start()  # its Trainer made the optimizer and schedulers a welcome hands out
        self.audits.attach(exchange, self.replica)
        self.audits.keep_start(self.replica.step, lambda: self._checkpoint_state(0.0))
        self._announced_lrs = self.replica.learning_rates()  # the boards start with these (the welcome's optimizer)
        await channel.open()
        port = 0  # this run's exchange, named in its stops: a re-planned run of the job is not stopped by them
        try:
            await check_boards_ready(channel, self.spec.boards, busy_wait_s=self.busy_wait_s)
            host = self.spec.exchange_host or exchange_host_for(self.broker)
            port = await exchange.start(host, self.spec.exchange_port)
            advertised = "127.0.0.1" if host == "0.0.0.0" else host
            tail_port = await self._serve_tail(host, checker, tls)
            self._board_commands = self._commands(advertised, port, checker, tail_port,
                                                  self._pipeline_field(channel, checker))
            for board, command in self._board_commands.items():
                channel.send(board, command)
            self.on_note(f"job {self.spec.run_id}: exchange on {advertised}:{port}; waiting for {len(self.spec.boards)} boards")
            if self.spec.rebalance and self.spec.data_mode != "global" and len(self.spec.boards) > 1:
                self.on_note("re-balancing is off: in local data mode each board's batch size is tied to its own data")
            if self.spec.sync_every > 1:
                self.on_note(f"periodic averaging: {self.spec.sync_schedule.describe()} (opt-in; this changes the "
                             "mathematics: the model differs from the exact mode's)")
            if self.audits.note:
                self.on_note(self.audits.note)
            if self.spec.aggregate != "mean":
                self.on_note(f"robust aggregation: each step's gradient is the boards' {self.spec.aggregate}, not their mean "
                             "(opt-in; this changes the mathematics: the model differs from the exact mode's)")
            if self.adapt.splits and self.replica.step > 0:
                self.on_note(f"continuing with batch sizes {','.join(map(str, self.adapt.latest()))} (re-balanced earlier)")
            joining = time.monotonic()
            await self._join(channel, exchange)
            self.join_s = time.monotonic() - joining
            try:
                return await self._steps(channel, exchange)
            except (RunDirError, OSError) as exc:
                disk = self._disk_error(exc)
                if disk is None:
                    raise
                log.debug("writing the run directory failed", exc_info=True)
                raise disk from None
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await exchange.close("job finished" if not self._stop.is_set() else "stopped by the coordinator")
            if self.placed is not None and self.placed.server is not None:
                await self.placed.server.close("job finished" if not self._stop.is_set() else "stopped by the coordinator")
            # a re-planned run of the same job follows: its boards end this run before its commands come (a revision's
            # are known; a board it leaves out, slowed, may take its time)
            revision = self.reviser.next_plan if self.reviser is not None and not self._stage_lost else None
            following = set(revision.boards if revision is not None else self.spec.boards) if self._next_plan else set()
            for board in self.spec.boards:
                channel.send(board, StopCommand(job_id=self.spec.run_id, board_id=board, exchange_port=port).to_dict(),
                             wait_s=NEXT_PLAN_WAIT_S if board in following else 1.0)
            if following:
                await self._until_not_busy(channel, following)
            channel.close()
            self.lines.close()
            self.metrics.close()
            self.replica.close()
            close_logger(self.replica.logger)

    async def _until_not_busy(self, channel: BoardChannel, boards: set[str]) -> None:
        """Before a re-planned run of this job starts: wait (up to :data:`NEXT_PLAN_WAIT_S`) until the ``boards`` it
        runs on have ended this run's job, so that a kept worker takes the next run's command (a board still in this
        run when it arrives stops this run's worker for it; the stops name this run's exchange, and leave the next run
        alone: ``agent.job_runner``)."""
        until = time.monotonic() + NEXT_PLAN_WAIT_S
        while time.monotonic() < until and any((status := channel.status.get(b)) is not None and status.state == "busy"
                                                for b in boards):
            await asyncio.sleep(OFFLINE_POLL_S)  # a poll of the broker's statuses, not a synchronisation

    async def _join(self, channel: BoardChannel, exchange: ExchangeServer) -> None:
        need = set(self.spec.boards)
        waiter = asyncio.ensure_future(exchange.wait_for_boards(JOIN_TIMEOUT_S, need=need))
        # A refusal fails its board only if the board does not take the command after all: someone
        # who can write the command topic could send a forged command for this job, whose refusal
        # must not fail a board that accepts the real one.
        accepted: set[str] = set()
        refused: dict[str, tuple[float, str]] = {}
        joined: set[str] = set()

        def announce() -> None:  # each board once, as it joins (a Pi takes tens of seconds to load torch)
            for board in sorted(need.intersection(exchange.connected) - joined):
                joined.add(board)
                if self.on_join is not None:
                    self.on_join(board, len(joined), len(need))

        while not waiter.done():
            announce()
            event = await channel.next_event(0.2)
            if event is not None and event.job_id == self.spec.run_id:
                if event.phase == "failed":
                    exchange.fail(event.board_id, event.message or event.phase)
                elif event.phase == "rejected" and event.board_id not in accepted:
                    refused.setdefault(event.board_id, (time.monotonic(), event.message or event.phase))
                elif event.phase in ("accepted", "running"):
                    accepted.add(event.board_id)
                    refused.pop(event.board_id, None)
            for board, (when, message) in list(refused.items()):
                if time.monotonic() - when >= REJECT_GRACE_S:
                    del refused[board]
                    exchange.fail(board, message)
            for board, why in channel.unverified(self.spec.run_id, REJECT_GRACE_S).items():  # no event of its verifies
                exchange.fail(board, why)
            for board in sorted(need - set(exchange.connected)):  # its agent died or lost the broker: no use waiting
                if board in channel.went_offline:
                    exchange.fail(board, f"went offline while joining ({channel.went_offline[board]}): check that its "
                                         "agent is running (journalctl -u edge-agent) or leave it out of --boards")
            if self._stop.is_set():
                waiter.cancel()
                raise KeyboardInterrupt
        waiter.result()
        announce()
        if self.placed is not None and self.placed.server is not None:  # boards join the exchange, then the tail host
            await self.placed.server.wait_for(need, JOIN_TIMEOUT_S)

    def _handle_events(self, channel: BoardChannel, exchange: ExchangeServer) -> None:
        for event in channel.drain_events():
            if event.job_id != self.spec.run_id:
                continue
            if event.phase == "failed":
                self._failures[event.board_id] = event.message
                self.on_note(f"board {event.board_id} failed: {event.message}")
                exchange.fail(event.board_id, event.message)
        self._ask_back(channel, exchange)
        self._watch_comeback(channel)

    def _deadline_s(self, step: int, exchange: ExchangeServer) -> float:
        """The least a board is waited for at ``step``: ``--step-timeout``, and at a pipeline's state step (its later
        stages' parameters and optimizer state, ``--stage-sync checkpoint``) the time their bytes take at
        :data:`STATE_BYTES_PER_S` more, up to :data:`MAX_STATE_WAIT_S`: a state step moves far more than the
        ordinary steps the deadline is fitted to."""
        keeper, least = self.replica.stage_keeper, self.spec.step_timeout_s
        if keeper is None or keeper.sync.kind(step) != STATE or self.piped is None:
            return least
        layout = self.piped.layout
        state_bytes = 4 * STATE_COPIES * sum(layout.elements[b] for b in range(layout.group, layout.boards)
                                             if not layout.averaged(b))
        return exchange.deadline_for_next_step(least) + min(state_bytes / STATE_BYTES_PER_S, MAX_STATE_WAIT_S)

    async def _with_boards_words(self, exc: ExchangeError, channel: BoardChannel) -> ExchangeError:
        """``exc`` (a step that could not complete) with what the boards said of their failure: a board's (its worker
        killed for memory, say) reaches the broker a moment after its connection to the exchange closed, so it is
        waited for, up to :data:`BOARD_WORDS_WAIT_S`."""
        words = await self._boards_words(channel)
        if not words:
            return exc
        return ExchangeError(f"{exc}. " + "; ".join(f"board {b}: {m}" for b, m in sorted(words.items())))

    async def _say_why_stages_failed(self, channel: BoardChannel) -> None:
        """A stage's board that sent nothing but is still online: its worker failed, and its row in the run's table only
        says that it left the exchange; note what the board said, waited for up to :data:`STAGE_WORDS_WAIT_S` (a board
        whose agent died says nothing, and the re-plan around it is timed as the run's recovery)."""
        lost = set(self._lost[1]) - set(channel.went_offline)
        if not lost:
            return
        noted = set(self._failures)
        for board, words in sorted((await self._boards_words(channel, STAGE_WORDS_WAIT_S)).items()):
            if board in lost and board not in noted:
                self.on_note(f"board {board} failed: {words}")

    async def _boards_words(self, channel: BoardChannel, wait_s: float = BOARD_WORDS_WAIT_S) -> dict[str, str]:
        """What the boards said of their part's failure, waiting up to ``wait_s`` for a first word."""
        words = dict(self._failures)
        until = time.monotonic() + wait_s
        while not words and (left := until - time.monotonic()) > 0:
            event = await channel.next_event(min(0.5, left))
            if event is not None and event.job_id == self.spec.run_id and event.phase == "failed":
                words[event.board_id] = self._failures[event.board_id] = event.message
        return words

    def _watch_comeback(self, channel: BoardChannel) -> None:
        """A board the pipeline lost is online again: the run stops at its next whole step and goes back to the plan."""
        if self.comeback is None or self._returned:
            return
        back = sorted(b for b in self.comeback.lost if b not in self.spec.boards
                      and (status := channel.status.get(b)) is not None and status.state == "online")
        if back:
            self._returned = back
            self.on_note(f"board(s) {', '.join(back)} online again: the run goes back to its planned pipeline "
                         f"({self.comeback.pipeline}) after its next whole step")

    def _ask_back(self, channel: BoardChannel, exchange: ExchangeServer) -> None:
        """Send the job's command again to a board that left and is online and idle again (its agent restarted,
        or its worker ended): it rejoins at a step boundary with the replica's state. At most
        :data:`MAX_REJOINS` times per board, :data:`REJOIN_EVERY_S` apart."""
        now = time.monotonic()
        connected = set(exchange.connected)
        for board, command in self._board_commands.items():
            status = channel.status.get(board)
            if board in connected or status is None or status.state != "online":
                continue
            asked, last = self._invited.get(board, (0, -math.inf))
            if asked >= MAX_REJOINS or now - last < REJOIN_EVERY_S:
                continue
            self._invited[board] = (asked + 1, now)
            if self.piped is not None:  # a pipeline needs every stage's board at every step
                self._invited[board] = (MAX_REJOINS, now)
                self.on_note(f"board {board} is online again, but a board cannot rejoin a pipelined run yet: Ctrl-C and "
                             "--resume continue from the last checkpoint with every stage")
                continue
            if self.placed is not None:  # a placed step's tail has run before a late board could catch up to it
                self._invited[board] = (MAX_REJOINS, now)
                self.on_note(f"board {board} is online again, but a board cannot rejoin a placed run yet (--placement): "
                             "the run goes on without it (Ctrl-C and --resume continue from the last checkpoint with every board)")
                continue
            channel.send(board, command)
            self.on_note(f"board {board} is online again: asked it to rejoin the job (from step {self.replica.step}; "
                         f"{asked + 1} of at most {MAX_REJOINS} times)")

    async def _steps(self, channel: BoardChannel, exchange: ExchangeServer) -> TrainOutcome:
        spec, started = self.spec, time.monotonic()
        samples, last_elapsed = 0, 0.0
        first_step = self.replica.step
        lags = self.placed is None and self.replica.may_lag  # the tail host reads the replica's tail at every step
        # Validation off the critical path: the boards go on with the next epoch while the replica validates (a
        # ReduceLROnPlateau, whose learning rate the boards need, never lags; nor do epochs of one step). With
        # --target-accuracy the replica stops after the validation that reaches it, and the steps the boards ran
        # meanwhile are dropped (``_flush_steps``): Trainer.fit's result.
        # (A module without a validation_step is measured by the run itself on the replica's model: that waits too.)
        validation_lags = lags and self.replica.validates and spec.steps_per_epoch > 1
        # A validation that ends the run (its target) may come in while the boards go on: the replica then takes no
        # more steps (nor counts them), so the run runs none after it; the post-loop flush drops the ones beyond it.
        while self.replica.step < spec.total_steps and not self._stop.is_set() and self.replica.stopped_after is None:
            self._handle_events(channel, exchange)
            step = self.replica.step
            epoch_end = (step + 1) % spec.steps_per_epoch == 0 or step + 1 == spec.total_steps
            if epoch_end and any(held.epoch_end for held in self._held):
                # One validation in flight at most: the epoch before is validated and recorded before this epoch's end
                # goes to the replica (its figures, and the epoch's means, are read from the replica as it is then).
                # In a short epoch (resnet_small on digits: 5 steps) that validation ended steps ago.
                self._flush_steps(wait=True)
            # The replica may trail the exchange by a few steps (an audit, a slow optimizer step on the coordinator,
            # validation, absorbed while the boards compute), except where the run reads it at once: a checkpoint,
            # the end, and a validation whose figures decide something.
            wait = (not lags or (epoch_end and not validation_lags) or (step + 1) % spec.checkpoint_every == 0
                    or step + 1 == spec.total_steps)
            apply: Callable[[Any, StepResult], None] = functools.partial(self.replica.apply, wait=wait)
            if self.placed is not None and self.placed.server is not None:  # the tail's rounds, then the head's exchange
                self.placed.fit_threads(step)
                tail = await self.placed.server.run_step(step, dict(zip(spec.boards, exchange.batch_sizes_at(step))),
                                                         exchange.deadline_for_next_step(spec.step_timeout_s))
                apply = self.placed.apply_with(tail, apply)
            if self.piped is not None:
                apply = self._pipeline_apply(apply, exchange)
            try:
                result = await exchange.run_step(step, apply=apply, minimum_deadline_s=self._deadline_s(step, exchange))
            except ExchangeError as exc:
                if self.piped is None:
                    raise await self._with_boards_words(exc, channel) from None
                self._lose_stage(step, [b for b in spec.boards if b not in exchange.connected], str(exc))
            if self._stage_lost:  # the step was not applied: the run ends at the last step every stage trained
                await self._say_why_stages_failed(channel)
                break
            rolled_back = self._rolled_back(exchange)
            if rolled_back is not None:
                return rolled_back
            if self.recovering_since is not None and self.recovery_s is None:
                self.recovery_s = time.monotonic() - self.recovering_since
                self.on_note(f"revised: step {step} trained on the revised pipeline {self.recovery_s:.1f} s after the "
                             "old one's last step" if self.revised else
                             f"recovered: step {step} trained on the re-planned pipeline {self.recovery_s:.1f} s after "
                             "the board was lost")
            samples += result.n_total
            elapsed = time.monotonic() - started
            self._log_step(result, elapsed - last_elapsed if step > first_step else None)
            last_elapsed = elapsed
            self._follow_plateau(exchange)
            self._steady.add(step - first_step, result.n_total, time.monotonic())
            rebalance = self.adapt.after_step(result, exchange)
            if rebalance is not None:
                self.on_note(_rebalance_note(rebalance))
            self._held.append(_HeldStep(result, elapsed, rebalance, samples, epoch_end, wait))
            if self.reviser is not None and self.comeback is None and not self._returned:
                await self.reviser.after_step(step, result.compute_s, lambda: _ram_bytes(channel))
            self._flush_steps(wait=wait)  # the steps whose figures are all there, in order (an epoch's end: validated)
            keeper = self.replica.stage_keeper
            if (step + 1) % spec.checkpoint_every == 0 or (keeper is not None and epoch_end):  # a sparse stage sync:
                self._checkpoint(self.elapsed_before_s + elapsed)  # each epoch's end is a state step: kept on disk
            if (self._returned or self._revising) and (keeper is None or keeper.whole_after(step)):  # a lost board
                self._stop.set()  # back, or a revision: the next plan from here
            if self.target_reached is not None:
                break
        self.replica.drain()  # an interrupted run: the steps the replica trailed by, and their audits
        self._flush_steps(wait=True)
        rolled_back = self._rolled_back(exchange)
        if rolled_back is not None:
            return rolled_back
        if self.target_reached is not None:
            self.on_note(f"step {self.target_reached['step']}: validation accuracy {self.val_accuracy:.4f} reached "
                         f"the target {spec.target_accuracy:g}; the run is complete")
        elapsed = time.monotonic() - started
        exchange.finished = True
        self.flags = exchange.flags()
        if self.placed is not None and self.placed.server is not None:
            for board, why in self.placed.server.flags().items():
                self.flags.setdefault(board, []).extend(why)
        self.streamed_steps = exchange.streamed_steps()
        keeper = self.replica.stage_keeper
        if keeper is None or keeper.whole_after(self.replica.step - 1):  # else the later stages are behind their boards
            self._checkpoint(self.elapsed_before_s + elapsed)
        interrupted = self.replica.step < spec.total_steps and self.target_reached is None
        if interrupted and self.checkpointed_step is not None and self.checkpointed_step < self.replica.step:
            between = ("the later stages' state syncs (--stage-sync checkpoint): the checkpoint holds the last one"
                       if keeper is not None else "averages: the checkpoint holds the last average")
            self.on_note(f"stopped between {between}, and --resume continues from step {self.checkpointed_step} (the "
                         "steps since then are trained again)")
        if not interrupted:
            self.replica.drain()
            atomic_torch_save(self.run_dir / "model.pt", self.replica.model.state_dict())
        summary = self._result(elapsed, samples - self.dropped_samples, exchange, interrupted)
        atomic_write_json(self.run_dir / "result.json", summary)
        comeback, lost_at = self.comeback, None
        replanned = await self._replan(channel) if self._stage_lost and interrupted else None
        self._next_plan = replanned is not None or bool((self._returned or self._revising) and interrupted
                                                        and not self._user_stop)
        revised = False
        if replanned is not None:  # lost for good: the plan without them, and the plan to come back to
            base = self.comeback or Comeback(self.spec.pipeline, tuple(self.spec.batch_sizes), frozenset(),
                                             micro_batches=self.spec.micro_batches, stage_sync=self.spec.stage_sync)
            comeback, lost_at = base.losing(set(channel.went_offline) & set(self._lost[1])), self._lost[0]
        elif self._returned and interrupted and not self._user_stop and not self._stage_lost and comeback is not None:
            replanned, comeback = comeback.back(self._returned)
            self.on_note(f"re-planning from step {self.replica.step}: {replanned.why} ({replanned.pipeline})")
        elif self._revising and interrupted and not self._user_stop and not self._stage_lost and self.reviser is not None:
            replanned, lost_at, revised = self.reviser.next_plan, time.monotonic(), True
            self.on_note(f"revising from step {self.replica.step}: "
                         f"{replanned.pipeline if replanned is not None and replanned.pipeline else 'data-parallel'}")
        return TrainOutcome(self.run_dir, summary, interrupted, replan=replanned, lost_at=lost_at, comeback=comeback,
                            revised=revised)

    @property
    def _revising(self) -> bool:
        """A revision around a slowed board waits for the run's next whole step (``run.stage_reviser``)."""
        return self.reviser is not None and self.reviser.next_plan is not None

    async def _replan(self, channel: BoardChannel) -> Replanned | None:
        """The pipeline without the boards it lost for good: those of the step's missing boards whose agent went
        offline (the others' workers ended because a neighbour's link broke: they can take part again). Waits up to
        :data:`OFFLINE_WAIT_S` for the broker to say which (a dead agent's last will). None: none went offline, stage 0
        has no board left, or the user stopped the run (Ctrl-C): it stops as it is, for ``--resume``."""
        missing = self._lost[1]
        until = time.monotonic() + OFFLINE_WAIT_S
        while time.monotonic() < until and not set(channel.went_offline) & set(missing) and not self._user_stop:
            await asyncio.sleep(OFFLINE_POLL_S)  # a poll of the broker's statuses, not a synchronisation
        gone = sorted(set(channel.went_offline) & set(missing))
        if not gone or self._user_stop:
            return None
        plan = parse_stage_plan(self.spec.pipeline)
        # the stages cut again at the speeds measured so far (--rebalance), else the lost ones merged into a neighbour
        measured = await self.reviser.without(gone, _ram_bytes(channel)) if self.reviser is not None else None
        replanned = measured or replan(plan, self.spec.batch_sizes, gone, self.spec.micro_batches)
        if replanned is None:
            self.on_note(f"board(s) {', '.join(gone)} went offline and none of stage 0's boards is left: stopping "
                         "(--resume continues from the checkpoint)")
            return None
        since = self.checkpointed_step if self.checkpointed_step is not None else self.replica.step
        self.on_note(f"board(s) {', '.join(gone)} went offline: re-planning from step {since}: "
                     f"{replanned.why} ({replanned.pipeline or 'data-parallel on ' + ','.join(replanned.boards)})")
        return replanned

    def _record(self, r: StepResult, elapsed: float, rebalance: dict[str, Any] | None, val_s: float | None = None,
                validated: float | None = None) -> None:
        # A re-balance rides in the record of the step that triggered it, so that metrics.jsonl stays
        # one line per applied step and a resume's truncation drops it with its step.
        record: dict[str, Any] = {
            "step": r.step, "n": r.n_total, "loss": r.loss, "boards": r.contributors, "late": r.late,
            "refused": r.refused, "compute_s": r.compute_s, "batch_sizes": r.batch_sizes,
            "wall_s": round(r.wall_s, 6), "elapsed_s": round(self.elapsed_before_s + elapsed, 3)}
        if rebalance is not None:
            record["rebalance"] = rebalance
        if r.overflowed:  # 16-mixed: skipped on every replica, the loss scale halved (DDP's rule)
            record["overflowed"] = r.overflowed
        if r.logs:  # what training_step logged, sample-weighted over the boards
            record["logs"] = r.logs
            self.train_metrics.update(r.logs)
        if (r.step + 1) % self.spec.steps_per_epoch == 0 or r.step + 1 == self.spec.total_steps:
            self.train_metrics.update(self.replica.epoch_train_metrics())  # on_epoch=True: the epoch's mean, as Lightning
        if self.val_metrics and ((r.step + 1) % self.spec.steps_per_epoch == 0 or r.step + 1 == self.spec.total_steps):
            record["val_accuracy"], record["val_loss"] = self.val_accuracy, self.val_loss
            record["val_metrics"] = dict(self.val_metrics)
        if val_s is not None:
            record["val_s"] = round(val_s, 3)  # the replica's validation (inside this step's interval where it waited)
        if validated is not None and validated - elapsed >= 0.001:  # the figures came after the step (the boards went on)
            record["validated_s"] = round(self.elapsed_before_s + validated, 3)
        if self.spec.sync_every > 1:
            record["kind"] = r.kind  # exact, local or sync (periodic averaging)
        self.lines.add(record)
        self.history.append(record)

    def _result(self, elapsed: float, samples: int, exchange: ExchangeServer, interrupted: bool) -> dict[str, Any]:
        per_board: dict[str, Any] = {}
        final = self.adapt.at(max(self.replica.step - 1, 0))  # the sizes the last applied step ran with
        for i, board in enumerate(self.spec.boards):
            times = [h["compute_s"][board] for h in self.history if board in h["compute_s"]]
            per_board[board] = {"batch_size": final[i], "initial_batch_size": self.spec.batch_sizes[i],
                                "steps_contributed": len(times),
                                "median_compute_s": statistics.median(times) if times else None,
                                "flags": self.flags.get(board, [])[:50]}
            if self.spec.overlap:
                per_board[board]["streamed_steps"] = self.streamed_steps.get(board, 0)
        return {"run_id": self.spec.run_id, "steps": self.replica.step, "total_steps": self.spec.total_steps,
                "interrupted": interrupted, "val_accuracy": self.val_accuracy, "val_loss": self.val_loss,
                "val_metrics": self.val_metrics, "train_metrics": self.train_metrics,
                "elapsed_s": round(self.elapsed_before_s + elapsed, 3),
                "samples_per_s": round(samples / elapsed, 2) if elapsed > 0 else None,
                "steady_samples_per_s": self._steady.samples_per_s(),
                "target_accuracy": self.spec.target_accuracy, "target_reached": self.target_reached,
                "join_s": None if self.join_s is None else round(self.join_s, 3),
                "steps_with_dropped_boards": sum(1 for h in self.history if h["late"] or h["refused"]),
                "exchange_bytes_in": exchange.bytes_in, "exchange_bytes_out": exchange.bytes_out,
                **self._placement_result(), "audits": self.audits.summary(),
                **({"pipeline": self.spec.pipeline} if self.spec.pipeline else {}),
                **({"revision_s" if self.revised else "recovery_s": round(self.recovery_s, 3)}
                   if self.recovery_s is not None else {}),
                "boards": per_board, "wire_dtype": self.spec.wire_dtype,
                "sync_every": self.spec.sync_every, "overlap": self.spec.overlap,
                "sync_warmup": self.spec.sync_schedule.warmup if self.spec.sync_every > 1 else None,
                **self._outer_result(),
                "mode": self.spec.sync_schedule.describe(),
                "rebalances": [{k: r[k] for k in ("step", "from_step", "new_batch_sizes", "message")}
                               for r in self.adapt.records]}

    def _outer_result(self) -> dict[str, Any]:
        """DiLoCo: the outer optimizer's settings for ``result.json``; nothing for the plain average."""
        outer = self.spec.outer
        if not outer.stepped:
            return {}
        return {"outer_optimizer": outer.name, "outer_lr": outer.lr, "outer_momentum": outer.momentum}

    def _placement_result(self) -> dict[str, Any]:
        """A placed run's cut and the activation rounds' bytes (both ways, all boards); nothing for data-parallel."""
        server = self.placed.server if self.placed is not None else None
        if server is None:
            return {}
        return {"placement": self.spec.placement, "activation_bytes_in": server.bytes_in,
                "activation_bytes_out": server.bytes_out}


def _ram_bytes(channel: BoardChannel) -> dict[str, int]:
    """Each board's RAM, from its caps (a pipeline's revision keeps every stage within it)."""
    return {b: c.ram_bytes for b, c in channel.caps.items() if c is not None}


def _rebalance_note(record: dict[str, Any]) -> str:
    """The user's line for a re-balance, e.g. ``step 41: re-balancing from step 44: pi4-1 slowed 38% ...``."""
    line = f"step {record['step']}: re-balancing from step {record['from_step']}: {record['message']}"
    if "predicted_step_s" in record:
        line += f" (compute per step {record['current_step_s']:.3f} s -> {record['predicted_step_s']:.3f} s predicted)"
    return line


__all__ = ["ExchangeError", "StepView", "TrainOutcome", "TrainingRun", "exchange_host_for"]
