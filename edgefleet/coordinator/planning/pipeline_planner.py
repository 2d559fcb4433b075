"""The pipeline planner's entry point: the best plan, or one line saying why none fits and what would.

``plan`` (issue 35, "Memory is a constraint"): a plan never exceeds a board's memory limit; when no
plan fits, the planner names the first change that works, in the order a user would rather make it:
a layer that fits no board even alone leaves only a smaller variant; else a higher ``--max-power``
(when the cap is what rules every plan out), another number of micro-batches under the problem's own
schedules (it changes neither the model nor the batch; ``plan --pipeline`` plans GPipe only, what
train runs); else more boards or a smaller variant. Each suggestion but the last is checked by
planning again, not guessed. A smaller global batch is never the answer: it would change what is
trained.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from edgefleet.coordinator.planning.objectives import OBJECTIVES
from edgefleet.coordinator.planning.pipeline_model import TRAINED_SCHEDULES, PipelinePlan, PipelineProblem
from edgefleet.coordinator.planning.pipeline_search import search_pipeline
from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)

SMALLER_VARIANT = "choose a smaller variant of the model (fewer or narrower layers)"


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineResult:
    """What :func:`plan_pipeline` found."""

    objective: str
    plan: PipelinePlan | None
    no_fit: str = ""                 # when plan is None: one line, why none fits and what would
    notes: tuple[str, ...] = ()      # how the search went (kinds merged)

    def require(self) -> PipelinePlan:
        """The plan.

        Raises:
            PlanError: none fits; the message is :attr:`no_fit`.
        """
        if self.plan is None:
            raise PlanError(self.no_fit)
        return self.plan


def plan_pipeline(problem: PipelineProblem, objective: str = "edp") -> PipelineResult:
    """The best pipeline plan for ``objective`` (time, energy or edp per epoch) under memory and power limits.

    Raises:
        PlanError: an unknown objective.
    """
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    plan, notes = search_pipeline(problem, objective)
    if plan is None:
        return PipelineResult(objective=objective, plan=None, no_fit=explain_no_fit(problem), notes=notes)
    log.debug("pipeline plan: %d stages, M=%d, %s", len(plan.stages), plan.micro_batches, plan.schedule)
    return PipelineResult(objective=objective, plan=plan, notes=notes)


def explain_no_fit(problem: PipelineProblem) -> str:
    """One line: why no plan of ``problem`` fits, and the first change (in the module doc's order) that would fit."""
    head = f"no pipeline plan fits {len(problem.boards)} boards at global batch {problem.global_batch}"
    reason = _layer_too_big(problem)
    if reason:
        return f"{head}: {reason}; {SMALLER_VARIANT}"
    every_m = tuple(m for m in range(1, problem.global_batch + 1) if problem.global_batch % m == 0)
    # The problem's own schedules only: plan --pipeline plans what train runs (GPipe), and a line that answered
    # "1F1B would fit" would name a plan train refuses.
    wider = dataclasses.replace(problem, micro_batches=every_m)
    if problem.max_power_w is not None:
        unpowered, _ = search_pipeline(dataclasses.replace(wider, max_power_w=None), "power")
        if unpowered is not None:
            return (f"no pipeline plan draws at most --max-power {problem.max_power_w:g} W: the least-drawing plan "
                    f"that fits draws {unpowered.power_w:.1f} W on {_boards(unpowered)}; raise --max-power to "
                    f"{math.ceil(unpowered.power_w)} W or add boards that draw less")
    other, _ = search_pipeline(wider, "time")
    if other is not None:
        tried = problem.micro_batch_counts
        more = "more" if other.micro_batches > max(tried) else "fewer" if other.micro_batches < min(tried) else "other"
        untrained = f" under {other.schedule}, which train does not run" if other.schedule not in TRAINED_SCHEDULES else ""
        return (f"{head} with {_span(tried)} micro-batches and {'/'.join(problem.schedules)}: {more} micro-batches "
                f"would fit, {other.micro_batches} (--micro-batches {other.micro_batches}){untrained}")
    return f"{head}: {_shortfall(problem)}"


def _layer_too_big(problem: PipelineProblem) -> str:
    """Why some layer fits no board even alone, one sample a micro-batch, one micro-batch held ("" if each fits one)."""
    factor = 2 + problem.optimizer_bytes_per_param_byte
    for layer in problem.layers:
        need = [b.base_memory_bytes + layer.param_bytes * factor + layer.held_bytes_per_sample for b in problem.boards]
        if all(n > b.memory_limit_bytes for n, b in zip(need, problem.boards)):
            roomiest = max(problem.boards, key=lambda b: b.memory_limit_bytes - b.base_memory_bytes)
            return (f"layer {layer.name!r} alone needs ~{_mb(need[problem.boards.index(roomiest)])} on the roomiest "
                    f"board, {roomiest.board_id}, whose limit is {_mb(roomiest.memory_limit_bytes)}")
    return ""


def _shortfall(problem: PipelineProblem) -> str:
    """The fleet's memory against the least the model needs (states and one sample of activations per layer)."""
    factor = 2 + problem.optimizer_bytes_per_param_byte
    need = sum(layer.param_bytes * factor + layer.held_bytes_per_sample for layer in problem.layers)
    room = sum(max(b.memory_limit_bytes - b.base_memory_bytes, 0) for b in problem.boards)
    if need > room:
        return (f"the model needs at least {_mb(need)} (parameters, gradients, optimizer state) and the boards allow "
                f"{_mb(room)} in all; add boards with about {_mb(need - room)} more, or {SMALLER_VARIANT}")
    return (f"the layers do not fall on the boards in any way that fits (the boards allow {_mb(room)} in all, the "
            f"model needs at least {_mb(need)}); add boards, or {SMALLER_VARIANT}")


def _boards(plan: PipelinePlan) -> str:
    return ", ".join(b for s in plan.stages for b in s.boards)


def _span(values: tuple[int, ...]) -> str:
    return f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


__all__ = ["PipelineResult", "explain_no_fit", "plan_pipeline"]
