"""The plans ``bench/pipeline_picks.py`` measures for one lab case: what train can run, and which of them to run.

No script but a script's part, free of the lab (tests load it by its file name): every plan ``train
--pipeline`` can run today over a case's boards is costed by the pipeline cost model
(``planning.pipeline_cost.evaluate_plan``): one stage (plain data-parallel, M = 1), or a stage-0
group followed by one or two later stages, each of one board or a group (every stage with parameters), cut at any of
the model's admissible cuts, GPipe, M in :data:`MICRO_BATCHES`. The cheapest by the model is the planner's pick among
them (what ``plan --pipeline`` chooses: it keeps to what train runs). The runs to measure are the pick and
the best plan of each other family (other boards, another M, another stage count), so
that a miss of the model shows as a measured plan beating the pick.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edgefleet.coordinator.planning.pipeline_cost import evaluate_plan
from edgefleet.coordinator.planning.pipeline_model import PipelinePlan, PipelineProblem, StageSpec

MICRO_BATCHES = (1, 2, 4)
MAX_RUNS = 5              # measured plans per case, the pick included


@dataclass(frozen=True)
class Candidate:
    """One plan train can run, with the model's figures for it."""

    stage0: tuple[str, ...]
    later: tuple[tuple[str, str], ...]   # (cut, boards) per later stage: "b1" or a group "b1+b2"
    micro_batches: int
    batch_sizes: tuple[int, ...]         # stage 0's boards' samples per step
    predicted_step_s: float

    @property
    def stages(self) -> int:
        return 1 + len(self.later)

    @property
    def shape(self) -> str:
        """The plan without its M: its boards and cuts."""
        return ",".join(["+".join(self.stage0), *(f"{c}@{b}" for c, b in self.later)])

    @property
    def label(self) -> str:
        return f"{self.shape} M={self.micro_batches}" if self.later else f"data-parallel {self.shape}"

    @property
    def boards(self) -> tuple[str, ...]:
        return (*self.stage0, *(b for _, group in self.later for b in group.split("+")))


def _subsets(boards: Sequence[str]) -> Iterator[tuple[str, ...]]:
    for size in range(1, len(boards) + 1):
        yield from itertools.combinations(boards, size)


def _later_groups(boards: Sequence[str], count: int) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every ordered choice of ``count`` disjoint groups of ``boards`` (each group's boards in the fleet's order)."""
    if count == 0:
        yield ()
        return
    for group in _subsets(boards):
        rest = [b for b in boards if b not in group]
        for others in _later_groups(rest, count - 1):
            yield (group, *others)


def _specs(problem: PipelineProblem, stage0: tuple[str, ...], later: tuple[tuple[str, ...], ...],
           stops: tuple[int, ...]) -> list[StageSpec]:
    edges = [0, *stops, len(problem.layers)]
    groups = [stage0, *later]
    return [StageSpec(edges[k], edges[k + 1], groups[k]) for k in range(len(groups))]


def trainable_plans(problem: PipelineProblem, *, max_stages: int = 3) -> list[Candidate]:
    """Every feasible plan train runs today over ``problem``'s boards (module doc), cheapest first."""
    names = [layer.name for layer in problem.layers]
    boards = [b.board_id for b in problem.boards]
    out: dict[tuple[object, ...], Candidate] = {}
    for stage0 in _subsets(boards):
        rest = [b for b in boards if b not in stage0]
        shapes: list[tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]] = [((), ())]
        for count in range(1, max_stages):
            for later in _later_groups(rest, count):
                shapes += [(later, stops) for stops in itertools.combinations(range(1, len(names)), count)]
        for later, stops in shapes:
            specs = _specs(problem, stage0, later, stops)
            if any(not any(layer.param_bytes for layer in problem.layers[s.first_layer:s.stop_layer]) for s in specs):
                continue  # a stage without parameters trains nothing: no board is given one
            for m in MICRO_BATCHES if later else (1,):
                if problem.global_batch % m:
                    continue
                plan = evaluate_plan(problem, specs, micro_batches=m, schedule="gpipe")
                if plan.feasible:  # a cut beside a layer without work or parameters costs the same: the first kept
                    out.setdefault((stage0, later, m, round(plan.step_time_s, 9)),
                                   _candidate(problem, plan, stage0, later, stops, names))
    return sorted(out.values(), key=lambda c: c.predicted_step_s)


def _candidate(problem: PipelineProblem, plan: PipelinePlan, stage0: tuple[str, ...],
               later: tuple[tuple[str, ...], ...], stops: tuple[int, ...], names: list[str]) -> Candidate:
    batches = tuple(m * plan.micro_batches for m in plan.stages[0].micro_batch_sizes)
    return Candidate(stage0=stage0, later=tuple((names[s - 1], "+".join(g)) for s, g in zip(stops, later)),
                     micro_batches=plan.micro_batches, batch_sizes=batches, predicted_step_s=plan.step_time_s)


def runs_to_measure(plans: Sequence[Candidate], *, limit: int = MAX_RUNS) -> list[Candidate]:
    """The pick (the cheapest), then the best plan on other boards or the same boards in another order, the pick's
    shape at another M, and the best of each other stage count, in that order, at most ``limit`` distinct plans.
    (A cut moved by a layer without work, e.g. a flatten, is no other plan: the runs would measure noise.)"""
    if not plans:
        return []
    pick = plans[0]
    wanted = [pick,
              next((c for c in plans if c.boards != pick.boards), None),
              next((c for c in plans if c.shape == pick.shape and c.micro_batches != pick.micro_batches), None),
              *(next((c for c in plans if c.stages == s), None) for s in (1, 2, 3) if s != pick.stages)]
    chosen: list[Candidate] = []
    for c in wanted:
        if c is not None and c not in chosen and len(chosen) < limit:
            chosen.append(c)
    return chosen


def candidate_of_flags(flags: list[str], predicted_step_s: float) -> Candidate:
    """The plan ``train`` flags run (``planning.pipeline_train``), as a :class:`Candidate`."""
    given = dict(zip(flags[::2], flags[1::2]))
    batches = tuple(int(b) for b in given["--batch"].split(","))
    if "--pipeline" not in given:
        return Candidate(stage0=tuple(given["--boards"].split(",")), later=(), micro_batches=1, batch_sizes=batches,
                         predicted_step_s=predicted_step_s)
    first, *later = given["--pipeline"].split(",")
    stages = tuple((cut, board) for cut, _, board in (item.partition("@") for item in later))
    return Candidate(stage0=tuple(first.split("+")), later=stages, micro_batches=int(given["--micro-batches"]),
                     batch_sizes=batches, predicted_step_s=predicted_step_s)


def same_plan(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates train alike (stage 0's boards in any order)."""
    return (sorted(a.stage0), a.later, a.micro_batches if a.later else 1) == (sorted(b.stage0), b.later,
                                                                             b.micro_batches if b.later else 1)


__all__ = ["MAX_RUNS", "MICRO_BATCHES", "Candidate", "candidate_of_flags", "runs_to_measure", "same_plan",
           "trainable_plans"]
