"""The job the coordinator trains: one typed spec for ``train``, ``train --auto``, pre-training and the demo.

A :class:`JobSpec` says what to train (model, data, options), on which boards with which batch
sizes, for how long, and with which Lightning and exchange settings. The request fields come from
the user (the command line builds them from its flags; a script builds them directly); the run
fields (``run_id``, ``total_steps``, ``steps_per_epoch``, ``batches_per_epoch``) are filled in by
:func:`edgefleet.coordinator.run.train_job.resolve_job` once the boards and the dataset's size are
known. A resolved spec is what a run saves as ``config.json`` and what ``--resume`` reads back.

The board's side of a job is :class:`edgefleet.protocol.jobs.TrainCommand`, the wire message each
board receives: the coordinator builds one per board from the resolved spec.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgefleet.protocol.aggregates import AGGREGATES
from edgefleet.protocol.errors import ConfigError, DecodeError
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.jobs import DATA_MODES
from edgefleet.protocol.outer_optimizer import AVERAGE, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, OuterOptimizer, outer_problem
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

if TYPE_CHECKING:  # torch: only when a job is checked or run, not with the command line's parser
    from edgefleet.workloads.fleet_trainer import TrainerOptions

log = logging.getLogger(__name__)

DEFAULT_EPOCHS = 5.0        # when a job gives neither epochs nor steps
DEFAULT_BATCH = 32          # per board
BUFFER_SYNC = ("broadcast", "average")  # float buffers after each step: the first board's (DDP) or their average


# When a pipeline's later stages send their state to the replica (``protocol.stage_sync``): every step, or at checkpoints
STAGE_SYNCS = ("step", "checkpoint")
DEFAULT_PIPELINE_PORT = 47310  # a pipeline's first board's port (--pipeline-port)
PIPELINE_PORTS = 64  # a pipeline's boards listen on --pipeline-port and the ports after it, one each


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job: what to train, where, for how long and how.

    Attributes:
        model: ``lenet5``, ``mlp``, ``resnet_small``, an entry point or ``pkg.module:Class``.
        dataset: A dataset spec (``digits``, ``synthetic``, ``npz``, ``pkg.module:factory``), or ""
            with ``datamodule``.
        model_options: The model constructor's keyword arguments (a variant's options included).
        dataset_options: The dataset factory's keyword arguments.
        datamodule: ``pkg.mod:Class``, a LightningDataModule, instead of ``dataset``.
        datamodule_options: The DataModule constructor's keyword arguments.
        boards: The boards that take part, in order; () = every online board that can train (for
            ``auto_train``: the planner may use any of them).
        batch_sizes: Each board's batch size, by index; one value = the same for every board.
        epochs: Epochs over the dataset (:data:`DEFAULT_EPOCHS` when neither this nor ``steps``).
        steps: Global steps instead of epochs.
        target_accuracy: Stop, as a finished run, after the first epoch whose validation accuracy
            reaches this (0-1]; None runs every epoch or step given.
        seed: Seeds the initial weights and the data order.
        lr: Overrides the model's learning rate.
        wire_dtype: Gradients on the wire (:data:`~edgefleet.protocol.wire_dtype.WIRE_DTYPES`).
        data_mode: ``global`` (each board takes its slice of every global batch) or ``local``.
        threads: Torch threads per board; 0 = what the board's CPU quota (else its CPUs) fits.
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, deterministic,
            precision: Lightning's Trainer flags, the same on every board and on the replica.
        logger: The coordinator's Lightning logger: ``none``, ``csv`` or ``tensorboard``.
        sync_buffers: Float buffers after each step (:data:`BUFFER_SYNC`).
        log_every_n_steps: The logger's cadence for per-step values.
        checkpoint_every: Steps between checkpoints.
        step_timeout_s: A board later than max(this, 5x the median step) is left out of that step.
        exchange_host: The address the boards connect to; "" = this machine's towards the broker.
        exchange_port: The gradient exchange's TCP port; 0 = any free port.
        exchange_tls: The exchange speaks TLS with a certificate made for the run (pinned in the
            signed commands); False sends gradients in clear (a trusted cable, or to measure TLS's cost).
        rebalance: Re-balance the batch sizes when a board's speed drifts (global data mode).
        rebalance_threshold: Relative change of a board's time per sample that counts as drift.
        sync_every: Periodic averaging (local SGD, ``protocol.sync_schedule``): after the warm-up each
            board steps on its own gradient and the boards' parameters are averaged every this many
            steps; 1 (the default) averages gradients at every step, DDP's mathematics. Above 1 the
            mathematics change (the model differs from single-process Lightning's) for 1/H the bytes.
        sync_warmup: Exact steps before the first local one; None = the first epoch's steps
            (``resolve_job`` sets it to ``steps_per_epoch`` when ``sync_every`` > 1).
        outer_optimizer: What a sync step of periodic averaging does with the fleet's average change
            (``protocol.outer_optimizer``): ``average`` (the default: the boards' parameters averaged),
            ``diloco`` (DiLoCo: SGD with Nesterov momentum on the averaged change) or ``sgd`` (heavy-ball
            momentum). Only with ``sync_every`` > 1.
        outer_lr: The outer optimizer's learning rate (DiLoCo's paper: 0.7).
        outer_momentum: The outer optimizer's momentum (DiLoCo's paper: 0.9).
        overlap: Send each board's gradient as backward produces it (the vector in reversed parameter
            order, streamed in buckets), hiding the upload behind backward; the same mathematics, the
            same result as without it. Not with ``sync_every`` > 1.
        placement: Layer placement (``workloads.layer_cut``): cut the model after this layer (``net.6``); the
            head trains data-parallel on the boards, the tail on the coordinator over the whole global batch, and
            the boards send activations instead of the tail's gradient; "" (``none``): data-parallel.
        pipeline: Pipeline stages (``coordinator.pipeline``): ``BOARD,CUT@BOARD,...``, stage 0's board (it holds the
            data) and, for each later stage, the cut before it and its board; each board trains its own stage and
            the boards send activations between them; "" : not a pipeline. The boards are then the pipeline's, in
            stage order, and the batch sizes stage 0's boards' then a 0 for each later stage: stage 0 holds the data.
            Stage 0 may be several boards joined by ``+`` (data-parallel among them).
        micro_batches: A pipeline's micro-batches per step (GPipe: every forward, then every backward).
        pipeline_port: A pipeline's board listens for its neighbours on this port + its place in
            ``pipeline_slots``.
        pipeline_slots: The boards in the order of their pipeline ports: the job's first pipeline's, then any board
            a re-plan adds. Kept through re-plans, so a board keeps its port in every run of the job (a board another
            run left out may still hold its own: on one host, as in the tests, the ports must not move).
        stage_sync: When a pipeline's later stages send the replica what (``protocol.stage_sync``): ``step`` (their
            gradient every step: a lost board costs no step) or ``checkpoint`` (their state at checkpoints and
            epoch ends only, their links free of it otherwise; a lost board sends the run back to the last one).
        aggregate: How each step's gradients are reduced: ``mean`` (the exact mode), or a robust rule
            (``trimmed-mean``, ``median``, ``clip``: ``coordinator.exchange.robust_reduce``) that bounds what one
            board with valid keys can do to a step, and changes the mathematics (opt-in; for local data).
        audit_share: Audits by recomputation (``coordinator.audit``): the share of the coordinator's time spent
            computing boards' gradients again to check them (global data mode, exact steps); 0 = no audits.
        audit_every: A fixed number of steps within which each board is audited once (at a random one of them),
            instead of the one ``audit_share`` fits; None = fitted.
        allow_token_boards: Boards without a key of their own may join the exchange with a token carried in their
            signed command (readable on the broker); False refuses the job before any board starts.
        force_split: Test hook: a re-split (:class:`~edgefleet.protocol.exchange_frames.BatchSplit`) announced in time.
        run_id: The run's name (set by ``resolve_job``).
        total_steps: Global steps of the run (set by ``resolve_job``).
        steps_per_epoch: Optimizer steps in an epoch (set by ``resolve_job``).
        batches_per_epoch: Global batches in an epoch (set by ``resolve_job``; 0 in runs saved
            before it was recorded: counted from the data).
    """

    model: str
    dataset: str = ""
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)
    datamodule: str = ""
    datamodule_options: dict[str, Any] = field(default_factory=dict)
    boards: tuple[str, ...] = ()
    batch_sizes: tuple[int, ...] = (DEFAULT_BATCH,)
    epochs: float | None = None
    steps: int | None = None
    target_accuracy: float | None = None
    seed: int = 0
    lr: float | None = None
    wire_dtype: str = "float32"
    data_mode: str = "global"
    threads: int = 0
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    deterministic: bool = False
    precision: str = "32-true"
    logger: str = "none"
    sync_buffers: str = "broadcast"
    log_every_n_steps: int = 50
    checkpoint_every: int = 50
    step_timeout_s: float = 10.0
    exchange_host: str = ""
    exchange_port: int = 0
    exchange_tls: bool = True
    rebalance: bool = True
    rebalance_threshold: float = 0.15
    sync_every: int = 1
    sync_warmup: int | None = None
    outer_optimizer: str = AVERAGE
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    overlap: bool = False
    placement: str = ""
    pipeline: str = ""
    micro_batches: int = 1
    pipeline_port: int = DEFAULT_PIPELINE_PORT
    pipeline_slots: tuple[str, ...] = ()
    stage_sync: str = "step"
    aggregate: str = "mean"
    audit_share: float = 0.25
    audit_every: int | None = None
    allow_token_boards: bool = False
    force_split: BatchSplit | None = None
    run_id: str = ""
    total_steps: int = 0
    steps_per_epoch: int = 0
    batches_per_epoch: int = 0

    def __post_init__(self) -> None:
        # config.json holds lists; a spec holds tuples
        object.__setattr__(self, "boards", tuple(self.boards))
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        if not isinstance(self.pipeline_slots, (list, tuple)) or not all(isinstance(b, str) for b in self.pipeline_slots):
            raise ConfigError(f"pipeline_slots {self.pipeline_slots!r:.40} in config.json is not a list of board ids")
        slots = tuple(self.pipeline_slots)
        if self.pipeline:
            slots += tuple(b for b in self.boards if b not in slots)
        object.__setattr__(self, "pipeline_slots", slots)
        if isinstance(self.force_split, dict):  # as config.json holds it
            try:
                object.__setattr__(self, "force_split", BatchSplit.from_wire(self.force_split))
            except DecodeError as exc:
                raise ConfigError(f"force_split: {exc}") from None
        self._check()

    def _check(self) -> None:
        """Raises ConfigError for a value no run could take, naming the command line's flag."""
        if bool(self.dataset) == bool(self.datamodule):
            raise ConfigError("give a dataset or a DataModule (exactly one of them)")
        if self.datamodule and self.dataset_options:
            raise ConfigError("--dataset-options belong to --dataset; a DataModule takes --datamodule-options")
        if self.pipeline and _stage_0_then_zeros(self.batch_sizes):
            pass  # a resolved pipeline: stage 0's boards hold the batch, the later stages' none
        elif not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"--batch {','.join(map(str, self.batch_sizes))}: every batch size must be at least 1")
        if len(set(self.boards)) != len(self.boards):
            raise ConfigError(f"--boards names a board twice: {','.join(self.boards)}")
        if self.epochs is not None and self.steps is not None:
            raise ConfigError("give epochs or steps, not both")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"--epochs {self.epochs:g} must be positive")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: give at least 1 step")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy {self.target_accuracy:g}: give a fraction in (0, 1], e.g. 0.95")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"--wire-dtype {self.wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        if self.data_mode not in DATA_MODES:
            raise ConfigError(f"--data-mode {self.data_mode!r} is not one of {', '.join(DATA_MODES)}")
        if self.sync_buffers not in BUFFER_SYNC:
            raise ConfigError(f"--sync-buffers {self.sync_buffers!r} is not one of {', '.join(BUFFER_SYNC)}")
        if not self.rebalance_threshold > 0:
            raise ConfigError(f"--rebalance-threshold {self.rebalance_threshold}: use a fraction above 0, e.g. 0.15")
        if self.force_split is not None and self.data_mode != "global":
            raise ConfigError("--force-split needs --data-mode global: only a global batch can be re-split")
        self._check_sync()
        self._check_placement()
        self._check_pipeline()
        self._check_aggregate()
        self._check_loss_scale()
        if isinstance(self.audit_share, bool) or not isinstance(self.audit_share, (int, float)) or not 0 <= self.audit_share <= 1:
            raise ConfigError(f"--audit-share {self.audit_share!r:.20}: give a fraction of the coordinator's time in [0, 1], "
                              "e.g. 0.25 (0 turns audits off)")
        if self.audit_every is not None and (type(self.audit_every) is not int or self.audit_every < 1):
            raise ConfigError(f"--audit-every {self.audit_every!r:.20}: give a whole number of steps >= 1")
        if self.log_every_n_steps < 1:
            raise ConfigError(f"--log-every-n-steps {self.log_every_n_steps}: use a whole number of steps >= 1")
        _ = self.trainer_options  # TrainerOptions checks Lightning's flags

    def _check_sync(self) -> None:
        """Raises ConfigError for periodic averaging that cannot run as asked, saying what to do instead."""
        if type(self.sync_every) is not int or self.sync_every < 1:
            raise ConfigError(f"--sync-every {self.sync_every!r}: give a whole number of steps >= 1 (1 = average the "
                              "gradients at every step, the exact mode)")
        if self.sync_warmup is not None and (type(self.sync_warmup) is not int or self.sync_warmup < 0):
            raise ConfigError(f"--sync-warmup {self.sync_warmup!r}: give a whole number of exact steps >= 0 "
                              "(default: the first epoch's steps)")
        if self.sync_every > 1 and self.accumulate_grad_batches != 1:
            raise ConfigError(f"--sync-every {self.sync_every} with --accumulate-grad-batches "
                              f"{self.accumulate_grad_batches}: periodic averaging steps each board on each of its "
                              "batches; use one or the other (a larger --batch or a larger --sync-every instead of "
                              "accumulation)")
        problem = outer_problem(self.outer_optimizer, self.outer_lr, self.outer_momentum)
        if problem:
            raise ConfigError(problem)
        if self.outer_optimizer != AVERAGE and self.sync_every <= 1:
            raise ConfigError(f"--outer-optimizer {self.outer_optimizer} steps on the boards' averaged change every H "
                              "steps: add --sync-every H (H > 1, e.g. 8), or leave --outer-optimizer out for the exact mode")
        if type(self.overlap) is not bool:
            raise ConfigError(f"overlap {self.overlap!r:.20} in config.json is not true or false")
        if self.overlap and self.sync_every > 1:
            raise ConfigError(f"--overlap with --sync-every {self.sync_every}: overlap streams every step's gradient, "
                              "periodic averaging sends one every few steps; use one or the other")

    def _check_placement(self) -> None:
        """Raises ConfigError for layer placement with what it cannot honour yet, saying what to do instead."""
        if not isinstance(self.placement, str):
            raise ConfigError(f"placement {self.placement!r:.20} in config.json is not a layer's name")
        if not self.placement:
            return
        clashes = [flag for flag, used in (
            (f"--accumulate-grad-batches {self.accumulate_grad_batches}", self.accumulate_grad_batches != 1),
            (f"--sync-every {self.sync_every}", self.sync_every > 1), ("--overlap", self.overlap),
            (f"--gradient-clip-val {self.gradient_clip_val}", self.gradient_clip_val is not None),
            (f"--precision {self.precision}", self.precision not in ("32", "32-true")),
            ("--force-split", self.force_split is not None)) if used]
        if clashes:
            raise ConfigError(f"--placement {self.placement} cannot be combined with {', '.join(clashes)} yet (the tail "
                              "host would see another step than the boards): leave them out, or train with --placement none")

    def _check_pipeline(self) -> None:
        """Raises ConfigError for a pipeline with what it cannot honour yet, saying what to do instead."""
        if not isinstance(self.pipeline, str):
            raise ConfigError(f"pipeline {self.pipeline!r:.20} in config.json is not BOARD,CUT@BOARD,...")
        if type(self.micro_batches) is not int or not 1 <= self.micro_batches <= 4096:
            raise ConfigError(f"--micro-batches {self.micro_batches!r:.20}: give a whole number from 1 to 4096")
        if type(self.pipeline_port) is not int or not 1024 <= self.pipeline_port <= 65535 - PIPELINE_PORTS:
            raise ConfigError(f"--pipeline-port {self.pipeline_port!r:.20}: give a port from 1024 to "
                              f"{65535 - PIPELINE_PORTS}")
        if len(self.pipeline_slots) > PIPELINE_PORTS:
            raise ConfigError(f"a pipeline over {len(self.pipeline_slots)} boards: its ports (--pipeline-port and the "
                              f"{PIPELINE_PORTS - 1} after it) hold at most {PIPELINE_PORTS}")
        if self.stage_sync not in STAGE_SYNCS:
            raise ConfigError(f"--stage-sync {self.stage_sync!r:.20} is not one of {', '.join(STAGE_SYNCS)}")
        if not self.pipeline:
            if self.micro_batches != 1:
                raise ConfigError("--micro-batches splits a pipeline's batch: add --pipeline, or leave it out")
            if self.stage_sync != "step":
                raise ConfigError(f"--stage-sync {self.stage_sync} says when a pipeline's later stages send their state: "
                                  "add --pipeline, or leave it out")
            return
        if self.stage_sync == "checkpoint" and self.wire_dtype != "float32":
            raise ConfigError(f"--stage-sync checkpoint sends the later stages' parameters and optimizer state, which "
                              f"--wire-dtype {self.wire_dtype} would round: leave --wire-dtype out (float32)")
        clashes = [flag for flag, used in (
            (f"--accumulate-grad-batches {self.accumulate_grad_batches}", self.accumulate_grad_batches != 1),
            (f"--sync-every {self.sync_every}", self.sync_every > 1), ("--overlap", self.overlap),
            (f"--placement {self.placement}", bool(self.placement)),
            (f"--aggregate {self.aggregate}", self.aggregate != "mean"),
            ("--gradient-clip-algorithm norm", self.gradient_clip_val is not None and self.gradient_clip_algorithm == "norm"),
            (f"--precision {self.precision}", self.precision not in ("32", "32-true")),
            (f"--data-mode {self.data_mode}", self.data_mode != "global"),
            ("--force-split", self.force_split is not None)) if used]
        if clashes:
            raise ConfigError(f"--pipeline cannot be combined with {', '.join(clashes)} yet (each stage steps its own "
                              "parameters; these need the whole model's gradient, or another loss scale, on every "
                              "board): leave them out, or train it data-parallel")

    def _check_loss_scale(self) -> None:
        """Raises ConfigError for 16-mixed with a mode whose replicas would not skip the same steps alike."""
        if self.precision != "16-mixed":
            return
        clashes = [flag for flag, used in ((f"--sync-every {self.sync_every}", self.sync_every > 1),
                                           (f"--aggregate {self.aggregate}", self.aggregate != "mean")) if used]
        if clashes:
            raise ConfigError(f"--precision 16-mixed cannot be combined with {', '.join(clashes)}: its loss scale must move "
                              "alike on every board, and there a board steps on its own or the fleet's gradient is not "
                              "one average; use --precision bf16-mixed or 32-true, or leave them out")

    def _check_aggregate(self) -> None:
        """Raises ConfigError for a robust aggregate that is unknown or cannot run with the job's other settings."""
        if self.aggregate not in AGGREGATES:
            raise ConfigError(f"--aggregate {self.aggregate!r:.30}: choose one of {', '.join(AGGREGATES)}")
        if self.aggregate == "mean":
            return
        clashes = [flag for flag, used in ((f"--sync-every {self.sync_every}", self.sync_every > 1),
                                           ("--overlap", self.overlap), (f"--placement {self.placement}", bool(self.placement)))
                   if used]
        if clashes:
            raise ConfigError(f"--aggregate {self.aggregate} reduces each step's gradients and cannot be combined with "
                              f"{', '.join(clashes)}: leave them out, or use --aggregate mean")

    @property
    def sync_schedule(self) -> SyncSchedule:
        """Which steps average gradients, parameters or nothing (``protocol.sync_schedule``); needs a resolved spec."""
        warmup = self.sync_warmup if self.sync_warmup is not None else self.steps_per_epoch
        return SyncSchedule(every=self.sync_every, warmup=warmup, steps_per_epoch=self.steps_per_epoch,
                            total_steps=self.total_steps, outer=self.outer)

    @property
    def outer(self) -> OuterOptimizer:
        """What a sync step does with the fleet's average change (``protocol.outer_optimizer``)."""
        return OuterOptimizer(name=self.outer_optimizer, lr=float(self.outer_lr), momentum=float(self.outer_momentum))

    @property
    def trainer_options(self) -> TrainerOptions:
        """Lightning's Trainer flags of the job. Raises ConfigError for a value Lightning cannot honour here."""
        from edgefleet.workloads.fleet_trainer import TrainerOptions  # torch: off the CLI start-up path

        return TrainerOptions(accumulate_grad_batches=self.accumulate_grad_batches,
                              gradient_clip_val=self.gradient_clip_val,
                              gradient_clip_algorithm=self.gradient_clip_algorithm, deterministic=self.deterministic,
                              precision=self.precision)

    @property
    def max_epochs(self) -> int:
        """The run's whole epochs when it was asked for in epochs (``Trainer(max_epochs=E)``), else 0 (asked for in steps,
        or a fraction of an epoch: ``Trainer(max_steps=N)``). Only for a resolved spec."""
        if self.steps is not None:
            return 0
        epochs = self.epochs if self.epochs is not None else DEFAULT_EPOCHS
        whole = int(epochs)
        return whole if whole == epochs and whole * self.steps_per_epoch == self.total_steps else 0

    @property
    def resolved(self) -> bool:
        """True once the boards, the batch size of each and the run's length are fixed (``resolve_job``)."""
        return bool(self.run_id) and self.total_steps > 0 and len(self.boards) == len(self.batch_sizes) > 0

    @property
    def data_name(self) -> str:
        """The dataset's or DataModule's spec, whichever the job uses."""
        return self.datamodule or self.dataset

    def pipeline_ports(self) -> dict[str, int]:
        """Where each of the pipeline's boards listens for its neighbours: the same port in every run of the job."""
        return {board: self.pipeline_port + self.pipeline_slots.index(board) for board in self.boards}

    def to_json(self) -> dict[str, Any]:
        """The spec as ``config.json`` holds it."""
        data = dataclasses.asdict(self)
        data["force_split"] = None if self.force_split is None else self.force_split.to_wire()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        """A spec from ``config.json``. Raises ConfigError for keys this version does not know."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"config.json has unknown keys {sorted(unknown)}: written by a newer edgefleet?")
        return cls(**data)


def _stage_0_then_zeros(sizes: tuple[int, ...]) -> bool:
    """Whether ``sizes`` are a resolved pipeline's: stage 0's boards' (each at least 1), then one or more 0."""
    first = sizes.index(0) if 0 in sizes else len(sizes)
    return 0 < first < len(sizes) and min(sizes[:first]) >= 1 and not any(sizes[first:])


def batches_per_epoch(spec: JobSpec, dataset_len: int, batch_sizes: tuple[int, ...]) -> int:
    """Global batches in one pass over ``dataset_len`` samples, in the spec's data mode."""
    from edgefleet.workloads.sharding import GlobalBatchPlan  # torch: off the CLI's start-up path

    sizes = [b for b in batch_sizes if b > 0]  # a pipeline's stage hosts hold no data
    if spec.data_mode == "global":
        return GlobalBatchPlan(dataset_len, sizes, spec.seed).steps_per_epoch
    return max(1, dataset_len // max(sizes))


__all__ = ["BUFFER_SYNC", "DEFAULT_BATCH", "DEFAULT_EPOCHS", "DEFAULT_PIPELINE_PORT", "JobSpec", "batches_per_epoch"]
