"""The board's side of ``edge-coordinator profile``: measure one model variant for the planner.

For each batch size, in ascending order, a fresh copy of the model trains ``warmup_steps +
timed_steps`` real steps with the same Trainer settings as a training job: the job's data as the
job loads it (a dataset, or a DataModule with its collate and its batch-transfer hooks), its
precision (16-mixed with the loss-scaling plugin a board trains with) and its gradient
accumulation. A callback notes the time of every ``on_train_batch_start`` that opens an
accumulation window (every batch without accumulation); the period between two of them is the
whole step (data, forward and backward of K batches, optimizer step, Lightning's overhead) and the
median over the timed steps is the step time (with ``timed_budget_s``, fewer of them where the
steps are long). Once per batch size it reads the process's peak resident memory (reset at the
start of the job, so a kept worker's earlier jobs do not count; ascending order makes each
reading that batch size's peak) and the power drawn during the timed steps: the board's sensor
sampled in a thread, or, with no sensor, ``idle_w + (max_w - idle_w) x`` the share of the CPU
this board may use (its cgroup quota, else its cores) that the agent's cgroup filled. Then it
probes the board's link to the coordinator: in bulk with ``probe_bytes`` set (a board's first
job), and with ``probe_rounds`` set in rounds of the variant's gradient, as a training step moves it.

Between the steps and the probe it times the model's pipeline units for the pipeline planner
(``workloads.layer_timing``: each run of layers between two admissible cuts, forward and backward,
at the two smallest batch sizes, on a fresh copy of the model with the job's threads, device and
autocast), cheap next to the steps (LeNet-5: about 0.1 s). A model that cannot be cut is reported
without units, with a note in the job's progress, never as a failure.

The memory and power figures come from ``agent.board_resources``, the link probe from
``agent.link_probe``; neither needs torch. This module is imported only by the worker (it needs
torch and Lightning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from edgefleet import __version__
from edgefleet.agent.board_resources import (
    PowerMeter,
    memory_total_bytes,
    peak_rss_bytes,
    reset_peak_rss,
)
from edgefleet.agent.cpu_threads import board_threads
from edgefleet.agent.link_probe import ProfileError, probe_link
from edgefleet.protocol.jobs import BUDGET_MIN_TIMED_STEPS, MAX_EVENT_BYTES, ProfileCommand
from edgefleet.protocol.profile_report import (
    MAX_UNITS,
    LinkReport,
    MeasuredPoint,
    ProfileReport,
    RoundsReport,
    UnitReport,
)
from edgefleet.workloads.fleet_trainer import TrainerOptions, board_accelerator, make_trainer
from edgefleet.workloads.layer_cut import CutRefused
from edgefleet.workloads.layer_timing import input_sampler, time_units
from edgefleet.workloads.lightning_api import callback_class, package_of
from edgefleet.workloads.module_setup import DataModuleHooks, RunFigures, prepare_module
from edgefleet.workloads.params import param_count, trainable_params
from edgefleet.workloads.preflight import optimizer_setup
from edgefleet.workloads.registry import build_model
from edgefleet.workloads.training_data import TrainingData, load_training_data

if TYPE_CHECKING:
    from edgefleet.agent.job_runner import WorkerContext
    from edgefleet.agent.worker_events import EventWriter

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # median absolute deviation -> standard deviation, for normally spread step times


# ---------------------------------------------------------------------------------------- steps

class _Measured(Exception):
    """Raised at the first batch after the timed steps: the measurement is complete."""


class StepClock:
    """Notes every ``on_train_batch_start`` that opens an optimizer step; runs the power meter over the timed steps.

    With ``accumulate`` K a step is K batches (Lightning's accumulation window): only the batches
    with ``batch_idx % K == 0`` open one. With ``budget_s`` > 0 the timing ends early, at the first
    step start by which the timed steps have lasted ``budget_s`` and at least ``min_timed`` of them
    ran (``BUDGET_MIN_TIMED_STEPS``, or every step asked if fewer): a slow board's long steps vary
    less in proportion, and need fewer. Its hooks are a Callback of the model's own Lightning
    package (``workloads.lightning_api``).
    """

    def __init__(self, warmup_steps: int, timed_steps: int, meter: PowerMeter, accumulate: int = 1, *,
                 budget_s: float = 0.0) -> None:
        self.warmup, self.timed, self.meter, self.accumulate = warmup_steps, timed_steps, meter, accumulate
        self.budget_s, self.min_timed = budget_s, min(BUDGET_MIN_TIMED_STEPS, timed_steps)
        self.starts: list[float] = []
        self.power_w: float | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.accumulate:  # inside a window: the step goes on
            return
        if pl_module.device.type == "cuda":  # a GPU runs ahead of Python: a step ends when its kernels do
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        self.starts.append(now)
        timed = len(self.starts) - self.warmup - 1  # timed steps complete
        if timed == 0:
            self.meter.start()
        elif timed >= self.timed or (self.budget_s > 0 and timed >= self.min_timed
                                     and now - self.starts[self.warmup] >= self.budget_s):
            self.power_w = self.meter.stop()
            raise _Measured

    @property
    def periods_s(self) -> list[float]:
        """The timed steps' periods (start of a step to the start of the next)."""
        return [b - a for a, b in zip(self.starts[self.warmup:], self.starts[self.warmup + 1:])]


def _batches(n: int, batch_size: int, count: int, seed: int) -> list[list[int]]:
    """``count`` batches of random sample indices (drawn with replacement: a batch may exceed the dataset)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(n, (count, batch_size), generator=generator).tolist()


def _measure(job: ProfileCommand, data: TrainingData, batch_size: int, meter: PowerMeter) -> tuple[MeasuredPoint, int]:
    """The batch size's figures and how many steps were timed for them."""
    torch.manual_seed(job.seed)
    model = build_model(job.model, job.model_options, data=data.train)
    package = package_of(model)
    accumulate = job.accumulate_grad_batches
    clock = callback_class(package, StepClock, "StepClock")(job.warmup_steps, job.timed_steps, meter, accumulate,
                                                             budget_s=job.timed_budget_s)
    callbacks = [clock]
    if data.datamodule is not None:  # its batch-transfer hooks run on every batch, as in training
        callbacks.append(callback_class(package, DataModuleHooks, "DataModuleHooks")(data.datamodule))
    # the steps' batches, and one more to open the window that ends the last timed step
    batches = _batches(len(data.train), batch_size, (job.warmup_steps + job.timed_steps) * accumulate + 1, job.seed)
    options = TrainerOptions(accumulate_grad_batches=accumulate, precision=job.precision)
    # one epoch over these batches: 16-mixed gets the loss-scaling plugin a board trains with
    trainer = make_trainer(package, options=options, total_steps=len(batches), callbacks=callbacks,
                           accelerator=board_accelerator(), max_epochs=1)
    try:
        trainer.fit(model, train_dataloaders=data.train_loader(batches))
    except _Measured:
        pass
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, MemoryError) or "alloc" in str(exc).lower():
            raise ProfileError(f"out of memory at batch size {batch_size} ({type(exc).__name__}: {str(exc)[:200]}); "
                               "profile smaller batch sizes (--batch)") from None
        raise
    periods = clock.periods_s
    if clock.power_w is None or len(periods) < clock.min_timed:
        raise ProfileError(f"the model trained only {len(clock.starts)} of {job.warmup_steps + job.timed_steps + 1} "
                           f"steps at batch size {batch_size}; does its training_step skip batches?")
    median = statistics.median(periods)
    spread = MAD_TO_SIGMA * statistics.median(abs(p - median) for p in periods)
    return MeasuredPoint(batch_size=batch_size, step_time_s=median, step_time_min_s=min(periods),
                         step_time_max_s=max(periods), step_time_spread_s=spread,
                         samples_per_s=batch_size * job.accumulate_grad_batches / median,  # a step is K batches
                         peak_memory_bytes=peak_rss_bytes(), power_w=clock.power_w), len(periods)


