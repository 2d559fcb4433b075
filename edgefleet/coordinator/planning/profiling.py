"""The coordinator's side of ``edge-coordinator profile``: send profile jobs, probe the links, build
the :class:`~coordinator.planning.profiles.FleetProfile` of every model variant.

Every board runs one profile job per variant, variants one after the other; boards run in
parallel. The first job of each board also probes its link in bulk against
:class:`~coordinator.planning.link_probe.LinkProbeServer`, which serves one board at a time (so that one
board's figures are not shared with another's), then lets every board that has finished upload at
once: that aggregate is the coordinator's own link, ``coordinator_link_bytes_per_s``. Every job
also times the variant's gradient up and back (``--probe-rounds``), the size a training step
moves, which the planner scales the bulk rates to. The model is also built here, to count the gradient's
bytes and to name what was measured (:func:`~coordinator.planning.profiles.model_key`); a board
that builds it with another parameter count is refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.coordinator.control.board_channel import BoardChannel
from edgefleet.coordinator.control.fleet_select import check_boards_ready
from edgefleet.coordinator.planning.link_probe import LinkProbeServer
from edgefleet.coordinator.planning.profiles import (
    BatchPoint,
    BoardProfile,
    FleetProfile,
    model_key,
    variant_label,
)
from edgefleet.coordinator.planning.unit_profile import UnitProfile
from edgefleet.protocol.errors import ConfigError, DecodeError, EdgeTrainError
from edgefleet.protocol.jobs import (
    MAX_PROBE_BYTES,
    MAX_PROBE_ROUNDS,
    MAX_TIMED_BUDGET_S,
    JobEvent,
    ProfileCommand,
    StopCommand,
    probe_rounds_ok,
    profile_schema_version,
)
from edgefleet.protocol.profile_report import LinkReport, ProfileReport, ProfileReportVersionError
from edgefleet.protocol.wire_dtype import WIRE_DTYPES
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

JOB_TIMEOUT_S = 1800.0      # one variant on one board: the worker's import (~20 s on a Pi) plus every batch size


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What to profile: one model, its variants, the data, the job's Trainer settings and how to measure."""

    model: str
    variants: list[dict[str, Any]]       # model options per variant (coordinator.planning.variants.variants_from_args)
    dataset: str                         # a dataset spec, or "" with a datamodule
    dataset_options: dict[str, Any]
    datamodule: str = ""                 # "pkg.mod:Class", a LightningDataModule, instead of a dataset
    datamodule_options: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"           # the job's precision: the boards time its steps at it
    accumulate_grad_batches: int = 1     # the job's accumulation: a timed step is this many batches
    batch_sizes: list[int] = field(default_factory=lambda: [16, 32, 64])
    warmup_steps: int = 3
    timed_steps: int = 8
    timed_budget_s: float = 0.0          # > 0: a batch size's timing may end once its timed steps lasted this long
                                         # (at least protocol.jobs.BUDGET_MIN_TIMED_STEPS of them)
    wire_dtype: str = "float32"
    threads: int = 0
    seed: int = 0
    probe_bytes: int = 4_000_000         # per direction; 0 skips the link probe (links then unmeasured: refused)
    probe_rounds: int = 17               # gradient-sized rounds per variant (the first untimed; fewer on a slow
                                         # link, see agent.link_probe.ROUND_BUDGET_S); 0 = the bulk rates only
    exchange_host: str = ""              # the address boards reach this machine at (default: towards the broker)
    parallel: int = 0                    # boards profiled at once; 0 = all. Emulated fleets sharing one host's
                                         # cores time slower together than apart; real boards do not

    def __post_init__(self) -> None:
        if len(set(self.batch_sizes)) < 2 or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"--batch {','.join(map(str, self.batch_sizes))}: give at least two distinct batch sizes, "
                              "each at least 1, e.g. --batch 16,32,64 (a line is fitted through them)")
        if not self.variants:
            raise ConfigError("no model variant to profile")
        if bool(self.dataset) == bool(self.datamodule):
            raise ConfigError("name the data once: a dataset (--dataset) or a LightningDataModule (--datamodule)")
        if self.accumulate_grad_batches < 1:
            raise ConfigError(f"--accumulate-grad-batches {self.accumulate_grad_batches} must be at least 1")
        if not 0 <= self.warmup_steps <= 10_000 or not 1 <= self.timed_steps <= 10_000:
            raise ConfigError(f"--warmup {self.warmup_steps} / --steps {self.timed_steps}: use 0-10000 warm-up "
                              "and 1-10000 timed steps")
        if not 0.0 <= self.timed_budget_s <= MAX_TIMED_BUDGET_S:
            raise ConfigError(f"--timed-budget {self.timed_budget_s:g}: give 0 (time every --steps step) to "
                              f"{MAX_TIMED_BUDGET_S:.0f} seconds")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"--wire-dtype {self.wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        if self.threads < 0:
            raise ConfigError(f"--threads {self.threads} must be 0 (what each board's CPU fits) or more")
        if self.parallel < 0:
            raise ConfigError(f"--parallel {self.parallel} must be 0 (every board at once) or more")
        if not 1 <= self.probe_bytes <= MAX_PROBE_BYTES:
            raise ConfigError(f"--probe-bytes {self.probe_bytes} must be 1-{MAX_PROBE_BYTES}")
        if not probe_rounds_ok(self.probe_rounds):
            raise ConfigError(f"--probe-rounds {self.probe_rounds} must be 0 (bulk rates only) or 2-{MAX_PROBE_ROUNDS} "
                              "(the first round is not timed)")


