"""Train a :class:`JobSpec` on the fleet: the service behind ``edge-coordinator train``.

:func:`resolve_job` fixes what a spec leaves open (the boards, each one's batch size, the run's
length and name), :func:`train` runs it through :class:`~edgefleet.coordinator.run.training.TrainingRun`
and returns its :class:`~edgefleet.coordinator.run.training.TrainOutcome`, and :func:`load_job` reads
back the spec of a run directory to resume it. What the run reports as it goes (each step, notes)
reaches a :class:`TrainObserver`; the command line's progress bar is one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.coordinator.control.fleet_select import fleet_snapshot
from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.pipeline.replan import Replanned
from edgefleet.coordinator.pipeline.stage_plan import parse_stage_plan
from edgefleet.coordinator.report.power_log import POWER_FILE, PowerLog
from edgefleet.coordinator.run.job_spec import DEFAULT_EPOCHS, JobSpec, batches_per_epoch
from edgefleet.protocol.errors import BrokerError, ConfigError
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.split_schedule import SPLIT_LEAD_STEPS

if TYPE_CHECKING:
    from edgefleet.coordinator.control.fleet import FleetView
    from edgefleet.coordinator.run.training import StepView, TrainOutcome
    from edgefleet.protocol.messages import TelemetrySample
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

RUNS_ROOT = Path("runs")


class TrainObserver:
    """What a training run reports as it goes; the methods here do nothing but log the notes."""

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        """The run is about to step: ``first_step`` is 0, or where a resumed run continues."""

    def step(self, view: StepView) -> None:
        """A step was applied."""

    def note(self, text: str) -> None:
        """A line for the user: the exchange's address, a board left out, a re-balance."""
        log.info("%s", text)

    def joined(self, board: str, joined: int, boards: int) -> None:
        """``board`` joined the exchange, the ``joined``-th of the job's ``boards``."""
        self.note(f"board {board} joined ({joined}/{boards})")

    def stopped(self) -> None:
        """The run ended, completed or not (called whatever happened once ``started`` was)."""


def new_run_id(spec: JobSpec) -> str:
    """``lenet5-digits-20261121-101500-ab12``: the model, the data, the time and 4 random hex digits."""
    model = spec.model.split(":")[-1].lower()
    data = spec.data_name.split(":")[-1].lower()
    return f"{model}-{data}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def default_run_dir(spec: JobSpec) -> Path:
    """Where a run is written unless told: ``runs/<run-id>``."""
    return RUNS_ROOT / spec.run_id


def per_board_batches(batch_sizes: tuple[int, ...], boards: tuple[str, ...]) -> tuple[int, ...]:
    """One batch size per board: a single value is every board's. Raises ConfigError on a count mismatch."""
    if len(batch_sizes) == 1:
        return batch_sizes * len(boards)
    if len(batch_sizes) != len(boards):
        raise ConfigError(f"--batch has {len(batch_sizes)} values for {len(boards)} boards ({', '.join(boards)}); "
                          "give one per board or one for all")
    return batch_sizes


def check_force_split(force_split: BatchSplit, batch_sizes: tuple[int, ...]) -> None:
    """The test hook's re-split must keep the global batch and give every board a sample, after the lead steps."""
    from_step, sizes = force_split.from_step, list(force_split.batch_sizes)
    text = f"{from_step}:{','.join(map(str, sizes))}"
    if len(sizes) != len(batch_sizes) or min(sizes, default=0) < 1 or sum(sizes) != sum(batch_sizes):
        raise ConfigError(f"--force-split {text!r}: give each of the {len(batch_sizes)} boards at least one sample, "
                          f"{sum(batch_sizes)} in all (the global batch)")
    if from_step <= SPLIT_LEAD_STEPS:
        raise ConfigError(f"--force-split {text!r}: a re-split can start at step {SPLIT_LEAD_STEPS + 1} at the earliest")


def training_set_size(spec: JobSpec) -> int:
    """Samples in the job's training set (loads the dataset or the DataModule; raises ConfigError for a bad one)."""
    from edgefleet.workloads.training_data import load_training_data  # torch: only to size a dataset

    data = load_training_data(dataset=spec.dataset, dataset_options=spec.dataset_options, datamodule=spec.datamodule,
                              datamodule_options=spec.datamodule_options, with_val=False)
    return len(data.train)