def _time_layers(job: ProfileCommand, data: TrainingData) -> tuple[tuple[UnitReport, ...], str]:
    """The model's pipeline units timed at the two smallest batch sizes, and a line saying how it went.

    Never raises for the model's sake: a model that cannot be cut (or whose units cannot be timed) gives
    no units and a line saying why; the rest of the profile stands.
    """
    sizes = sorted(set(job.batch_sizes))[:2]
    device = torch.device("cuda" if board_accelerator() == "gpu" else "cpu")
    started = time.perf_counter()
    try:
        torch.manual_seed(job.seed)
        model = build_model(job.model, job.model_options, data=data.train)  # built after the steps: not in their peak memory
        options = TrainerOptions(accumulate_grad_batches=job.accumulate_grad_batches, precision=job.precision)
        prepare_module(model, RunFigures(batches_per_epoch=job.accumulate_grad_batches, total_steps=1, options=options),
                       data.datamodule)
        units = time_units(model, input_sampler(data.train, data.collate_fn), (sizes[0], sizes[1]), device=device,
                           precision=job.precision)
    except CutRefused as exc:
        return (), f"per-layer timing skipped: {exc}"
    except Exception as exc:  # the profile stands whatever the model does under fx or autograd's hooks
        log.debug("timing the pipeline units of %s failed", job.model, exc_info=True)
        return (), f"per-layer timing skipped: {type(exc).__name__}: {str(exc)[:200]}"
    if len(units) > MAX_UNITS:
        return (), f"per-layer timing skipped: {len(units)} pipeline units, more than a report holds ({MAX_UNITS})"
    return units, (f"per-layer timing: {len(units)} pipeline units at batch sizes {sizes[0]} and {sizes[1]} "
                   f"in {time.perf_counter() - started:.2f} s")