@dataclass(frozen=True, slots=True)
class _Variant:
    label: str
    options: dict[str, Any]
    model_key: str
    param_count: int


def _prepare(request: ProfileRequest) -> tuple[list[_Variant], int]:
    """Build the dataset and every variant here: (variants, dataset length). Raises ConfigError."""
    # torch, Lightning: only where the coordinator builds the variants itself
    import torch

    from edgefleet.workloads.module_setup import RunFigures, prepare_module
    from edgefleet.workloads.params import param_count, trainable_params
    from edgefleet.workloads.preflight import check_trainable
    from edgefleet.workloads.registry import build_model
    from edgefleet.workloads.training_data import load_training_data

    data = load_training_data(dataset=request.dataset, dataset_options=request.dataset_options,
                              datamodule=request.datamodule, datamodule_options=request.datamodule_options,
                              with_val=False)
    shape = sample_shape(data.train, data.source)
    variants = []
    for options in request.variants:
        torch.manual_seed(request.seed)
        model = build_model(request.model, options, data=data.train)
        figures = prepare_module(model, RunFigures(batches_per_epoch=1, total_steps=1),  # layers of setup/configure_model
                                 data.datamodule)
        count = param_count(trainable_params(check_trainable(model, figures).optimizer))
        variants.append(_Variant(variant_label(options), dict(options), model_key(request.model, options, shape), count))
    return variants, len(data.train)


def sample_shape(dataset: Any, what: str) -> tuple[int, ...]:
    """One sample's input shape, for the profile's model key: the dataset's ``input_shape``, else the first
    sample's input; ``()`` when its samples are not ``(input, target)`` pairs (a DataModule's dicts, say)."""
    from edgefleet.workloads.registry import dataset_attribute  # torch: only where the coordinator builds the variants

    try:
        shape: tuple[int, ...] = dataset_attribute(dataset, "input_shape", what)
    except ConfigError:
        return ()
    return shape


class ProfileFailed(EdgeTrainError):
    """A board could not profile; the message names the board and says why."""


