"""Local search on a pipeline plan: the heuristic's finishing step when the search merged boards into kinds.

A merged kind is costed as its least capable member, so the programme's plan may put the wrong member
of a kind in a stage, or leave a better board out. Hill climbing on the real boards puts that right
where one change at a time can: swap two boards (either may be left out), move one board to another
stage or out of the plan, bring a left-out board in, move a cut by one layer, merge two neighbouring
stages, or split a stage with a left-out board taking either part; each is costed by
``pipeline_cost.evaluate_plan`` with the plan's own M and schedule, and the plan as it is with every
other M and schedule. The best feasible improvement is taken until none is left (at most
:data:`MAX_ROUNDS` rounds).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from edgefleet.coordinator.planning.pipeline_cost import evaluate_plan
from edgefleet.coordinator.planning.pipeline_model import PipelinePlan, PipelineProblem, StageSpec

log = logging.getLogger(__name__)

MAX_ROUNDS = 20

# A plan's choice in a form easy to change: per stage, its stop layer and its boards.
_Layout = tuple[tuple[int, tuple[str, ...]], ...]


def improve_plan(problem: PipelineProblem, plan: PipelinePlan, objective: str) -> PipelinePlan:
    """``plan`` or a better feasible plan one change at a time away from it (module doc)."""
    best = plan
    for _ in range(MAX_ROUNDS):
        layout = tuple((s.stop_layer, s.boards) for s in best.stages)
        better = best
        candidates = [evaluate_plan(problem, best.specs, micro_batches=m, schedule=schedule)
                      for m in problem.micro_batch_counts for schedule in problem.schedules]
        candidates += [evaluate_plan(problem, _specs(neighbour), micro_batches=best.micro_batches, schedule=best.schedule)
                       for neighbour in _neighbours(layout, [b.board_id for b in problem.boards])]
        for candidate in candidates:
            if candidate.feasible and candidate.objective_value(objective) < better.objective_value(objective) * (1 - 1e-12):
                better = candidate
        if better is best:
            break
        best = better
    return best


def _specs(layout: _Layout) -> tuple[StageSpec, ...]:
    starts = [0, *(stop for stop, _ in layout[:-1])]
    return tuple(StageSpec(start, stop, boards) for start, (stop, boards) in zip(starts, layout))


def _neighbours(layout: _Layout, every_board: list[str]) -> Iterator[_Layout]:
    stages = [list(boards) for _, boards in layout]
    stops = [stop for stop, _ in layout]
    where = {b: s for s, boards in enumerate(stages) for b in boards}
    out = [b for b in every_board if b not in where]

    def made(groups: list[list[str]], edges: list[int] | None = None) -> _Layout:
        return tuple(zip(edges or stops, (tuple(g) for g in groups)))

    for s, boards in enumerate(stages):
        for i, b in enumerate(boards):
            for t in range(len(stages)):               # move b to another stage, or out
                if t != s and len(boards) > 1:
                    groups = [list(g) for g in stages]
                    groups[s].pop(i)
                    groups[t].append(b)
                    yield made(groups)
            if len(boards) > 1:
                groups = [list(g) for g in stages]
                groups[s].pop(i)
                yield made(groups)
            for other in out:                          # swap b with a left-out board
                groups = [list(g) for g in stages]
                groups[s][i] = other
                yield made(groups)
            for t in range(s + 1, len(stages)):        # swap b with a board of a later stage
                for j in range(len(stages[t])):
                    groups = [list(g) for g in stages]
                    groups[s][i], groups[t][j] = groups[t][j], groups[s][i]
                    yield made(groups)
    for other in out:                                  # bring a left-out board in
        for t in range(len(stages)):
            groups = [list(g) for g in stages]
            groups[t].append(other)
            yield made(groups)
    for s in range(len(stops) - 1):                    # move a cut by one layer; merge two stages
        start = stops[s - 1] if s else 0
        for edge in (stops[s] - 1, stops[s] + 1):
            if start < edge < stops[s + 1]:
                yield made(stages, [*stops[:s], edge, *stops[s + 1:]])
        yield made([*stages[:s], stages[s] + stages[s + 1], *stages[s + 2:]], [*stops[:s], *stops[s + 1:]])
    for s, boards in enumerate(stages):                # split a stage, a left-out board taking either part
        start = stops[s - 1] if s else 0
        for edge in range(start + 1, stops[s]):
            for other in out:
                edges = [*stops[:s], edge, *stops[s:]]
                yield made([*stages[:s], boards, [other], *stages[s + 1:]], edges)
                yield made([*stages[:s], [other], boards, *stages[s + 1:]], edges)


__all__ = ["MAX_ROUNDS", "improve_plan"]