def _settings_text(job: ProfileCommand) -> str:
    """``", bf16-mixed, 2 batches per step"``: the job's settings that are not the defaults, or ""."""
    parts = [job.precision] if job.precision != "32-true" else []
    if job.accumulate_grad_batches != 1:
        parts.append(f"{job.accumulate_grad_batches} batches per step")
    return "".join(f", {part}" for part in parts)


def run_profile(job: ProfileCommand, events: EventWriter, context: WorkerContext) -> int:
    """Measure ``job`` and report one ``finished`` event whose ``data`` is the ``protocol.profile_report.ProfileReport``.

    Raises:
        EdgeTrainError: unknown model or dataset, out of memory, the probe endpoint unreachable.
    """
    torch.set_num_threads(job.threads or board_threads())  # the threads a training job here would use
    if not reset_peak_rss():
        log.warning("cannot reset the peak RSS (/proc/self/clear_refs); memory figures include earlier jobs")
    pid = os.getpid()
    data = load_training_data(dataset=job.dataset, dataset_options=job.dataset_options, datamodule=job.datamodule,
                              datamodule_options=job.datamodule_options, cached=True, with_val=False)
    model = build_model(job.model, job.model_options, data=data.train)
    # layers built in setup/configure_model count too; a profile has no run yet: one step's figures
    options = TrainerOptions(accumulate_grad_batches=job.accumulate_grad_batches, precision=job.precision)
    figures = prepare_module(model, RunFigures(batches_per_epoch=job.accumulate_grad_batches, total_steps=1,
                                               options=options), data.datamodule)
    count = param_count(trainable_params(optimizer_setup(model, figures).optimizer))
    del model
    events.emit("running", f"profiling {job.model} on {data.source}{_settings_text(job)} (worker pid {pid})",
                data={"worker_pid": pid})
    meter = PowerMeter(context)
    try:
        idle_w = meter.idle_w()
        points, windows = [], []
        for batch_size in sorted(set(job.batch_sizes)):
            point, timed = _measure(job, data, batch_size, meter)
            points.append(point)
            windows.append(point.step_time_s * timed)  # the power's weight: how long it was read
            per_step = f"{batch_size} x {job.accumulate_grad_batches}" if job.accumulate_grad_batches > 1 else batch_size
            budget = f" ({timed} of {job.timed_steps} steps timed: {job.timed_budget_s:g} s budget)" \
                if timed < job.timed_steps else ""
            events.emit("progress", f"batch {per_step}: {point.step_time_s * 1000:.1f} ms/step{budget}, "
                                    f"{point.samples_per_s:.0f} samples/s, peak {point.peak_memory_bytes / 1e6:.0f} MB, "
                                    f"{point.power_w:.2f} W ({meter.label})")
        units, note = _time_layers(job, data)
        events.emit("progress", note)
        link = rounds = None
        if job.probe_bytes or job.probe_rounds:  # after the steps: another board's probe traffic must not slow them
            probed = probe_link(host=job.probe_host, port=job.probe_port, token=job.probe_token, job_id=job.job_id,
                                board_id=job.board_id, nbytes=job.probe_bytes, round_bytes=job.probe_round_bytes,
                                rounds=job.probe_rounds, meter=meter)
            link, rounds = probed.bulk, probed.rounds
            if link is not None:
                events.emit("progress", f"link up {link.up_bytes_per_s * 8e-6:.1f} Mbit/s, "
                                        f"down {link.down_bytes_per_s * 8e-6:.1f} Mbit/s, {link.power_w:.2f} W ({meter.label})")
            if rounds is not None:
                events.emit("progress", f"gradient of {rounds.round_bytes / 1e6:.2f} MB up and back in "
                                        f"{rounds.round_s * 1000:.1f} ms (median of {rounds.rounds}), "
                                        f"{rounds.power_w:.2f} W ({meter.label})")
    finally:
        meter.close()
    active_w = sum(p.power_w * w for p, w in zip(points, windows)) / sum(windows)
    report = ProfileReport(
        agent_version=__version__, worker_pid=pid, torch_threads=torch.get_num_threads(), param_count=count,
        points=tuple(points), active_power_w=active_w, idle_power_w=idle_w, power_source=meter.label,
        memory_total_bytes=memory_total_bytes(),
        link=None if link is None else LinkReport(up_bytes_per_s=link.up_bytes_per_s, down_bytes_per_s=link.down_bytes_per_s,
                                                  nbytes=job.probe_bytes, power_w=link.power_w),
        link_rounds=None if rounds is None else RoundsReport(round_bytes=rounds.round_bytes, rounds=rounds.rounds,
                                                             round_s=rounds.round_s, power_w=rounds.power_w),
        units=units)
    size = _wire_size(report)
    if size > MAX_EVENT_BYTES // 2 and report.units:  # the units are what the planner can do without
        events.emit("progress", f"per-layer figures left out: with them the result is {size} bytes, over "
                                f"{MAX_EVENT_BYTES // 2}")
        report = dataclasses.replace(report, units=())
        size = _wire_size(report)
    if size > MAX_EVENT_BYTES // 2:
        raise ProfileError(f"the profile result is {size} bytes, over {MAX_EVENT_BYTES // 2}; profile fewer batch sizes")
    events.emit("finished", f"profiled {len(points)} batch sizes", data=report.to_wire())
    return 0


def _wire_size(report: ProfileReport) -> int:
    """The report's size as the event carries it.

    Raises:
        ProfileError: a figure is not a finite number (the coordinator refuses those).
    """
    try:
        return len(json.dumps(report.to_wire(), allow_nan=False))
    except ValueError:
        raise ProfileError("a profile figure is not a finite number (a clock or sensor misbehaved); profile again") from None


__all__ = ["ProfileError", "StepClock", "run_profile"]
