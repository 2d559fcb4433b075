"""A pipeline plan as text: its stages, each board's batch, memory against its limit and link bytes, the
bubble, the step's time and energy. Plain strings, for ``plan``'s output as much as for a note."""

from __future__ import annotations

import logging

from edgefleet.coordinator.planning.cost_model import format_duration
from edgefleet.coordinator.planning.objectives import OBJECTIVE_TEXT
from edgefleet.coordinator.planning.pipeline_model import PipelinePlan, PipelineProblem
from edgefleet.coordinator.planning.pipeline_planner import PipelineResult

log = logging.getLogger(__name__)

HEADER = ("stage", "layers", "board", "batch", "micro", "memory used / limit", "up / step", "down / step")


def render_result(problem: PipelineProblem, result: PipelineResult) -> str:
    """The plan (:func:`render_plan`) or the line saying why none fits; then the search's notes."""
    body = render_plan(problem, result.plan) if result.plan is not None else result.no_fit
    notes = "".join(f"\nnote: {n}" for n in result.notes)
    return f"{body}\nchosen for the least {OBJECTIVE_TEXT[result.objective]}{notes}" if result.plan else body + notes


def render_plan(problem: PipelineProblem, plan: PipelinePlan) -> str:
    """A heading, one table row per board (stage by stage) and a summary line."""
    S, M = len(plan.stages), plan.micro_batches
    heading = (f"pipeline: {S} stage{'s' if S > 1 else ''}, {M} micro-batch{'es' if M > 1 else ''} of "
               f"{plan.global_batch // M} samples, {plan.schedule}, global batch {plan.global_batch}")
    if not plan.feasible:
        heading += f" (ruled out: {plan.ruled_out})"
    memory = {m.board_id: m for m in plan.memory}
    links = {x.board_id: x for x in plan.links}
    rows = []
    for number, stage in enumerate(plan.stages, 1):
        layers = _layers(problem, stage.first_layer, stage.stop_layer)
        for i, (board, micro) in enumerate(zip(stage.boards, stage.micro_batch_sizes)):
            used = memory[board]
            rows.append((str(number) if i == 0 else "", layers if i == 0 else "", board, str(micro * M), str(micro),
                         f"{_bytes(used.used_bytes)} / {_bytes(used.limit_bytes)} ({used.used_bytes / used.limit_bytes:.0%})",
                         _bytes(links[board].up_bytes), _bytes(links[board].down_bytes)))
    widths = [max(len(r[c]) for r in [HEADER, *rows]) for c in range(len(HEADER))]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [HEADER, *rows])
    summary = (f"step {_seconds(plan.step_time_s)} (bubble {plan.bubble_fraction:.0%}), "
               f"{plan.global_batch / plan.step_time_s:.1f} samples/s; peak {plan.power_w:.1f} W; "
               f"energy {_si(plan.energy_per_step_j, 'J')} per step, {_si(plan.energy_per_epoch_j, 'J')} and "
               f"{format_duration(plan.epoch_time_s)} per epoch; EDP {_si(plan.edp_j_s, 'J*s')}")
    return f"{heading}\n{table}\n{summary}"


def _layers(problem: PipelineProblem, first: int, stop: int) -> str:
    names = problem.layers
    if stop - first == 1:
        return f"{first} {names[first].name}"
    return f"{first}-{stop - 1} {names[first].name}..{names[stop - 1].name}"


def _bytes(n: float) -> str:
    for factor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n:.0f} B"


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 10 else format_duration(s)


__all__ = ["render_plan", "render_result"]
