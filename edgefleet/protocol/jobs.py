"""Jobs on the control plane: the commands a board is given and the events it sends back.

``train`` starts (or joins) a training job, ``profile`` measures the board for the planner
(step times at several batch sizes, power, peak memory, link throughput), ``stop`` ends a job.

Commands travel signed (``protocol.signing``) on ``…/boards/<id>/cmd``; events travel as msgpack
on ``…/boards/<id>/events``, signed by the board when it has a key of its own. Both are plain maps
validated into these dataclasses, so a malformed or hostile message is refused with a message that
names the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from edgefleet.protocol._validate import message_from_dict
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.outer_optimizer import AVERAGE, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, outer_problem
from edgefleet.protocol.pipeline_command import PipelineSpec
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

JOB_SCHEMA_VERSION = 1
# Version 2 of the train command asks for what a version-1 agent would silently leave out (a
# LightningDataModule, Lightning's Trainer flags, the schedulers' state in the welcome): such an
# agent refuses it as newer than it understands, and its log says to upgrade edgefleet.
# Version 3 joins the exchange over TLS pinned to ``exchange_tls_sha256`` with a proof of the board's key
# instead of a token: a version-2 agent would ignore the pin and show an empty token.
# Version 4 may ask for periodic averaging (``sync_every`` > 1): a version-3 agent would ignore it and
# train exact steps while the others train local ones (:data:`PERIODIC_TRAIN_SCHEMA_VERSION`).
# Version 5 may ask for overlap (``overlap``): the gradient vector in reversed parameter order, streamed
# during backward; a version-4 agent would send today's order and its gradient would be averaged
# with the wrong elements (:data:`OVERLAP_TRAIN_SCHEMA_VERSION`).
# Version 6, every train command: the board seeds its random generators before every batch from the
# run's seed, its place in the split and the batch, takes the DataModule's batch-transfer hooks,
# runs the module's setup and configure_model before joining, shows the module the run's figures
# (``max_epochs`` among them) and exchanges integer buffers with the float ones. A version-5 agent
# would train any job differently without a word (or with another vector size), so every command
# is version 6 and such an agent refuses it as too new: upgrade every board together.
# Version 7 may ask for layer placement (``placement``: the cut, ``tail_port``: the tail host's
# activation endpoint on the exchange's host): a version-6 agent would train the whole model on its
# own (:data:`PLACED_TRAIN_SCHEMA_VERSION`).
# Version 8 may ask for DiLoCo's outer optimizer (``outer_optimizer``, ``outer_lr``, ``outer_momentum``): a
# version-7 agent would ignore it and plainly average at each sync step while the coordinator's replica
# stepped the outer optimizer (:data:`OUTER_TRAIN_SCHEMA_VERSION`).
# Version 9 may ask for pipeline stages (``pipeline``: the cuts, the micro-batches and every stage's board,
# address, port and public key; ``protocol.pipeline_command``): a version-8 agent would ignore it and train the
# whole model on its slice of the batch (:data:`PIPELINE_TRAIN_SCHEMA_VERSION`).
# Version 10 may ask a pipeline's later stages to send their state only at checkpoints (``pipeline.state_every``,
# ``protocol.stage_sync``): a version-9 agent would ignore it and send its gradient every step, which the coordinator
# would refuse at the first step (:data:`STAGE_SYNC_TRAIN_SCHEMA_VERSION`).
# Version 11 may give a later pipeline stage a group of boards (``pipeline.groups``, ``protocol.stage_routes``): a
# version-10 agent would ignore it and take its place in the list for another stage's (:data:`STAGE_GROUPS_TRAIN_SCHEMA_VERSION`).
# The versioning rule of every message and file: docs/protocol.md.
TRAIN_SCHEMA_VERSION = 11  # what every train command is sent as
STAGE_GROUPS_TRAIN_SCHEMA_VERSION = 11  # a command of an older version cannot ask for ``pipeline.groups``
STAGE_SYNC_TRAIN_SCHEMA_VERSION = 10  # a command of an older version cannot ask for ``pipeline.state_every``
PIPELINE_TRAIN_SCHEMA_VERSION = 9  # a command of an older version cannot ask for a ``pipeline`` (refused)
OUTER_TRAIN_SCHEMA_VERSION = 8  # a command of an older version cannot ask for an ``outer_optimizer`` (refused)
PLACED_TRAIN_SCHEMA_VERSION = 7  # a command of an older version cannot ask for ``placement`` (refused)
OVERLAP_TRAIN_SCHEMA_VERSION = 5  # a command of an older version cannot ask for ``overlap`` (refused)
PERIODIC_TRAIN_SCHEMA_VERSION = 4  # a command of an older version cannot ask for ``sync_every`` > 1 (refused)
# Version 2 of the profile command may ask to measure the job as it will train: its DataModule
# (``datamodule``), precision and gradient accumulation. A version-1 agent ignores fields it does not
# know and would time fp32 steps of single batches of a dataset without a word, so such a command is
# version 2 and that agent refuses it as too new. A plain profile stays version 1, which every agent
# takes (:func:`profile_schema_version`).
PROFILE_COMMAND_SCHEMA_VERSION = 2  # the newest profile command this side understands
JOB_SETTINGS_PROFILE_SCHEMA_VERSION = 2  # an older profile command cannot ask for a datamodule, precision or accumulation
DATA_MODES = ("global", "local")
EVENT_PHASES = ("accepted", "rejected", "running", "progress", "finished", "failed")
MAX_EVENT_BYTES = 64 * 1024
MAX_PROFILE_BATCH_SIZES = 32        # each one is a full Trainer run on the board
MAX_TIMED_BUDGET_S = 3600.0         # ProfileCommand.timed_budget_s
BUDGET_MIN_TIMED_STEPS = 5          # with a timed budget, a batch size is still timed over at least this many steps
MAX_PROBE_BYTES = 256 * 1024 * 1024  # per direction of the link probe
MAX_PROBE_ROUNDS = 1000             # gradient-sized rounds of one link probe
_DATA_MAX_DEPTH = 4                 # JobEvent.data: nesting of maps and lists
# The link probe a profile job runs against the coordinator: its frames and version are ``protocol.probe_frames``.


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text.lower())


def probe_rounds_ok(rounds: int) -> bool:
    """A link probe's round count: 0 (no rounds) or 2 to :data:`MAX_PROBE_ROUNDS` (the first is not timed)."""
    return rounds == 0 or 2 <= rounds <= MAX_PROBE_ROUNDS


