"""Check estimates against reality: pre-train candidates for a few real steps and measure them.

The original framework (Gu et al., ICPADS 2019) chose its configuration from short pre-training
runs; ``plan --verify K`` does that for the K best estimated candidates. Each one runs as a real
:class:`TrainingRun` of ``warmup_steps + steps + 1`` steps: the step time is the median interval
between step completions after the warm-up (the last step, which also validates, is not timed),
and power is each board's telemetry averaged over the timed steps (:class:`PowerMeter`). The
candidate with the best measured objective is chosen, and where a measured figure differs from
its estimate by more than :data:`DISAGREEMENT` the report says so.

A candidate in a mode that changes the mathematics (local SGD every H steps) is pre-trained in
that mode with no exact warm-up, as its estimate is the steady state, and timed in whole periods
of H steps: the median of the periods' mean step, since one step in H carries the exchange. As
in the plan, it is chosen over the best measured exact candidate only when it beats it by the
inexact margin (``planning.search`` module doc).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.control.power_meter import PowerMeter, PowerReading
from edgefleet.coordinator.planning import INEXACT_MARGIN, Estimate, format_duration
from edgefleet.coordinator.planning.objectives import OBJECTIVE_KEY
from edgefleet.coordinator.planning.plan_job import candidate_fields
from edgefleet.coordinator.planning.plan_summary import batches_text, estimate_json, fmt_si, fmt_step
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

DISAGREEMENT = 0.15      # a measured figure this far (relative) from its estimate is flagged
WARMUP_STEPS = 3
READY_TIMEOUT_S = 60.0   # boards return to idle after a job once their worker has exited


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """Measured figures of one configuration, in the units of :class:`Estimate`."""

    step_time_s: float             # median step wall time after the warm-up
    samples_per_s: float
    epoch_time_s: float            # dataset_len / samples_per_s, as the estimate counts it
    power_w: float | None          # sum of the boards' mean power (None: no telemetry with power)
    energy_per_epoch_j: float | None
    edp_j_s: float | None
    power_measured: bool           # every board's figure came from a sensor (else some are estimates)
    steps: int                     # step intervals timed
    intervals_s: tuple[float, ...] = ()  # the timed intervals themselves (empty: a mean of several runs)

    def objective_value(self, objective: str) -> float | None:
        """The measured figure ``objective`` minimises (None: energy or EDP without power telemetry)."""
        value: float | None = getattr(self, OBJECTIVE_KEY[objective])
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """One pre-trained candidate."""

    estimate: Estimate
    measured: Measurement | None
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    objective: str
    trials: tuple[Trial, ...]      # in the estimate's ranking
    chosen: Trial                  # best measured objective
    elapsed_s: float               # the pre-training's overhead, wall time

    @property
    def agrees(self) -> bool:
        """True when the measurements chose the candidate the estimates ranked first."""
        return self.chosen is self.trials[0]


def step_intervals(elapsed_s: Sequence[float], *, warmup_steps: int, exclude: Sequence[int] = ()) -> list[float]:
    """Intervals between consecutive step completions, after ``warmup_steps`` and without ``exclude`` (step indices)."""
    skip = set(exclude)
    return [b - a for i, (a, b) in enumerate(itertools.pairwise(elapsed_s), 1) if i >= warmup_steps and i not in skip]


def measure(intervals: Sequence[float], readings: dict[str, PowerReading], *, boards: Sequence[str],
            global_batch: int, dataset_len: int, count_idle: bool = False, period: int = 1,
            accumulate: int = 1) -> Measurement:
    """Measured figures from step intervals (s) and power readings of the fleet's boards.

    ``period``: the training mode's steps per full exchange (local SGD's H): the step time is the
    median over consecutive groups of ``period`` intervals of their mean (1: the median interval).
    ``accumulate``: the job's ``--accumulate-grad-batches``: a step trains that many global batches.
    """
    if not intervals:
        raise EdgeTrainError("no step was timed after the warm-up; give more steps")
    groups = len(intervals) // max(1, period)
    if not groups:
        raise EdgeTrainError(f"{len(intervals)} steps timed, fewer than one period of {period} steps "
                             "(the mode exchanges once per period); give more steps")
    if period > 1:
        step = statistics.median(statistics.fmean(intervals[g * period:(g + 1) * period]) for g in range(groups))
        intervals = intervals[:groups * period]
    else:
        step = statistics.median(intervals)
    samples_per_s = accumulate * global_batch / step
    epoch = dataset_len / samples_per_s
    counted = [r for b, r in readings.items() if b in boards or count_idle]
    known = [r for r in counted if r.mean_power_w is not None]
    watts = [r.mean_power_w for r in known if r.mean_power_w is not None]  # the same readings, typed as floats
    power = sum(watts) if known and len(known) == len(counted) else None
    energy = None if power is None else power * epoch
    return Measurement(step_time_s=step, samples_per_s=samples_per_s, epoch_time_s=epoch, power_w=power,
                       energy_per_epoch_j=energy, edp_j_s=None if energy is None else energy * epoch,
                       power_measured=bool(known) and all(r.measured for r in known), steps=len(intervals),
                       intervals_s=tuple(intervals))


def mean_measurement(takes: Sequence[Measurement]) -> Measurement:
    """One candidate measured in several runs, as one: the mean of their step times and of their power.

    Each run's step is already a median; the mean over runs taken in turn forth and back (A B C C B A) cancels a
    host's drift over the whole comparison, which one run of each cannot.
    """
    if not takes:
        raise ValueError("no measurement to combine")
    if len(takes) == 1:
        return takes[0]
    first = takes[0]
    step = statistics.fmean(m.step_time_s for m in takes)
    scale = step / first.step_time_s
    epoch = first.epoch_time_s * scale
    powers = [m.power_w for m in takes]
    power = None if any(p is None for p in powers) else statistics.fmean(p for p in powers if p is not None)
    energy = None if power is None else power * epoch
    return Measurement(step_time_s=step, samples_per_s=first.samples_per_s / scale, epoch_time_s=epoch, power_w=power,
                       energy_per_epoch_j=energy, edp_j_s=None if energy is None else energy * epoch,
                       power_measured=all(m.power_measured for m in takes), steps=sum(m.steps for m in takes))


def wait_ready(view: Any, boards: Sequence[str], *, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until every board says it is online and idle (a finished job's worker has exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {r.board_id: r.state for r in view.rows()}
        waiting = [b for b in boards if states.get(b) != "online"]
        if not waiting:
            return
        if time.monotonic() > deadline:
            where = ", ".join(f"{b} ({states.get(b, 'not reporting')})" for b in waiting)
            raise EdgeTrainError(f"board(s) {where} did not become idle within {timeout_s:.0f} s; check their agents")
        time.sleep(0.1)


def pretraining_job(job: JobSpec, estimate: Estimate, total_steps: int) -> JobSpec:
    """``job`` on the candidate's boards, batch sizes and variant, for ``total_steps`` steps in one epoch.

    The job's other settings (seed, learning rate, wire dtype, data mode, threads, Lightning's flags,
    the exchange's address) are kept, so the candidate is measured as it would train; it writes no
    checkpoint and no logger, and a forced split (a test hook) is dropped. An inexact candidate
    runs in its mode from the first step (``sync_warmup=0``: its estimate is the steady state).
    """
    c = estimate.candidate
    fields = candidate_fields(c)  # its boards, batch sizes and mode (layer placement too: it is measured placed)
    if not c.mode.exact:
        fields["sync_warmup"] = 0
    return replace(job, run_id=f"verify-{secrets.token_hex(3)}", **fields,
                   model_options=dict(job.model_options) | dict(c.variant), epochs=None, steps=total_steps,
                   total_steps=total_steps, steps_per_epoch=total_steps, batches_per_epoch=0, checkpoint_every=10**9,
                   logger="none", force_split=None)


def pretrain(estimate: Estimate, job: JobSpec, *, broker: BrokerSettings, fleet_key: bytes, meter: PowerMeter,
             dataset_len: int, steps: int, warmup_steps: int = WARMUP_STEPS, count_idle: bool = False) -> Measurement:
    """Train one candidate of ``job`` for ``warmup_steps + steps + 1`` real steps and measure it.

    ``job``'s model options are the base every variant's options go on top of. In a mode that
    exchanges every H steps, ``steps`` is rounded up to whole periods of H.
    """
    c = estimate.candidate
    period = c.mode.sync_every
    steps = -(-steps // period) * period
    spec = pretraining_job(job, estimate, warmup_steps + steps + 1)
    intervals, readings = timed_steps(spec, broker=broker, fleet_key=fleet_key, meter=meter,
                                      warmup_steps=warmup_steps, what=batches_text(estimate))
    return measure(intervals, readings, boards=c.boards, global_batch=c.global_batch, dataset_len=dataset_len,
                   count_idle=count_idle, period=period, accumulate=spec.accumulate_grad_batches)


def timed_steps(spec: JobSpec, *, broker: BrokerSettings, fleet_key: bytes, meter: PowerMeter, warmup_steps: int,
                what: str) -> tuple[list[float], dict[str, PowerReading]]:
    """Train the resolved ``spec`` (``warmup_steps``, the timed steps, one more that also validates) with no run
    directory kept: the intervals between the timed steps' completions, and each board's power over them.

    Raises:
        EdgeTrainError: a board failed its audit or left a pipeline, or the run stopped early (``what`` names the
            candidate).
        KeyboardInterrupt: Ctrl-C.
    """
    from edgefleet.coordinator.run.training import StepView, TrainingRun  # torch: only to pre-train

    total = spec.total_steps
    done: list[float] = []
    window: dict[str, float] = {}

    def on_step(view: StepView) -> None:
        done.append(time.monotonic())
        if view.step == warmup_steps - 1:
            window["start"] = done[-1]
        if view.step == total - 2:  # the last timed step; the final one also validates
            window["end"] = done[-1]

    with tempfile.TemporaryDirectory(prefix="edgefleet-verify-") as tmp:
        run = TrainingRun(spec, run_dir=Path(tmp), broker=broker, fleet_key=fleet_key, on_step=on_step,
                          on_note=lambda text: log.debug("%s", text))
        outcome = asyncio.run(run.run())
    if outcome.rolled_back:  # a board failed its audit: this candidate's figures would not be the honest boards'
        raise EdgeTrainError(f"pre-training: {outcome.rolled_back[0].describe()}; leave it out (--boards) and plan again")
    if outcome.replan is not None:  # a pipeline's board left, or slowed for good: the plan was not measured as planned
        raise EdgeTrainError(f"pre-training {what}: a board left the pipeline after {len(done)} of {total} steps, so it "
                             "was not measured; check the boards (edge-coordinator status) and plan again")
    if outcome.interrupted:  # Ctrl-C: stop pre-training altogether
        raise KeyboardInterrupt
    if "end" not in window:
        raise EdgeTrainError(f"pre-training {what} stopped after {len(done)} of {total} steps")
    readings = meter.average(window.get("start", done[0]), window["end"])
    return step_intervals(done[:-1], warmup_steps=warmup_steps), readings


def verify_candidates(estimates: Sequence[Estimate], job: JobSpec, *, broker: BrokerSettings, fleet_key: bytes,
                      objective: str, steps: int, dataset_len: int, fleet_boards: Sequence[str],
                      count_idle: bool = False, warmup_steps: int = WARMUP_STEPS, inexact_margin: float = INEXACT_MARGIN,
                      on_note: Callable[[str], None] = lambda _: None) -> VerifyResult:
    """Pre-train each candidate in turn and choose the best by its measured objective.

    A candidate whose mode changes the mathematics is chosen only when its measured objective
    beats the best measured exact candidate's by ``inexact_margin``.

    Raises:
        EdgeTrainError: every pre-training failed (the message lists why).
    """
    started = time.monotonic()
    trials: list[Trial] = []
    with monitor_fleet(broker, preferred=fleet_boards) as view, PowerMeter(view, fleet_boards) as meter:
        for i, estimate in enumerate(estimates, 1):
            mode = "" if estimate.mode.exact else f", {estimate.mode.name}"
            on_note(f"pre-training candidate {i}/{len(estimates)}: {batches_text(estimate)} "
                    f"({estimate.variant_label}{mode}), {warmup_steps} warm-up + {steps} timed steps")
            try:
                wait_ready(view, estimate.candidate.boards)
                measured = pretrain(estimate, job, broker=broker, fleet_key=fleet_key, meter=meter,
                                    dataset_len=dataset_len, steps=steps, warmup_steps=warmup_steps,
                                    count_idle=count_idle)
            except EdgeTrainError as exc:
                on_note(f"candidate {i} could not be pre-trained: {exc}")
                trials.append(Trial(estimate=estimate, measured=None, error=str(exc)))
                continue
            trials.append(Trial(estimate=estimate, measured=measured))
        wait_ready(view, sorted({b for e in estimates for b in e.candidate.boards}))
    ok = [t for t in trials if t.measured is not None]
    if not ok:
        raise EdgeTrainError("no candidate could be pre-trained: " + "; ".join(t.error for t in trials))
    chosen = choose_measured(ok, objective, inexact_margin=inexact_margin)
    result = VerifyResult(objective=objective, trials=tuple(trials), chosen=chosen,
                          elapsed_s=time.monotonic() - started)
    log.info("verify: %d candidates pre-trained in %.1f s; chosen %s", len(ok), result.elapsed_s,
             batches_text(chosen.estimate))
    return result


def choose_measured(trials: Sequence[Trial], objective: str, *, inexact_margin: float = INEXACT_MARGIN) -> Trial:
    """The measured trial with the best objective; one whose mode changes the mathematics only if it
    beats the best measured exact trial by ``inexact_margin``. Every trial must have a measurement."""

    def score(t: Trial) -> float:
        assert t.measured is not None
        value = t.measured.objective_value(objective)
        if value is None:  # no power telemetry: fall back on the estimated power for energy and EDP
            value = t.estimate.power_w * t.measured.epoch_time_s * (t.measured.epoch_time_s if objective == "edp" else 1)
        return value

    chosen = min(trials, key=score)
    exact = [t for t in trials if t.estimate.mode.exact]
    if not chosen.estimate.mode.exact and exact and score(chosen) > score(min(exact, key=score)) * (1.0 - inexact_margin):
        return min(exact, key=score)
    return chosen


# ------------------------------------------------------------------------------------- figures in words

FIGURES = (  # (label, attribute of both Estimate and Measurement, formatter)
    ("step time", "step_time_s", fmt_step),
    ("samples/s", "samples_per_s", lambda v: f"{v:.0f}"),
    ("time per epoch", "epoch_time_s", format_duration),
    ("power", "power_w", lambda v: f"{v:.1f} W"),
    ("energy per epoch", "energy_per_epoch_j", lambda v: fmt_si(v, "J")),
    ("EDP", "edp_j_s", lambda v: fmt_si(v, "J·s")),
)


def differences(estimate: Estimate, measured: Measurement) -> list[tuple[str, float, float | None, float | None]]:
    """(figure, predicted, measured, relative difference) for every figure of the comparison."""
    out = []
    for label, name, _ in FIGURES:
        predicted, actual = float(getattr(estimate, name)), getattr(measured, name)
        rel = None if actual is None or predicted == 0 else actual / predicted - 1.0
        out.append((label, predicted, actual, rel))
    return out


def disagreements(estimate: Estimate, measured: Measurement, *, tolerance: float = DISAGREEMENT) -> list[str]:
    """``"step time 45.0 ms vs 30.0 ms predicted (+50%)"`` for every figure off by more than ``tolerance``."""
    fmt = {label: f for label, _, f in FIGURES}
    return [f"{label} {fmt[label](actual)} vs {fmt[label](predicted)} predicted ({rel:+.0%})"
            for label, predicted, actual, rel in differences(estimate, measured)
            if rel is not None and actual is not None and abs(rel) > tolerance]


def disagreement_line(what: str, estimate: Estimate, measured: Measurement, *,
                      tolerance: float = DISAGREEMENT) -> str:
    """One line saying where ``what``'s measurement and estimate disagree, or that they agree."""
    found = disagreements(estimate, measured, tolerance=tolerance)
    if not found:
        return f"{what}: every measured figure is within {tolerance:.0%} of the estimate"
    return f"{what}: the measurement disagrees with the estimate by more than {tolerance:.0%}: " + "; ".join(found)


def verify_json(result: VerifyResult) -> dict[str, Any]:
    """The pre-training's figures and choice, as ``plan --json`` prints them."""

    def trial(t: Trial) -> dict[str, Any]:
        m = t.measured
        return {"estimate": estimate_json(t.estimate), "error": t.error,
                "measured": None if m is None else {
                    "step_time_s": m.step_time_s, "samples_per_s": m.samples_per_s, "epoch_time_s": m.epoch_time_s,
                    "power_w": m.power_w, "energy_per_epoch_j": m.energy_per_epoch_j, "edp_j_s": m.edp_j_s,
                    "power_measured": m.power_measured, "steps": m.steps},
                "disagreements": [] if m is None else disagreements(t.estimate, m)}

    return {"objective": result.objective, "elapsed_s": result.elapsed_s, "agrees": result.agrees,
            "chosen": result.trials.index(result.chosen), "trials": [trial(t) for t in result.trials]}


__all__ = ["DISAGREEMENT", "FIGURES", "Measurement", "Trial", "VerifyResult", "choose_measured", "differences", "disagreement_line",
           "disagreements", "mean_measurement", "measure", "pretrain", "pretraining_job", "step_intervals", "timed_steps",
           "verify_candidates", "verify_json", "wait_ready"]
