"""``plan --pipeline``: the pipeline planner (``planning.pipeline_planner``) over a profile file's boards.

The same profile, variants and fleet check as a data-parallel plan (``planning.plan_job``), then for
every selected variant and every global batch asked for, the best pipeline plan for the objective
(``planning.pipeline_model.problem_from_fleet`` turns the profile's per-layer figures into the
planner's problem). The best over them is chosen; when none fits, the line of the variant and
batch that came closest says what would (more boards, other micro-batches, a smaller variant).

Plans GPipe (what ``train --pipeline`` runs), a later stage on one board or a group; the chosen plan comes with the
``train`` flags that run it (``planning.pipeline_train``), or the reason train cannot yet.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.planning.pipeline_model import TRAINED_SCHEDULES, PipelineProblem, problem_from_fleet
from edgefleet.coordinator.planning.pipeline_planner import PipelineResult, plan_pipeline
from edgefleet.coordinator.planning.pipeline_train import train_flags
from edgefleet.coordinator.planning.plan_fleet import FleetCheck, restrict_to
from edgefleet.coordinator.planning.plan_job import profiled_fleet
from edgefleet.protocol.errors import PlanError

if TYPE_CHECKING:
    from edgefleet.coordinator.planning.plan_job import PlanRequest
    from edgefleet.coordinator.planning.profiles import ProfileMeta
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineOption:
    """One variant at one global batch, planned."""

    variant_label: str
    variant: dict[str, Any]          # its model options (the profile's variant)
    global_batch: int
    problem: PipelineProblem
    result: PipelineResult
    notes: tuple[str, ...] = ()  # what the profile lacked and what stood in for it


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineOutcome:
    """The chosen option (the best feasible one, else the first planned, whose ``no_fit`` says what would)."""

    chosen: PipelineOption
    options: tuple[PipelineOption, ...]
    check: FleetCheck
    meta: ProfileMeta | None = None   # the profile's job (what ``--verify`` pre-trains unless told otherwise)
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.chosen.result.plan is not None


def plan_pipeline_job(request: PlanRequest, *, profile_path: Path, model: str | None = None,
                      variants: list[dict[str, Any]] | None = None, dataset: str | None = None,
                      dataset_options: dict[str, Any] | None = None,
                      broker: BrokerSettings | None = None, boards: Sequence[str] = ()) -> PipelineOutcome:
    """Plan pipeline stages for the job over the profile file's boards that can take part now (``boards``: these only).

    Raises:
        PlanError: the profile does not fit the job or the fleet, or holds no cut of the model.
        BrokerError: the broker cannot be reached.
    """
    selected, meta, check, notes = profiled_fleet(profile_path, model=model, variants=variants, dataset=dataset,
                                               dataset_options=dataset_options, broker=broker, boards=boards)
    options = []
    for label, fleet in restrict_to(selected, check).items():
        for global_batch in request.global_batches:
            # the layers' shares from every profiled board (figures of the model, the more boards the surer), then
            # the boards that can take part: the same layers whichever boards are online or named
            problem, lacking = problem_from_fleet(selected[label], global_batch=global_batch,
                                                  max_memory_fraction=request.max_memory_fraction,
                                                  max_power_w=request.max_power_w, count_idle=request.count_idle)
            problem = replace(problem, boards=tuple(b for b in problem.boards if b.board_id in fleet.boards),
                              schedules=TRAINED_SCHEDULES)
            options.append(PipelineOption(variant_label=label, variant=dict(fleet.variant), global_batch=global_batch,
                                          problem=problem,
                                          result=plan_pipeline(problem, request.objective), notes=lacking))
    if not options:
        raise PlanError("no variant and global batch to plan a pipeline for: give --batch and a profiled variant")
    fitting = [o for o in options if o.result.plan is not None]
    chosen = (min(fitting, key=lambda o: o.result.require().objective_value(request.objective)) if fitting
              else options[-1])  # the largest batch of the last variant: its line says what would fit
    return PipelineOutcome(chosen=chosen, options=tuple(options), check=check, meta=meta, notes=tuple(notes))


def pipeline_json(outcome: PipelineOutcome, objective: str) -> dict[str, Any]:
    """The outcome for ``plan --pipeline --json``."""
    option, plan = outcome.chosen, outcome.chosen.result.plan
    doc: dict[str, Any] = {"objective": objective, "variant": option.variant_label, "global_batch": option.global_batch,
                           "fits": plan is not None, "no_fit": option.result.no_fit or None,
                           "notes": [*outcome.notes, *option.notes, *option.result.notes],
                           "boards": list(outcome.check.boards)}
    if plan is None:
        return doc
    layers = option.problem.layers
    doc.update({
        "micro_batches": plan.micro_batches, "schedule": plan.schedule, "step_time_s": plan.step_time_s,
        "bubble_fraction": plan.bubble_fraction, "power_w": plan.power_w, "energy_per_step_j": plan.energy_per_step_j,
        "epoch_time_s": plan.epoch_time_s, "energy_per_epoch_j": plan.energy_per_epoch_j, "edp_j_s": plan.edp_j_s,
        "stages": [{"layers": [layers[i].name for i in range(s.first_layer, s.stop_layer)], "boards": list(s.boards),
                    "micro_batch_sizes": list(s.micro_batch_sizes)} for s in plan.stages],
        "memory": {m.board_id: {"used_bytes": m.used_bytes, "limit_bytes": m.limit_bytes} for m in plan.memory},
        "links": {x.board_id: {"up_bytes": x.up_bytes, "down_bytes": x.down_bytes} for x in plan.links},
    })
    flags = train_flags(option.problem, plan)
    doc["train_flags"] = list(flags.flags) if flags.flags else None
    doc["train_why_not"] = flags.why_not or None
    return doc


__all__ = ["PipelineOption", "PipelineOutcome", "pipeline_json", "plan_pipeline_job"]
