"""The ``train`` flags that run a pipeline plan (``plan --pipeline`` to ``train --pipeline``, issue 35).

A plan's stages are layer ranges on boards; ``train --pipeline`` names stage 0's boards, then each
later stage as ``CUT@BOARD``, the cut being the layer that ends the stage before (a planner layer is
named by the cut that ends it: ``planning.pipeline_model``). ``--batch`` is stage 0's boards' batches
(each its micro-batch size x M), ``--micro-batches`` M, and ``--stage-sync checkpoint`` because the
cost model charges a later stage of one board no gradient exchange. The runtime trains GPipe, and a
later stage's group by whole micro-batches where the cost model shares each micro-batch's rows out: a
plan with a later group is not run as planned yet, and :func:`train_flags` says so.
A plan of one stage is data parallelism: ``--boards`` and ``--batch``, no ``--pipeline``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from edgefleet.coordinator.planning.pipeline_model import PipelinePlan, PipelineProblem

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
    grouped = [k for k, stage in enumerate(plan.stages) if k > 0 and len(stage.boards) > 1]
    if grouped:
        boards = "+".join(plan.stages[grouped[0]].boards)
        return TrainFlags((), f"stage {grouped[0]} is a group of boards ({boards}) sharing each micro-batch's samples, "
                              "and train's later groups take whole micro-batches (docs/pipeline.md, Next)")
    if plan.schedule != "gpipe":
        return TrainFlags((), f"the plan's schedule is {plan.schedule}, and train runs GPipe only")
    first = plan.stages[0]
    if len(plan.stages) == 1:
        return _data_parallel(plan)
    batches = ",".join(str(m * plan.micro_batches) for m in first.micro_batch_sizes)
    return TrainFlags(("--pipeline", pipeline_text(problem, plan), "--batch", batches, "--micro-batches", str(plan.micro_batches),
                       "--stage-sync", "checkpoint"))


def pipeline_text(problem: PipelineProblem, plan: PipelinePlan) -> str:
    """``--pipeline`` for a plan of two or more stages: stage 0's boards, then ``CUT@BOARD`` for each later stage."""
    text = "+".join(plan.stages[0].boards)
    for before, stage in zip(plan.stages, plan.stages[1:]):
        text += f",{problem.layers[before.stop_layer - 1].name}@{stage.boards[0]}"
    return text


def _data_parallel(plan: PipelinePlan) -> TrainFlags:
    """A one-stage plan's flags: every layer on every board, each its whole share of the batch (under GPipe its M
    micro-batches cost what one does and hold as much, and train's data parallelism has none)."""
    first = plan.stages[0]
    batches = ",".join(str(m * plan.micro_batches) for m in first.micro_batch_sizes)
    return TrainFlags(("--boards", ",".join(first.boards), "--batch", batches))


__all__ = ["TrainFlags", "pipeline_text", "train_flags"]