class _Jobs:
    """Sends each board its profile jobs and waits for their results."""

    def __init__(self, channel: BoardChannel, boards: list[str], on_note: Callable[[str], None]) -> None:
        self.channel, self.on_note = channel, on_note
        self.queues: dict[str, asyncio.Queue[JobEvent]] = {b: asyncio.Queue() for b in boards}
        self.running: dict[str, str] = {}  # board -> job id in flight

    async def pump(self) -> None:
        """Route the channel's events to the boards' queues (runs until cancelled)."""
        while True:
            event = await self.channel.next_event(0.5)
            if event is not None and event.board_id in self.queues:
                self.queues[event.board_id].put_nowait(event)

    async def run(self, board: str, command: ProfileCommand, label: str) -> ProfileReport:
        """Send ``command`` and return the report its ``finished`` event carries.

        Raises:
            ProfileFailed: the board refused or failed the job, went offline, or timed out.
        """
        self.running[board] = command.job_id
        self.channel.send(board, command.to_dict())
        deadline = time.monotonic() + JOB_TIMEOUT_S
        queue = self.queues[board]
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), 1.0)
            except asyncio.TimeoutError:
                status = self.channel.status.get(board)
                if status is not None and status.state == "offline":
                    raise ProfileFailed(f"board {board} went offline while profiling variant {label} "
                                        f"({status.reason or 'unknown reason'})") from None
                if time.monotonic() > deadline:
                    raise ProfileFailed(f"board {board} did not finish profiling variant {label} within {JOB_TIMEOUT_S:.0f} s; "
                                        "profile fewer or smaller batch sizes, or fewer --steps") from None
                continue
            if event.job_id != command.job_id:
                continue
            if event.phase in ("failed", "rejected"):
                del self.running[board]
                raise ProfileFailed(f"board {board} failed to profile variant {label}: {event.message or event.phase}")
            if event.phase == "finished":
                del self.running[board]
                if not isinstance(event.data, dict):
                    raise ProfileFailed(f"board {board} finished variant {label} without a result; is its agent older than "
                                        "the coordinator? Upgrade it")
                return read_report(board, label, event.data)
            if event.message:
                self.on_note(f"{board} [{label}]: {event.message}")


def read_report(board: str, label: str, data: dict[str, Any]) -> ProfileReport:
    """The report of ``board``'s job for variant ``label``.

    Raises:
        ProfileFailed: a report of another version (naming the side to upgrade), or an unreadable one.
    """
    try:
        return ProfileReport.from_wire(data)
    except ProfileReportVersionError as exc:
        log.warning("profile: board %s, %s: %s", board, label, exc)
        raise ProfileFailed(f"board {board}, {label}: {exc}") from None
    except DecodeError as exc:
        log.warning("profile: board %s sent an unreadable report of %s: %s", board, label, exc)
        raise ProfileFailed(f"board {board} sent an unreadable profile of {label} ({exc}); "
                            "run the same edgefleet version on the board and the coordinator") from None


def _board_profile(board: str, variant: _Variant, report: ProfileReport, link: LinkReport) -> BoardProfile:
    """A board's report as a BoardProfile; ProfileFailed if it is unusable.

    ``link`` is the bulk probe of the board's first job; ``report.link_rounds``, if present, the
    variant's own gradient-sized rounds, whose draw is then the board's link power.
    """
    if report.param_count != variant.param_count:
        raise ProfileFailed(f"board {board} built {variant.label} with {report.param_count} trainable parameters, "
                            f"the coordinator with {variant.param_count}: install the same model code on both")
    rounds = report.link_rounds
    link_power_w = link.power_w if rounds is None or rounds.power_w is None else rounds.power_w
    try:
        points = tuple(BatchPoint(p.batch_size, p.step_time_s, p.peak_memory_bytes, p.step_time_spread_s)
                       for p in report.points)
        return BoardProfile(board_id=board, agent_version=report.agent_version, model_key=variant.model_key,
                            points=points, active_power_w=report.active_power_w, idle_power_w=report.idle_power_w,
                            power_source=report.power_source, memory_total_bytes=report.memory_total_bytes,
                            link_bytes_per_s=link.up_bytes_per_s, link_down_bytes_per_s=link.down_bytes_per_s,
                            link_power_w=link_power_w,
                            link_round_bytes=None if rounds is None else rounds.round_bytes,
                            link_round_s=None if rounds is None else rounds.round_s,
                            units=tuple(UnitProfile.from_report(u) for u in report.units))
    except EdgeTrainError as exc:  # PlanError: a figure the planner cannot use
        raise ProfileFailed(f"board {board}, {variant.label}: {exc}") from None


