"""The ``train`` flags that run a pipeline plan (``plan --pipeline`` to ``train --pipeline``, issue 35).

A plan's stages are layer ranges on boards; ``train --pipeline`` names stage 0's boards, then each
later stage as ``CUT@BOARD``, the cut being the layer that ends the stage before (a planner layer is
named by the cut that ends it: ``planning.pipeline_model``), a later group as ``CUT@B1+B2``. ``--batch`` is
stage 0's boards' batches (each its micro-batch size x M), ``--micro-batches`` M, and ``--stage-sync checkpoint``
because the cost model charges a later stage of one board no gradient exchange (a later group's gradient travels
every step, as the model charges it). The runtime trains GPipe, which keeps any loss exact (1F1B would not:
docs/pipeline.md, "GPipe only"), and :func:`train_flags` says so of a 1F1B plan. A plan of one stage is data
parallelism: ``--boards`` and ``--batch``, no ``--pipeline``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from edgefleet.coordinator.planning.pipeline_model import TRAINED_SCHEDULES, PipelinePlan, PipelineProblem

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrainFlags:
    """``flags`` for ``train`` (empty when the plan cannot be trained yet, with ``why_not`` saying why)."""

    flags: tuple[str, ...]
    why_not: str = ""

    def line(self) -> str:
        """One line for ``plan``'s output."""
        if not self.flags:
            return f"train cannot run this plan yet: {self.why_not}"
        return "train it with: edge-coordinator train ... " + " ".join(self.flags)


def train_flags(problem: PipelineProblem, plan: PipelinePlan) -> TrainFlags:
    """The ``train`` flags that run ``plan`` as planned, or why none do yet."""
    if plan.schedule not in TRAINED_SCHEDULES:
        return TrainFlags((), f"the plan's schedule is {plan.schedule}, and train runs GPipe only (it keeps any loss "
                              "exact; docs/pipeline.md)")
    first = plan.stages[0]
    if len(plan.stages) == 1:
        return _data_parallel(plan)
    batches = ",".join(str(m * plan.micro_batches) for m in first.micro_batch_sizes)
    return TrainFlags(("--pipeline", pipeline_text(problem, plan), "--batch", batches, "--micro-batches", str(plan.micro_batches),
                       "--stage-sync", "checkpoint"))


def pipeline_text(problem: PipelineProblem, plan: PipelinePlan) -> str:
    """``--pipeline`` for a plan of two or more stages: stage 0's boards, then ``CUT@BOARD`` (or ``CUT@B1+B2``, a
    group) for each later stage."""
    text = "+".join(plan.stages[0].boards)
    for before, stage in zip(plan.stages, plan.stages[1:]):
        text += f",{problem.layers[before.stop_layer - 1].name}@{'+'.join(stage.boards)}"
    return text


def _data_parallel(plan: PipelinePlan) -> TrainFlags:
    """A one-stage plan's flags: every layer on every board, each its whole share of the batch (under GPipe its M
    micro-batches cost what one does and hold as much, and train's data parallelism has none)."""
    first = plan.stages[0]
    batches = ",".join(str(m * plan.micro_batches) for m in first.micro_batch_sizes)
    return TrainFlags(("--boards", ",".join(first.boards), "--batch", batches))


__all__ = ["TrainFlags", "pipeline_text", "train_flags"]