def _check_outer(name: str, lr: float, momentum: float, *, sync_every: int, schema_version: int) -> None:
    """A train command's outer optimizer settings. Raises ValueError: out of range, or asked for where they cannot apply."""
    problem = outer_problem(name, lr, momentum)
    if problem:
        raise ValueError(problem.replace("--outer-optimizer", "outer_optimizer").replace("--outer-lr", "outer_lr")
                         .replace("--outer-momentum", "outer_momentum"))
    if name != AVERAGE and sync_every <= 1:
        raise ValueError(f"outer_optimizer {name} needs sync_every > 1")
    if name != AVERAGE and schema_version < OUTER_TRAIN_SCHEMA_VERSION:
        raise ValueError(f"outer_optimizer {name} needs schema_version {OUTER_TRAIN_SCHEMA_VERSION}, the command says "
                         f"{schema_version}")


def _check_pipeline(command: TrainCommand) -> None:
    """A pipelined command: a version that knows pipelines, no mode it cannot be combined with, this board at its stage,
    and the data on stage 0 alone. Raises ValueError naming what is wrong."""
    if command.schema_version < PIPELINE_TRAIN_SCHEMA_VERSION:
        raise ValueError(f"pipeline needs schema_version {PIPELINE_TRAIN_SCHEMA_VERSION}, the command says "
                         f"{command.schema_version}")
    spec = PipelineSpec.from_dict(command.pipeline)
    if spec.state_every and command.schema_version < STAGE_SYNC_TRAIN_SCHEMA_VERSION:
        raise ValueError(f"pipeline.state_every needs schema_version {STAGE_SYNC_TRAIN_SCHEMA_VERSION}, the command says "
                         f"{command.schema_version}")
    if spec.later_groups and command.schema_version < STAGE_GROUPS_TRAIN_SCHEMA_VERSION:
        raise ValueError(f"pipeline.groups needs schema_version {STAGE_GROUPS_TRAIN_SCHEMA_VERSION}, the command says "
                         f"{command.schema_version}")
    others = [what for what, asked in (("placement", bool(command.placement)), ("sync_every > 1", command.sync_every > 1),
                                       ("overlap", command.overlap),
                                       ("accumulate_grad_batches > 1", command.accumulate_grad_batches > 1)) if asked]
    if others:
        raise ValueError(f"a pipeline cannot be combined with {' or '.join(others)}: send one or the other")
    sizes, boards, group = command.batch_sizes, len(spec.stages), spec.group
    if len(sizes) != boards or min(sizes[:group]) < 1 or any(size != 0 for size in sizes[group:]):
        raise ValueError(f"batch_sizes {sizes!r:.80} should be stage 0's {group} batch size(s), then a 0 for each later "
                         f"stage's board ({boards} in all): stage 0 holds the data, the later stages none")
    owner = spec.stages[command.board_index].board_id
    if command.board_id != owner:
        raise ValueError(f"board_id {command.board_id!r} is not the pipeline's board {command.board_index} ({owner!r})")
    rows = max(-(-b // min(spec.micro_batches, b)) for b in sizes[:group])  # the largest micro-batch (micro_rows)
    if rows > spec.max_rows:
        raise ValueError(f"a batch of {max(sizes[:group])} in {spec.micro_batches} micro-batches holds {rows} rows a "
                         f"micro-batch, more than pipeline.max_rows {spec.max_rows}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainCommand:
    """Start (or join) a training job. The body of a signed ``train`` command."""

    kind: str = "train"
    job_id: str                     # the run id; every event and exchange frame names it
    board_id: str                   # the addressee: a board refuses a command meant for another
    exchange_host: str              # the coordinator's exchange endpoint
    exchange_port: int
    token: str                      # this board's token for the exchange, or "" when it proves itself with its key
    model: str                      # built-in name, import path "pkg.mod:Class" or entry point
    model_options: dict[str, Any] = field(default_factory=dict)  # the model constructor's keyword arguments
    dataset: str = ""               # a dataset spec, or "" with a datamodule
    dataset_options: dict[str, Any] = field(default_factory=dict)
    datamodule: str = ""            # "pkg.mod:Class", a LightningDataModule, instead of a dataset
    datamodule_options: dict[str, Any] = field(default_factory=dict)
    board_index: int                # this board's slice of each global batch
    batch_sizes: list[int]          # every board's batch size, by board_index; their sum is the global batch
    seed: int
    total_steps: int                # the job ends after this global step
    data_mode: str = "global"       # "global": every board holds the whole dataset; "local": each its own
    lr: float | None = None         # overrides the model's default learning rate
    wire_dtype: str = "float32"     # gradients on the wire: float32, float16 or bfloat16
    threads: int = 0                # torch threads on the board; 0 = what its CPU quota (else its CPUs) fits
    batches_per_epoch: int = 0      # global batches in an epoch (the coordinator's count; 0: count here)
    max_epochs: int = 0             # the run's whole epochs when asked for in epochs (Trainer(max_epochs=...)); 0: in steps
    accumulate_grad_batches: int = 1  # Lightning's Trainer flags, the same on every replica
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    deterministic: bool = False
    precision: str = "32-true"
    exchange_tls_sha256: str = ""   # the exchange's certificate (hex SHA-256) the board must find; "": plain TCP
    sync_every: int = 1             # average the boards' parameters every this many local steps; 1 = exact (protocol.sync_schedule)
    sync_warmup: int = 0            # exact steps before the first local one
    outer_optimizer: str = AVERAGE  # what a sync step does with the average: average, diloco, sgd (protocol.outer_optimizer)
    outer_lr: float = DEFAULT_OUTER_LR              # the outer optimizer's learning rate (diloco, sgd)
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM  # ... and its momentum
    overlap: bool = False           # the gradient vector in reversed parameter order, sent as backward produces it
    placement: str = ""             # layer placement: the cut (a layer's name); "": data-parallel (workloads.layer_cut)
    tail_port: int = 0              # the tail host's activation endpoint, on exchange_host (placement only)
    # pipeline stages: a PipelineSpec as a plain map (protocol.pipeline_command); None: data-parallel
    pipeline: dict[str, Any] | None = None
    schema_version: int = TRAIN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.kind != "train":
            raise ValueError(f"kind {self.kind!r} is not 'train'")
        if not 0 <= self.board_index < len(self.batch_sizes):
            raise ValueError(f"board_index {self.board_index} is outside the {len(self.batch_sizes)} batch sizes")
        if any(b < 0 for b in self.batch_sizes) or sum(self.batch_sizes) <= 0:
            raise ValueError(f"batch_sizes {self.batch_sizes} must be >= 0 with a positive sum")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {self.wire_dtype!r} is not one of {tuple(WIRE_DTYPES)}")
        if self.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode {self.data_mode!r} is not one of {DATA_MODES}")
        if not 0 < self.exchange_port < 65536 or self.total_steps < 0:
            raise ValueError("exchange_port or total_steps out of range")
        if bool(self.dataset) == bool(self.datamodule):
            raise ValueError("give exactly one of dataset and datamodule")
        if self.batches_per_epoch < 0 or self.accumulate_grad_batches < 1 or self.max_epochs < 0:
            raise ValueError("batches_per_epoch and max_epochs must be >= 0 and accumulate_grad_batches >= 1")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm {self.gradient_clip_algorithm!r} is not 'norm' or 'value'")
        if self.exchange_tls_sha256 and not _is_sha256_hex(self.exchange_tls_sha256):
            raise ValueError("exchange_tls_sha256 is not 64 hex digits")
        if self.sync_every < 1 or self.sync_warmup < 0:
            raise ValueError(f"sync_every {self.sync_every} must be >= 1 and sync_warmup {self.sync_warmup} >= 0")
        if self.sync_every > 1 and self.schema_version < PERIODIC_TRAIN_SCHEMA_VERSION:
            raise ValueError(f"sync_every {self.sync_every} needs schema_version {PERIODIC_TRAIN_SCHEMA_VERSION}, the "
                             f"command says {self.schema_version}")
        if self.sync_every > 1 and self.accumulate_grad_batches != 1:
            raise ValueError("sync_every > 1 needs accumulate_grad_batches 1")
        _check_outer(self.outer_optimizer, self.outer_lr, self.outer_momentum, sync_every=self.sync_every,
                     schema_version=self.schema_version)
        if type(self.overlap) is not bool:
            raise ValueError(f"overlap {self.overlap!r:.20} is not true or false")
        if self.overlap and self.schema_version < OVERLAP_TRAIN_SCHEMA_VERSION:
            raise ValueError(f"overlap needs schema_version {OVERLAP_TRAIN_SCHEMA_VERSION}, the command says "
                             f"{self.schema_version}")
        if self.overlap and self.sync_every > 1:
            raise ValueError("overlap needs sync_every 1")
        if not isinstance(self.placement, str) or len(self.placement) > 200:
            raise ValueError(f"placement {self.placement!r:.40} is not a layer's name")
        if self.placement and (self.schema_version < PLACED_TRAIN_SCHEMA_VERSION or not 0 < self.tail_port < 65536):
            raise ValueError(f"placement needs schema_version {PLACED_TRAIN_SCHEMA_VERSION} and a tail_port, the command "
                             f"says {self.schema_version} and {self.tail_port}")
        if self.pipeline is not None:
            _check_pipeline(self)

    @property
    def batch_size(self) -> int:
        return self.batch_sizes[self.board_index]

    @property
    def pipeline_spec(self) -> PipelineSpec | None:
        """The pipeline this command asks for (checked when the command was made), or None: data-parallel."""
        return None if self.pipeline is None else PipelineSpec.from_dict(self.pipeline)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TrainCommand:
        """Validate a decoded command.

        Raises:
            DecodeError: naming the field that is wrong (``pipeline.<field>`` inside the pipeline).
        """
        pipeline = data.get("pipeline") if isinstance(data, dict) else None
        if pipeline is None:
            return message_from_dict(cls, data, schema_version=TRAIN_SCHEMA_VERSION)
        # The pipeline nests lists and maps, which the flat field checks refuse: the rest is checked as usual, then
        # the pipeline with it (__post_init__ through PipelineSpec.from_dict).
        command = message_from_dict(cls, {k: v for k, v in data.items() if k != "pipeline"},
                                    schema_version=TRAIN_SCHEMA_VERSION)
        try:
            return dataclasses.replace(command, pipeline=pipeline)
        except ValueError as exc:
            raise DecodeError(f"TrainCommand: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class StopCommand:
    """Stop a running job on a board (its worker ends; the agent returns to idle)."""

    kind: str = "stop"
    job_id: str
    board_id: str
    # the stopped run's exchange port: a re-planned run of the job (same id, a new exchange) is not stopped by the earlier
    # run's late stop; 0 stops whatever runs under the id (an older coordinator's stop, a profile)
    exchange_port: int = 0
    schema_version: int = JOB_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StopCommand:
        return message_from_dict(cls, data, schema_version=JOB_SCHEMA_VERSION)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileCommand:
    """Measure this board for the planner. The body of a signed ``profile`` command.

    The board trains ``model`` for ``warmup_steps + timed_steps`` real steps at each batch size
    (ascending; with ``timed_budget_s`` > 0 a batch size's timing ends sooner, once its timed steps
    have lasted that long and at least ``BUDGET_MIN_TIMED_STEPS`` of them ran), then reports one
    ``finished`` event whose ``data`` holds the step times, peak memory, power and link
    throughput. It loads the data and builds the Trainer as the job will
    (the dataset or the DataModule with its collate and batch-transfer hooks, the precision); with
    ``accumulate_grad_batches`` K a step is K batches of the batch size and one optimizer step,
    timed whole. With ``probe_bytes`` > 0 it then uploads and downloads
    that many bytes to the coordinator's probe endpoint; with ``probe_rounds`` it moves a
    gradient-sized ``probe_round_bytes`` up and back that many times, as a training step does.
    """

    kind: str = "profile"
    job_id: str                     # every event names it
    board_id: str                   # the addressee: a board refuses a command meant for another
    model: str                      # built-in name, import path "pkg.mod:Class" or entry point
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset: str                    # a dataset spec, or "" with a datamodule
    dataset_options: dict[str, Any] = field(default_factory=dict)
    batch_sizes: list[int]          # at least two distinct sizes, each a batch (a micro-batch with accumulation); ascending
    warmup_steps: int = 3           # steps run before timing starts, at each batch size
    timed_steps: int = 8            # steps whose median period is the step time
    timed_budget_s: float = 0.0     # > 0: a batch size's timing may end once its timed steps lasted this long; an
                                    # agent that predates it ignores the key and times every step (slower, as good)
    seed: int = 0                   # initial weights and the sampled batches
    threads: int = 0                # torch threads on the board; 0 = what its CPU quota (else its CPUs) fits
    probe_host: str                 # the coordinator's link-probe endpoint
    probe_port: int
    probe_token: str                # per-profile secret the board shows to the probe endpoint
    probe_bytes: int = 4_000_000    # bytes up and then down in one go; 0 = none (a later variant's job)
    probe_round_bytes: int = 0      # the gradient's size on the wire: rounds of it up and back; 0 = none
    probe_rounds: int = 0           # how many rounds of probe_round_bytes (the first is not timed)
    datamodule: str = ""            # "pkg.mod:Class", a LightningDataModule, instead of a dataset (version 2)
    datamodule_options: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"      # Lightning's precision the job trains at (version 2 unless 32-true)
    accumulate_grad_batches: int = 1  # batches per optimizer step: a timed step is this many (version 2 unless 1)
    schema_version: int = JOB_SCHEMA_VERSION  # profile_schema_version(): 1 for a plain profile, else 2

    def __post_init__(self) -> None:
        if self.kind != "profile":
            raise ValueError(f"kind {self.kind!r} is not 'profile'")
        if bool(self.dataset) == bool(self.datamodule):
            raise ValueError("give exactly one of dataset and datamodule")
        if self.datamodule_options and not self.datamodule:
            raise ValueError("datamodule_options need a datamodule")
        if type(self.accumulate_grad_batches) is not int or not 1 <= self.accumulate_grad_batches <= 10_000:
            raise ValueError(f"accumulate_grad_batches = {self.accumulate_grad_batches!r:.20} must be 1-10000")
        if not self.precision or len(self.precision) > 20:
            raise ValueError(f"precision {self.precision!r:.30} is not a Lightning precision")
        needed = profile_schema_version(datamodule=self.datamodule, precision=self.precision,
                                        accumulate_grad_batches=self.accumulate_grad_batches)
        if self.schema_version < needed:
            raise ValueError(f"datamodule, precision {self.precision!r} and accumulate_grad_batches "
                             f"{self.accumulate_grad_batches} need schema_version {needed}, the command says "
                             f"{self.schema_version}")
        if any(b < 1 for b in self.batch_sizes) or len(set(self.batch_sizes)) < 2:
            raise ValueError(f"batch_sizes {self.batch_sizes} must hold at least two distinct sizes, each >= 1 "
                             "(a line is fitted through them)")
        if len(self.batch_sizes) > MAX_PROFILE_BATCH_SIZES:
            raise ValueError(f"batch_sizes has {len(self.batch_sizes)} entries; at most {MAX_PROFILE_BATCH_SIZES}")
        if not 0 <= self.warmup_steps <= 10_000 or not 1 <= self.timed_steps <= 10_000:
            raise ValueError(f"warmup_steps = {self.warmup_steps} must be 0-10000 and timed_steps = "
                             f"{self.timed_steps} must be 1-10000")
        if not 0.0 <= self.timed_budget_s <= MAX_TIMED_BUDGET_S:
            raise ValueError(f"timed_budget_s = {self.timed_budget_s!r:.20} must be 0-{MAX_TIMED_BUDGET_S:.0f}")
        if self.threads < 0:
            raise ValueError(f"threads = {self.threads} must be >= 0")
        if not 0 < self.probe_port < 65536:
            raise ValueError(f"probe_port {self.probe_port} is outside 1-65535")
        if not 0 <= self.probe_bytes <= MAX_PROBE_BYTES:
            raise ValueError(f"probe_bytes = {self.probe_bytes} must be 0-{MAX_PROBE_BYTES}")
        if not 0 <= self.probe_round_bytes <= MAX_PROBE_BYTES:
            raise ValueError(f"probe_round_bytes = {self.probe_round_bytes} must be 0-{MAX_PROBE_BYTES}")
        if not probe_rounds_ok(self.probe_rounds) or (self.probe_round_bytes > 0) != (self.probe_rounds > 0):
            raise ValueError(f"probe_round_bytes = {self.probe_round_bytes} and probe_rounds = {self.probe_rounds}: "
                             f"give both (at least 2 rounds, the first untimed, at most {MAX_PROBE_ROUNDS}) or neither")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ProfileCommand:
        return message_from_dict(cls, data, schema_version=PROFILE_COMMAND_SCHEMA_VERSION)


def profile_schema_version(*, datamodule: str = "", precision: str = "32-true", accumulate_grad_batches: int = 1) -> int:
    """The version a profile command is sent as: 1 for a plain profile, which every agent takes; 2 when it
    measures a DataModule, a precision other than ``32-true`` or gradient accumulation, which a version-1
    agent would leave out without a word (it refuses the command as too new instead)."""
    plain = not datamodule and precision == "32-true" and accumulate_grad_batches == 1
    return JOB_SCHEMA_VERSION if plain else JOB_SETTINGS_PROFILE_SCHEMA_VERSION


Command = TrainCommand | ProfileCommand | StopCommand
COMMAND_KINDS: dict[str, type[TrainCommand] | type[ProfileCommand] | type[StopCommand]] = {
    "train": TrainCommand, "profile": ProfileCommand, "stop": StopCommand}


def command_from_dict(data: Any) -> TrainCommand | ProfileCommand | StopCommand:
    """The command a verified body describes.

    Raises:
        DecodeError: unknown kind or invalid fields.
    """
    kind = data.get("kind") if isinstance(data, dict) else None
    message_class = COMMAND_KINDS.get(kind) if isinstance(kind, str) else None
    if message_class is None:
        raise DecodeError(f"unknown command kind {kind!r}; this agent understands "
                          f"{', '.join(repr(k) for k in COMMAND_KINDS)} (upgrade the agent?)")
    return message_class.from_dict(data)


def _plain_data(value: Any, depth: int = 0) -> bool:
    """True for JSON-like data: str-keyed maps, lists, str, bool, None and finite numbers."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= _DATA_MAX_DEPTH:
        return False
    if isinstance(value, list):
        return all(_plain_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_data(v, depth + 1) for k, v in value.items())
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """What a board says about a job: accepted, rejected, running, progress, finished or failed."""

    job_id: str
    board_id: str
    phase: str
    message: str = ""               # human words, e.g. why it failed and what to do
    step: int | None = None         # the last global step the board took part in
    loss: float | None = None
    compute_s: float | None = None  # the board's own time for its last step (forward + backward)
    ts: float | None = None
    data: dict[str, Any] | None = None  # a job's result, e.g. a profile's measurements (JSON-like, nested)
    schema_version: int = JOB_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.phase not in EVENT_PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {EVENT_PHASES}")

    def to_msgpack(self, sign: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> bytes:
        """The event as published; ``sign`` (``protocol.signing.EventSigner``) adds the board's signature."""
        fields = dataclasses.asdict(self)
        packed: bytes = msgpack.packb(fields if sign is None else sign(fields), use_bin_type=True)
        return packed

    @classmethod
    def from_msgpack(cls, payload: bytes, *, check: Callable[[dict[str, Any]], None] | None = None) -> JobEvent:
        """Decode and validate an event.

        Args:
            check: called with the decoded map before it is used, e.g. to check the board's signature
                (``protocol.signing.check_event_signature``); it raises to refuse the event.

        Raises:
            DecodeError: not an event; or what ``check`` raises.
        """
        if len(payload) > MAX_EVENT_BYTES:
            raise DecodeError(f"JobEvent: {len(payload)} bytes is over the {MAX_EVENT_BYTES}-byte limit")
        try:
            data = msgpack.unpackb(payload, max_str_len=MAX_EVENT_BYTES, max_bin_len=0, max_array_len=1000, max_map_len=100)
        except (ValueError, msgpack.UnpackException) as exc:
            raise DecodeError(f"JobEvent: not valid msgpack ({exc})") from None
        if check is not None and isinstance(data, dict):
            check(data)
        # ``data`` is nested, which the flat field checks refuse: it is checked on its own.
        result = data.pop("data", None) if isinstance(data, dict) else None
        event = message_from_dict(cls, data, schema_version=JOB_SCHEMA_VERSION)
        if result is None:
            return event
        if not isinstance(result, dict) or not _plain_data(result):
            raise DecodeError(f"JobEvent: field 'data' should be a map of plain values nested at most "
                              f"{_DATA_MAX_DEPTH} deep with finite numbers, got {result!r:.60}")
        return dataclasses.replace(event, data=result)


__all__ = [
    "COMMAND_KINDS",
    "DATA_MODES",
    "JOB_SCHEMA_VERSION",
    "JOB_SETTINGS_PROFILE_SCHEMA_VERSION",
    "MAX_EVENT_BYTES",
    "MAX_PROBE_BYTES",
    "MAX_PROBE_ROUNDS",
    "OVERLAP_TRAIN_SCHEMA_VERSION",
    "PERIODIC_TRAIN_SCHEMA_VERSION",
    "PIPELINE_TRAIN_SCHEMA_VERSION",
    "PROFILE_COMMAND_SCHEMA_VERSION",
    "STAGE_SYNC_TRAIN_SCHEMA_VERSION",
    "TRAIN_SCHEMA_VERSION",
    "Command",
    "JobEvent",
    "ProfileCommand",
    "StopCommand",
    "TrainCommand",
    "command_from_dict",
    "profile_schema_version",
]
