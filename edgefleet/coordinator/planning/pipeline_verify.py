"""``plan --pipeline --verify K``: pre-train the K best pipeline plans for a few real steps and choose on measurement.

The pipeline cost model is within 11-17% of the lab's measured steps (docs/benchmarks.md), and a fleet's front
runners are often closer together than that: plans a few percent apart by estimate that differ by 10-20% when
trained. As ``plan --verify`` does for data parallelism (``planning.verify``), K plans that train can run
(:func:`front_runners`: the best of each layout of boards first, over every variant and global batch planned) are
trained in turn as real runs of ``3 + N + 1`` steps on the boards, and the best measured objective is chosen. With
``--verify-rounds R`` (default 2) each plan is trained R times, in turn forth and back (A B C C B A), and its figure is
the mean of its runs: one short run of a plan on the lab is 0.87-1.28 of a long one's step, and a host's drift over the
comparison falls on the first plans and the last alike (docs/benchmarks.md, 2026-11-30). A plan of one
stage trains data-parallel; the others as ``train --pipeline`` runs them (GPipe, ``--stage-sync checkpoint``, the
board's pipeline port from ``--pipeline-port``), with no revision during the few steps (a revision would measure
another plan). Every plan is exact (``Trainer.fit``'s mathematics), so no margin is asked of any of them.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.control.power_meter import PowerMeter
from edgefleet.coordinator.planning import format_duration
from edgefleet.coordinator.planning.pipeline_job import PipelineOption, PipelineOutcome
from edgefleet.coordinator.planning.pipeline_model import PipelinePlan
from edgefleet.coordinator.planning.pipeline_search import ranked_pipelines
from edgefleet.coordinator.planning.pipeline_train import TrainFlags, pipeline_text, train_flags
from edgefleet.coordinator.planning.plan_summary import fmt_step
from edgefleet.coordinator.planning.verify import (
    WARMUP_STEPS,
    Measurement,
    mean_measurement,
    measure,
    timed_steps,
    wait_ready,
)
from edgefleet.coordinator.run.job_spec import JobSpec, batches_per_epoch
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

DEFAULT_VERIFY_ROUNDS = 2   # each plan pre-trained twice, A B C C B A


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineCandidate:
    """A plan train can run, with the variant and global batch it was planned for."""

    option: PipelineOption
    plan: PipelinePlan
    flags: TrainFlags

    @property
    def boards(self) -> tuple[str, ...]:
        return tuple(b for s in self.plan.stages for b in s.boards)

    def label(self) -> str:
        """The plan in train's words: ``x86-1+pi5-1,net.5@pi4-3 M=4`` or ``data-parallel x86-1+pi5-1``."""
        if len(self.plan.stages) == 1:
            return f"data-parallel {'+'.join(self.boards)}"
        return f"{pipeline_text(self.option.problem, self.plan)} M={self.plan.micro_batches}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineTrial:
    """One pre-trained plan: ``measured`` is the mean of ``takes``, its runs in the order they were trained."""

    candidate: PipelineCandidate
    measured: Measurement | None
    error: str = ""
    takes: tuple[Measurement, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineVerifyResult:
    objective: str
    trials: tuple[PipelineTrial, ...]   # best estimate first
    chosen: PipelineTrial               # best measured objective
    elapsed_s: float

    @property
    def agrees(self) -> bool:
        """True when the measurements chose the plan the estimates ranked first."""
        return self.chosen is self.trials[0]


def front_runners(outcome: PipelineOutcome, objective: str, count: int) -> list[PipelineCandidate]:
    """The ``count`` plans to pre-train, over every variant and global batch planned, best estimate first.

    Plans on other boards or in another order are what the estimate may rank wrong by more than its error; a cut
    moved by a layer or another M on the same boards mostly costs what the plan does, and two short runs of such
    twins differ by noise alone (on the lab, 10-20%). So the best plan of each layout (the boards of each stage) comes
    first, in the estimate's order, then the best of a layout at another M, then the rest.
    """
    found = []
    for option in outcome.options:
        if option.result.plan is None:
            continue
        plans, _ = ranked_pipelines(option.problem, objective, limit=max(count * 4, 12))
        for plan in plans:
            flags = train_flags(option.problem, plan)
            if flags.flags:
                found.append(PipelineCandidate(option=option, plan=plan, flags=flags))
    found.sort(key=lambda c: c.plan.objective_value(objective))
    chosen: list[PipelineCandidate] = []
    for key in (_layout, lambda c: (*_layout(c), c.plan.micro_batches), id):
        seen = {key(c) for c in chosen}
        for candidate in found:
            if len(chosen) < count and key(candidate) not in seen:  # a chosen one's key is in seen
                seen.add(key(candidate))
                chosen.append(candidate)
    return sorted(chosen, key=lambda c: c.plan.objective_value(objective))


def _layout(candidate: PipelineCandidate) -> tuple[object, ...]:
    """A plan's boards stage by stage, with its variant and global batch."""
    return (candidate.option.variant_label, candidate.plan.global_batch, *(s.boards for s in candidate.plan.stages))


def pipeline_pretraining_job(job: JobSpec, candidate: PipelineCandidate, total_steps: int) -> JobSpec:
    """``job`` as ``candidate`` trains, for ``total_steps`` steps: its variant, boards and batch sizes, and for two or
    more stages its pipeline and micro-batches. No checkpoint, logger or revision (``planning.verify``'s
    ``pretraining_job`` for data parallelism keeps the job's other settings alike).

    Its epochs are the data's, as the boards count them: a later stage's board sends its state at each epoch's end
    (``protocol.stage_sync``), and the coordinator must expect it at the same steps.
    """
    plan, option = candidate.plan, candidate.option
    first = plan.stages[0]
    stage0 = tuple(m * plan.micro_batches for m in first.micro_batch_sizes)
    fields: dict[str, Any] = {"boards": first.boards, "batch_sizes": stage0}
    if len(plan.stages) > 1:
        fields = {"boards": candidate.boards, "batch_sizes": stage0 + (0,) * (len(candidate.boards) - len(first.boards)),
                  "pipeline": pipeline_text(option.problem, plan), "micro_batches": plan.micro_batches,
                  "stage_sync": "checkpoint"}
    spec = replace(job, run_id=f"verify-{secrets.token_hex(3)}", **fields,
                   model_options=dict(job.model_options) | dict(option.variant), epochs=None, steps=total_steps,
                   total_steps=total_steps, checkpoint_every=10**9, logger="none", force_split=None, rebalance=False,
                   sync_every=1, sync_warmup=None, placement="")
    batches = batches_per_epoch(spec, option.problem.dataset_len, spec.batch_sizes)
    return replace(spec, batches_per_epoch=batches, steps_per_epoch=-(-batches // spec.accumulate_grad_batches))


def pretrain_plan(candidate: PipelineCandidate, job: JobSpec, *, broker: BrokerSettings, fleet_key: bytes,
                  meter: PowerMeter, steps: int, warmup_steps: int = WARMUP_STEPS,
                  count_idle: bool = False) -> Measurement:
    """Train ``candidate`` for ``warmup_steps + steps + 1`` real steps and measure it."""
    spec = pipeline_pretraining_job(job, candidate, warmup_steps + steps + 1)
    intervals, readings = timed_steps(spec, broker=broker, fleet_key=fleet_key, meter=meter,
                                      warmup_steps=warmup_steps, what=candidate.label())
    return measure(intervals, readings, boards=candidate.boards, global_batch=candidate.plan.global_batch,
                   dataset_len=candidate.option.problem.dataset_len, count_idle=count_idle)


def verify_plans(candidates: Sequence[PipelineCandidate], job: JobSpec, *, broker: BrokerSettings, fleet_key: bytes,
                 objective: str, steps: int, fleet_boards: Sequence[str], count_idle: bool = False,
                 warmup_steps: int = WARMUP_STEPS, rounds: int = DEFAULT_VERIFY_ROUNDS,
                 on_note: Callable[[str], None] = lambda _: None) -> PipelineVerifyResult:
    """Pre-train each candidate ``rounds`` times in turn (:func:`round_order`) and choose the best by the mean of its
    measured objective. A plan that fails once is not trained again.

    Raises:
        EdgeTrainError: no candidate to pre-train, or every pre-training failed (the message lists why).
    """
    if not candidates:
        raise EdgeTrainError("no plan that train can run to pre-train: plan without --verify to see why")
    started = time.monotonic()
    takes: dict[int, list[Measurement]] = {i: [] for i in range(len(candidates))}
    errors: dict[int, str] = {}
    order = round_order(len(candidates), rounds)
    with monitor_fleet(broker, preferred=fleet_boards) as view, PowerMeter(view, fleet_boards) as meter:
        for n, i in enumerate(order, 1):
            candidate = candidates[i]
            if i in errors:
                continue
            on_note(f"pre-training {n}/{len(order)}: plan {i + 1}, {candidate.label()} (global batch "
                    f"{candidate.plan.global_batch}, {candidate.option.variant_label}), {warmup_steps} warm-up + "
                    f"{steps} timed steps")
            try:
                wait_ready(view, candidate.boards)
                takes[i].append(pretrain_plan(candidate, job, broker=broker, fleet_key=fleet_key, meter=meter,
                                              steps=steps, warmup_steps=warmup_steps, count_idle=count_idle))
            except EdgeTrainError as exc:
                on_note(f"plan {i + 1} could not be pre-trained: {exc}")
                errors[i] = str(exc)
        wait_ready(view, sorted({b for c in candidates for b in c.boards}))
    trials = tuple(PipelineTrial(candidate=c, measured=None, error=errors[i], takes=tuple(takes[i])) if i in errors
                   else PipelineTrial(candidate=c, measured=mean_measurement(takes[i]), takes=tuple(takes[i]))
                   for i, c in enumerate(candidates))
    ok = [t for t in trials if t.measured is not None]
    if not ok:
        raise EdgeTrainError("no plan could be pre-trained: " + "; ".join(t.error for t in trials))
    chosen = min(ok, key=lambda t: measured_objective(t, objective))
    result = PipelineVerifyResult(objective=objective, trials=trials, chosen=chosen,
                                  elapsed_s=time.monotonic() - started)
    log.info("pipeline verify: %d plans pre-trained %d times in %.1f s; chosen %s", len(ok), rounds,
             result.elapsed_s, chosen.candidate.label())
    return result


def round_order(count: int, rounds: int) -> list[int]:
    """The order ``rounds`` turns over ``count`` plans are trained in: forth, back, forth... (0 1 2 2 1 0 for 3, 2)."""
    if count < 1 or rounds < 1:
        raise ValueError(f"count {count} and rounds {rounds} must be at least 1")
    return [i for r in range(rounds) for i in (range(count) if r % 2 == 0 else reversed(range(count)))]


def measured_objective(trial: PipelineTrial, objective: str) -> float:
    """The trial's measured figure for ``objective``; energy and EDP without power telemetry use the plan's power."""
    m = trial.measured
    assert m is not None
    value = m.objective_value(objective)
    if value is None:
        epoch = m.epoch_time_s
        value = trial.candidate.plan.power_w * epoch * (epoch if objective == "edp" else 1)
    return value


def verify_lines(result: PipelineVerifyResult) -> list[str]:
    """The comparison in words: each plan's predicted and measured step, and the choice with its train flags."""
    lines = []
    for i, t in enumerate(result.trials, 1):
        plan, m = t.candidate.plan, t.measured
        mark = "chosen " if t is result.chosen else ""
        if m is None:
            lines.append(f"  {i}. {t.candidate.label()}: predicted {fmt_step(plan.step_time_s)} a step; not measured: "
                         f"{t.error}")
            continue
        off = m.step_time_s / plan.step_time_s - 1.0
        each = f" (mean of {', '.join(fmt_step(x.step_time_s) for x in t.takes)})" if len(t.takes) > 1 else ""
        lines.append(f"  {i}. {mark}{t.candidate.label()}: predicted {fmt_step(plan.step_time_s)} a step, measured "
                     f"{fmt_step(m.step_time_s)}{each} ({off:+.0%}), {m.samples_per_s:.0f} samples/s, epoch "
                     f"{format_duration(m.epoch_time_s)}")
    runs = max(len(t.takes) for t in result.trials)
    head = (f"pre-trained {len(result.trials)} plans{f', {runs} runs each,' if runs > 1 else ''} in "
            f"{format_duration(result.elapsed_s)}: "
            + ("the measurements agree with the estimate's pick" if result.agrees
               else f"the measurements choose plan {result.trials.index(result.chosen) + 1}, not the estimate's pick"))
    return [head, *lines, result.chosen.candidate.flags.line()]


def pipeline_verify_json(result: PipelineVerifyResult) -> dict[str, Any]:
    """The pre-training's figures and choice, as ``plan --pipeline --json`` prints them."""

    def trial(t: PipelineTrial) -> dict[str, Any]:
        m, plan = t.measured, t.candidate.plan
        return {"plan": t.candidate.label(), "variant": t.candidate.option.variant_label,
                "global_batch": plan.global_batch, "micro_batches": plan.micro_batches,
                "boards": list(t.candidate.boards), "train_flags": list(t.candidate.flags.flags),
                "predicted": {"step_time_s": plan.step_time_s, "epoch_time_s": plan.epoch_time_s, "power_w": plan.power_w,
                              "energy_per_epoch_j": plan.energy_per_epoch_j, "edp_j_s": plan.edp_j_s},
                "error": t.error,
                "measured": None if m is None else {
                    "step_time_s": m.step_time_s, "samples_per_s": m.samples_per_s, "epoch_time_s": m.epoch_time_s,
                    "power_w": m.power_w, "energy_per_epoch_j": m.energy_per_epoch_j, "edp_j_s": m.edp_j_s,
                    "power_measured": m.power_measured, "steps": m.steps},
                "takes": [{"step_time_s": x.step_time_s, "power_w": x.power_w, "intervals_s": list(x.intervals_s)}
                          for x in t.takes]}

    return {"objective": result.objective, "elapsed_s": result.elapsed_s, "agrees": result.agrees,
            "chosen": result.trials.index(result.chosen), "trials": [trial(t) for t in result.trials]}


__all__ = ["DEFAULT_VERIFY_ROUNDS", "PipelineCandidate", "PipelineTrial", "PipelineVerifyResult", "front_runners", "measured_objective",
           "pipeline_pretraining_job", "pipeline_verify_json", "pretrain_plan", "round_order", "verify_lines", "verify_plans"]