def resolve_job(spec: JobSpec, *, broker: BrokerSettings | None = None, dataset_len: int | None = None) -> JobSpec:
    """The spec with its boards, per-board batch sizes, length and run id fixed; a resolved spec is returned as is.

    Args:
        spec: The job.
        broker: Where to find the online boards when the spec names none (and to check those it names).
        dataset_len: The training set's size if known (else the data is loaded to count it).

    Raises:
        ConfigError: no board to train on, a named board that never reported or is offline, a batch size per
            board that does not match the boards, a bad forced split, or data that cannot be loaded.
    """
    if spec.resolved:
        return spec
    from edgefleet.workloads.fleet_trainer import steps_per_epoch  # torch: only for a job to resolve

    size = dataset_len if dataset_len is not None else training_set_size(spec)  # the data's own errors first
    if spec.pipeline:
        spec = _pipeline_boards(spec)
    boards = spec.boards
    if broker is not None:  # one look at the fleet: the online boards, or a check of those named, before any model
        snapshot = fleet_snapshot(broker, preferred=boards)
        if boards:
            snapshot.check_named(boards)
        else:
            boards = tuple(snapshot.trainers())
    if not boards:
        raise ConfigError("no boards: none is online on this broker; start edge-agent on the boards or name them with --boards")
    batch_sizes = per_board_batches(spec.batch_sizes, boards) if not spec.pipeline else spec.batch_sizes
    if spec.force_split is not None:
        check_force_split(spec.force_split, batch_sizes)
    batches = batches_per_epoch(spec, size, batch_sizes)
    per_epoch = steps_per_epoch(batches, spec.accumulate_grad_batches)
    total = spec.steps if spec.steps is not None else max(1, round((spec.epochs or DEFAULT_EPOCHS) * per_epoch))
    warmup = spec.sync_warmup
    if warmup is None and spec.sync_every > 1:  # post-local SGD: one exact epoch first (exact runs have no warm-up)
        warmup = per_epoch
    return replace(spec, boards=boards, batch_sizes=batch_sizes, total_steps=total, steps_per_epoch=per_epoch,
                   batches_per_epoch=batches, sync_warmup=warmup, run_id=spec.run_id or new_run_id(spec))


def _pipeline_boards(spec: JobSpec) -> JobSpec:
    """A pipeline's boards are its stages' (stage 0's group, then one per later stage), its batch sizes stage 0's
    boards' (``--batch``: one for each of them, or one for all) then 0 for each later stage: stage 0 holds the data.
    With --rebalance (the default) the pipeline is revised around a board that slows for good (``run.stage_reviser``).

    Raises:
        ConfigError: ``--boards`` names other boards than ``--pipeline``, or ``--batch`` does not fit stage 0's boards.
    """
    plan = parse_stage_plan(spec.pipeline)
    if spec.boards and tuple(spec.boards) != plan.boards:
        raise ConfigError(f"--boards {','.join(spec.boards)} and --pipeline {spec.pipeline} name other boards: the "
                          "pipeline's are its stages'; leave --boards out")
    later = (0,) * (len(plan.boards) - plan.group)
    given = tuple(spec.batch_sizes)
    if given[plan.group:] == later and len(given) == len(plan.boards):  # resolved already (a resumed run's)
        group = given[:plan.group]
    else:
        group = per_board_batches(given, plan.boards[:plan.group])
    return replace(spec, boards=plan.boards, batch_sizes=group + later)


def repipeline(spec: JobSpec, pipeline: str, micro_batches: int | None) -> JobSpec:
    """A pipelined run to resume on other boards or cuts (``--resume RUN --pipeline ...``): the checkpoint holds the
    whole model and optimizer (the replica's), so any stages can take it up; stage 0 keeps its boards' slices, so
    the global batches, the epochs and every step's samples stay the run's.

    Raises:
        ConfigError: the run is not pipelined, or the new stage 0 has another number of boards.
    """
    if not spec.pipeline:
        raise ConfigError(f"--resume with --pipeline {pipeline}: this run trains data-parallel (its config.json has no "
                          "pipeline); resume it without --pipeline")
    old, new = parse_stage_plan(spec.pipeline), parse_stage_plan(pipeline)
    if new.group != old.group:
        raise ConfigError(f"--resume with --pipeline {pipeline}: stage 0 had {old.group} board(s) ({spec.pipeline}); "
                          f"keep {old.group} so that each keeps its slice of the batch")
    sizes = tuple(spec.batch_sizes[:old.group]) + (0,) * (len(new.boards) - new.group)
    return replace(spec, pipeline=new.text(), boards=new.boards, batch_sizes=sizes,
                   micro_batches=micro_batches if micro_batches is not None else spec.micro_batches)


def _replanned(spec: JobSpec, plan: Replanned) -> JobSpec:
    """The run's spec with the pipeline it goes on with (data-parallel when no later stage is left)."""
    micro_batches = plan.micro_batches if plan.micro_batches is not None else spec.micro_batches
    stage_sync = plan.stage_sync if plan.stage_sync is not None else spec.stage_sync
    return replace(spec, pipeline=plan.pipeline, boards=plan.boards, batch_sizes=plan.batch_sizes,
                   micro_batches=micro_batches if plan.pipeline else 1,
                   stage_sync=stage_sync if plan.pipeline else "step")


def load_job(run_dir: Path) -> JobSpec:
    """The resolved spec a run directory was started with (its ``config.json``), to resume it."""
    config = run_dir / "config.json"
    if not config.exists():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json); give the folder train printed")
    return JobSpec.from_json(json.loads(config.read_text()))


ROLLBACK_BUSY_WAIT_S = 60.0  # after a rollback, boards still ending the attempt thrown away are waited for this long