async def profile_fleet(broker: BrokerSettings, fleet_key: bytes, boards: list[str], request: ProfileRequest, *,
                        on_note: Callable[[str], None]) -> dict[str, FleetProfile]:
    """Profile every variant of ``request`` on ``boards``; the result is keyed by ``variant_label``.

    Raises:
        ConfigError: the model, a variant or the dataset cannot be built here.
        BrokerError: the broker cannot be reached.
        EdgeTrainError: a board is offline, busy or cannot train (before anything starts), or a
            board failed while profiling (naming it and its message).
    """
    from edgefleet.coordinator.run.training import exchange_host_for  # torch: off the planner

    if not boards or len(set(boards)) != len(boards):
        raise ConfigError(f"--boards {','.join(boards)}: name each board once (and at least one)")
    variants, dataset_len = _prepare(request)
    grad_bytes = {v.label: v.param_count * WIRE_DTYPES[request.wire_dtype].itemsize for v in variants}
    run_id = f"profile-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    token = secrets.token_hex(16)  # shown only to the boards, inside signed commands
    channel = BoardChannel(broker, fleet_key, boards)
    waves = request.parallel if 0 < request.parallel < len(boards) else 0
    probe = LinkProbeServer(job_id=f"{run_id}-0", token=token, boards=boards, aggregate=not waves)
    slots = asyncio.Semaphore(waves or len(boards))
    await channel.open()
    jobs = _Jobs(channel, boards, on_note)
    pump = asyncio.ensure_future(jobs.pump())
    try:
        await check_boards_ready(channel, boards)
        host = request.exchange_host or exchange_host_for(broker)
        port = await probe.start(host)
        advertised = "127.0.0.1" if host == "0.0.0.0" else host
        on_note(f"{run_id}: {len(variants)} variant(s) on {len(boards)} board(s), batch sizes "
                f"{','.join(map(str, sorted(set(request.batch_sizes))))}; link probe at {advertised}:{port}")

        async def one_board(board: str) -> list[ProfileReport]:
            results = []
            for i, variant in enumerate(variants):
                command = ProfileCommand(
                    job_id=f"{run_id}-{i}", board_id=board, model=request.model, model_options=variant.options,
                    dataset=request.dataset, dataset_options=request.dataset_options, batch_sizes=request.batch_sizes,
                    warmup_steps=request.warmup_steps, timed_steps=request.timed_steps,
                    timed_budget_s=request.timed_budget_s, seed=request.seed,
                    threads=request.threads, probe_host=advertised, probe_port=port, probe_token=token,
                    probe_bytes=request.probe_bytes if i == 0 else 0,
                    probe_round_bytes=grad_bytes[variant.label] if request.probe_rounds else 0,
                    probe_rounds=request.probe_rounds, datamodule=request.datamodule,
                    datamodule_options=request.datamodule_options, precision=request.precision,
                    accumulate_grad_batches=request.accumulate_grad_batches,
                    schema_version=profile_schema_version(datamodule=request.datamodule, precision=request.precision,
                                                          accumulate_grad_batches=request.accumulate_grad_batches))
                try:
                    async with slots:
                        results.append(await jobs.run(board, command, variant.label))
                except ProfileFailed:
                    probe.drop(board)
                    raise
                on_note(f"{board} [{variant.label}]: done")
            return results

        tasks = [asyncio.ensure_future(one_board(board)) for board in boards]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [exc for t in tasks if t.done() and (exc := t.exception()) is not None]
            if failed:
                raise failed[0]
            per_board = {board: task.result() for board, task in zip(boards, tasks)}
        finally:
            for task in tasks:
                task.cancel()
    finally:
        pump.cancel()
        for board, job_id in jobs.running.items():
            channel.send(board, StopCommand(job_id=job_id, board_id=board).to_dict(), wait_s=1.0)
        await probe.close()
        channel.close()
    links: dict[str, LinkReport] = {}
    for board, results in per_board.items():
        link = results[0].link
        if link is None:
            raise ProfileFailed(f"board {board} did not report its link throughput; upgrade its agent")
        links[board] = link
    # Not measured (boards profiled apart): the boards' uplinks added up, i.e. no bottleneck of its own.
    coordinator_link = probe.aggregate_bytes_per_s or sum(link.up_bytes_per_s for link in links.values())
    return {v.label: FleetProfile(model_key=v.model_key, grad_bytes=grad_bytes[v.label],
                                  coordinator_link_bytes_per_s=coordinator_link, dataset_len=dataset_len,
                                  boards={b: _board_profile(b, v, per_board[b][i], links[b]) for b in boards},
                                  variant=dict(v.options), accumulate=request.accumulate_grad_batches)
            for i, v in enumerate(variants)}


__all__ = ["ProfileFailed", "ProfileRequest", "profile_fleet", "sample_shape"]