def train(spec: JobSpec, *, broker: BrokerSettings, fleet_key: bytes, run_dir: Path | None = None, resume: bool = False,
          observer: TrainObserver | None = None, power_view: FleetView | None = None) -> TrainOutcome:
    """Train ``spec`` on its boards (resolving it first if needed) and return how the run ended.

    Args:
        spec: The job; resolved with :func:`resolve_job` unless it is already.
        broker: The fleet's broker.
        fleet_key: The key that signs the boards' commands.
        run_dir: Where the run is written (default ``runs/<run-id>``); with ``resume``, the
            interrupted run's directory. A new run refuses a directory that holds a run already.
        resume: Continue the run in ``run_dir`` from its checkpoint.
        observer: Receives every step and note (default: notes to this module's log).
        power_view: A fleet view already following the broker, to record the boards' power from
            (``power.jsonl``); None opens one for the run.

    Returns:
        The run's directory, its result (``result.json``) and whether it was interrupted
        (Ctrl-C or SIGTERM stop it at a step boundary with a checkpoint to resume from).

    Raises:
        EdgeTrainError: a bad spec, a run directory that holds a run already (without ``resume``),
            a board that is not ready, or a failure of the exchange.
        RunDirError: the run directory could not be written (DiskFullError: its disk is full); the
            message says how to go on (``--resume`` from the last checkpoint, which is intact).
        KeyboardInterrupt: Ctrl-C before the first step began.
    """
    # torch: only when a run starts, not with the CLI
    from edgefleet.coordinator.audit.rollback import roll_back
    from edgefleet.coordinator.run.checkpoints import atomic_write_json, check_new_run_dir
    from edgefleet.coordinator.run.training import TrainingRun

    if resume and run_dir is None:
        raise ConfigError("resuming needs the run directory")
    if not resume and run_dir is not None:
        check_new_run_dir(run_dir)  # before the data is loaded or any board is asked
    spec = resolve_job(spec, broker=broker)
    run_dir = run_dir or default_run_dir(spec)
    observer = observer or TrainObserver()
    note = _RunNotes(observer.note)  # a rollback's new attempt would say the same warnings again: once is enough
    run = TrainingRun(spec, run_dir=run_dir, broker=broker, fleet_key=fleet_key, on_step=observer.step,
                      on_note=note, resume=resume, on_join=observer.joined)
    observer.started(spec, run_dir, run.replica.step)
    try:
        with ExitStack() as stack:
            # the samples go to the current attempt's logger too (a rollback replaces ``run``)
            _log_power(stack, spec, run_dir, broker, power_view, observer,
                       lambda board, s: run.log_board_sample(board, s.power_w, s.cpu_percent, s.temp_c))
            while True:
                outcome = asyncio.run(run.run())
                if outcome.replan is not None:  # a pipeline lost a board for good, or one came back: on from its step
                    spec = _replanned(spec, outcome.replan)
                    atomic_write_json(run_dir / "config.json", spec.to_json())
                    run = TrainingRun(spec, run_dir=run_dir, broker=broker, fleet_key=fleet_key, on_step=observer.step,
                                      on_note=note, resume=True, busy_wait_s=ROLLBACK_BUSY_WAIT_S,
                                      on_join=observer.joined, recovering_since=outcome.lost_at,
                                      comeback=outcome.comeback, revised=outcome.revised)
                    continue
                if not outcome.rolled_back:
                    return outcome
                # a board failed its audit: back to the run's start, on without it (coordinator.audit.rollback)
                spec = roll_back(run_dir, spec, outcome.rolled_back)
                note.after_rollback = True
                observer.note(f"rolled the run back to step 0: it goes on with {', '.join(spec.boards)} (batch sizes "
                              f"{','.join(map(str, spec.batch_sizes))}), the global batch unchanged")
                run = TrainingRun(spec, run_dir=run_dir, broker=broker, fleet_key=fleet_key, on_step=observer.step,
                                  on_note=note, resume=True, busy_wait_s=ROLLBACK_BUSY_WAIT_S, on_join=observer.joined)
    finally:
        observer.stopped()


class _RunNotes:
    """A run's notes to the user; after a rollback, the new attempt's notes that the run gave already (its security
    warnings, the audits) are not given again."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note
        self.said: set[str] = set()
        self.after_rollback = False

    def __call__(self, text: str) -> None:
        if self.after_rollback and text in self.said:
            return
        self.said.add(text)
        self.note(text)


def _log_power(stack: ExitStack, spec: JobSpec, run_dir: Path, broker: BrokerSettings, view: FleetView | None,
               observer: TrainObserver, on_sample: Callable[[str, TelemetrySample], None]) -> None:
    """Record the boards' power, CPU and temperature in the run directory while it trains (``report``'s plots), and
    hand each sample to ``on_sample`` (the run's logger)."""
    try:
        if view is None:
            view = stack.enter_context(monitor_fleet(broker, preferred=spec.boards))
        stack.enter_context(PowerLog(view, spec.boards, run_dir / POWER_FILE, on_sample=on_sample))
    except (BrokerError, OSError) as exc:
        observer.note(f"the boards' power is not recorded for this run ({exc}); the report will have no power plot")


__all__ = ["RUNS_ROOT", "TrainObserver", "default_run_dir", "load_job", "new_run_id", "per_board_batches", "resolve_job",
           "train", "training_set_size"]
