"""Searching pipeline plans: dynamic programming over layers x boards used, exhaustive search, greedy baselines.

**The dynamic programme** (after Asteroid and HeterPS; issue 35). Boards with identical figures are
one *kind* and interchangeable, so a set of boards is a vector of counts per kind (for a fleet of all
different boards, a subset). For each micro-batch count M and schedule, the programme builds plans
from the last layer backwards: its state is (j, u, r), the layers from j on already planned as r
stages on the boards counted by u. A step prepends a stage: layers [i, j) on a group g of the boards
not in u, giving (i, u + g, r + 1). Building backwards makes a stage's 1F1B activations known when it
is costed: it holds min(M, r + 1) micro-batches. Peak power depends on u alone, so ``max_power_w``
prunes states, and memory prunes stages.

The step time (``pipeline_cost``) sums the forward flow, the backwards and the cuts' transfers, adds
M - 1 more slots of the flow's slowest element and the longest group exchange; a cut's transfer
depends on the stages on both sides of it, and energy adds the boards' idle power over the step to
their summed busy energy. So a label holds the plan so far as figures (the flow's slowest element,
the serial sum, the longest exchange, busy energy, the stages' micro-batch fixed costs) and its first
stage's links per byte (which the cut in front of it needs), and a state keeps every label that no
other beats on all of them (a Pareto front): the step is monotone in each, so a dominated label
never ends in a better plan, and the programme is exact over its plan space. At the end (j = 0) each
label gives its plan's figures directly; ``max_later_group`` leaves out later groups larger than it.

Its plan space is the exhaustive search's (every split into contiguous stages, every ordered choice
of disjoint groups, every M and schedule); the tests check the two agree on small cases. When the
counts per kind would give more than :data:`MAX_PAIRS` (boards used, group added) pairs, boards whose
figures lie within a widening tolerance are merged into one kind (failing that, the boards sorted by
speed are cut into runs), costed once as its least capable member and once as its typical (median)
one; the few best plans of each are costed again on the real boards, the baselines join them, and the
best plan of each M and schedule is improved by local search on the real boards (``pipeline_improve``).
The result is then a heuristic, and says so in a note.

**Baselines**: an equal split of the layers over the fastest boards, one board per stage; plain data
parallelism, all layers on the k fastest boards; and, for models no board holds, the roomiest boards
packed with as many layers as fit in turn. Each picks its best M, schedule and size.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from edgefleet.coordinator.planning.pipeline_cost import (
    StageCost,
    StageCoster,
    boundary_s,
    evaluate_plan,
    in_flight,
    sources_s,
    step_figures,
)
from edgefleet.coordinator.planning.pipeline_improve import improve_plan
from edgefleet.coordinator.planning.pipeline_model import PipelineBoard, PipelinePlan, PipelineProblem, StageSpec

log = logging.getLogger(__name__)

MAX_PAIRS = 400            # (boards used, group added) pairs the programme may step through before merging kinds
MERGE_TOLERANCES = (0.05, 0.1, 0.25)   # relative: boards whose figures all agree this closely merge
RECOST_BEST = 8            # plans costed again on the real boards after merging kinds
RUNNER_SLACK = 0.5         # ranked_pipelines' runners-up: partial plans kept while they may end within 1.5x the best


@dataclass(frozen=True, slots=True)
class BoardKinds:
    """The boards as kinds: each kind's costing representative and its members' ids (fastest first)."""

    representatives: tuple[PipelineBoard, ...]
    members: tuple[tuple[str, ...], ...]
    exact: bool                            # every member of a kind has the representative's figures

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(m) for m in self.members)


@dataclass(slots=True)
class _Label:
    flow_s: float                             # the forward flow's slowest element: a stage's forward or a cut's
    serial_s: float                           # every element once: forwards, cuts both ways, backwards, intercept
    allreduce_s: float
    busy_j: float
    first: StageCost | None                   # this stage's figures (its links); None: the empty rest
    unit_s: float                             # the stages' micro-batch fixed costs, summed (stage 0's group adds to them)
    stage: tuple[int, int, tuple[int, ...]]   # first layer, stop layer, boards per kind
    rest: _Label | None                       # the plan of the layers after this stage
    key: tuple[float, ...] = ()               # what the front compares (smaller is better in each)


def search_pipeline(problem: PipelineProblem, objective: str = "edp", *,
                    max_pairs: int = MAX_PAIRS) -> tuple[PipelinePlan | None, tuple[str, ...]]:
    """The best feasible plan for ``objective`` (time, energy, edp; or power, the least peak draw), or None.

    ``max_pairs``: the programme's size before boards merge into kinds (:data:`MAX_PAIRS`; tests lower it).

    Returns:
        The plan (None when none fits) and notes (kinds merged to keep the search small).
    """
    starts, notes = _search(problem, objective, max_pairs, None)
    return min(starts.values(), key=lambda plan: plan.objective_value(objective), default=None), notes


def ranked_pipelines(problem: PipelineProblem, objective: str = "edp", *, limit: int = RECOST_BEST,
                     max_pairs: int = MAX_PAIRS) -> tuple[list[PipelinePlan], tuple[str, ...]]:
    """The best distinct feasible plans the search weighed, best first: :func:`search_pipeline`'s plan, then the
    runners-up (``plan --pipeline --verify`` pre-trains the first few).

    The runners-up are the complete plans of the programme's last Pareto fronts (up to :data:`RECOST_BEST` for each M
    and schedule), costed on the real boards: a plan worse than another of the same boards and stage count on every
    figure of the front's key is not among them, but the pipelines of the ``limit`` best are also costed at every
    other M. Two plans are one when they differ only by a cut moved across a
    layer without work or parameters (the same boards, M and schedule, the same step time), or, with one stage, only
    by M (data parallelism on the same boards: the best of them is kept).
    """
    runners: list[PipelinePlan] = []
    starts, notes = _search(problem, objective, max_pairs, runners)
    best = _distinct([*starts.values(), *runners], objective)[:limit]
    return _distinct([*best, *_other_micro_batches(problem, best)], objective)[:limit], notes


def _distinct(plans: Iterable[PipelinePlan], objective: str) -> list[PipelinePlan]:
    """``plans`` best first, one of each :func:`_sameness`."""
    ranked, seen = [], set()
    for plan in sorted(plans, key=lambda p: p.objective_value(objective)):
        key = _sameness(plan)
        if key not in seen:
            seen.add(key)
            ranked.append(plan)
    return ranked


def _other_micro_batches(problem: PipelineProblem, plans: Sequence[PipelinePlan]) -> list[PipelinePlan]:
    """The feasible twins of ``plans``' pipelines at every other M: the programme keeps a layout at an M only where it
    is on that M's front, and a layout beaten at M = 1 by another on the same boards can be what a fleet runs fastest
    at M = 1 all the same (the lab's case 6 of bench/pipeline_picks.py, run 10: its M = 2 twin was all the pre-training
    tried)."""
    known = {(p.specs, p.micro_batches, p.schedule) for p in plans}
    twins = []
    for plan in plans:
        if len(plan.stages) == 1:
            continue
        for m in problem.micro_batch_counts:
            if (plan.specs, m, plan.schedule) in known:
                continue
            known.add((plan.specs, m, plan.schedule))
            twin = evaluate_plan(problem, plan.specs, micro_batches=m, schedule=plan.schedule)
            if twin.feasible:
                twins.append(twin)
    return twins


def _sameness(plan: PipelinePlan) -> tuple[object, ...]:
    """What tells two plans apart when they are to be measured (:func:`ranked_pipelines`)."""
    boards = tuple(s.boards for s in plan.stages)
    if len(plan.stages) == 1:  # data parallelism: its micro-batches (and the split they round to) are no other plan
        return (boards,)
    return boards, plan.micro_batches, plan.schedule, round(plan.step_time_s, 9)


def _search(problem: PipelineProblem, objective: str, max_pairs: int, runners: list[PipelinePlan] | None
            ) -> tuple[dict[tuple[int, str, str], PipelinePlan], tuple[str, ...]]:
    """The best plan of each M, schedule and source (module doc), and the notes; ``runners``, if given, receives every
    other feasible plan of the programme's ranked lists, costed on the real boards."""
    kinds = board_kinds(problem.boards, max_pairs)
    notes: tuple[str, ...] = ()
    if not kinds.exact:
        notes = (f"{len(problem.boards)} boards searched as {len(kinds.members)} kinds of similar boards: the plan is "
                 "a heuristic, costed on the real boards",)
    coster = StageCoster(problem)
    starts: dict[tuple[int, str, str], PipelinePlan] = {}   # the best plan for each M, schedule and where it came from
    # merged kinds: costed as their least capable member (plans that fit), and as their typical one (plans that
    # may not fit every member, but find the shape a fleet of such boards wants)
    views = [kinds] if kinds.exact else [kinds, dataclasses.replace(kinds, representatives=tuple(
        _typical([problem.board(b) for b in members]) for members in kinds.members))]
    for micro_batches in problem.micro_batch_counts:
        for schedule in problem.schedules:
            for source, view in zip(("least capable", "typical"), views):
                ranked = _programme(problem, view, coster, micro_batches, schedule, objective,
                                    slack=0.0 if runners is None else RUNNER_SLACK)
                costed = 1 if kinds.exact and runners is None else RECOST_BEST
                for _, specs in ranked[:costed]:
                    plan = evaluate_plan(problem, specs, micro_batches=micro_batches, schedule=schedule)
                    _keep_better(starts, plan, objective, source)
                    if runners is not None and plan.feasible:
                        runners.append(plan)
    if not kinds.exact and objective != "power":  # a heuristic now: the baselines too, and local search from each
        for baseline in (equal_layers_baseline(problem, objective), data_parallel_baseline(problem, objective),
                         memory_packing_baseline(problem, objective)):
            if baseline is not None:
                _keep_better(starts, baseline, objective, "baseline")
        for (_, _, source), plan in list(starts.items()):  # local optima differ by start: climb from each
            _keep_better(starts, improve_plan(problem, plan, objective), objective, source)
    return starts, notes


def _keep_better(plans: dict[tuple[int, str, str], PipelinePlan], plan: PipelinePlan, objective: str,
                 source: str = "") -> None:
    """Keep ``plan`` as the best of its M, schedule and source if it is feasible and better than the one kept."""
    key = (plan.micro_batches, plan.schedule, source)
    if plan.feasible and (key not in plans or plan.objective_value(objective) < plans[key].objective_value(objective)):
        plans[key] = plan


def board_kinds(boards: Sequence[PipelineBoard], max_pairs: int = MAX_PAIRS) -> BoardKinds:
    """Boards as kinds: identical figures where the search allows, else merged within a widening tolerance, else
    the fastest, the next fastest, ... cut into as many runs as the search allows (each costed as its least capable)."""
    for tolerance in (0.0, *MERGE_TOLERANCES):
        buckets: dict[tuple[float, ...], list[PipelineBoard]] = {}
        for b in boards:
            buckets.setdefault(_bucket(b.kind, tolerance), []).append(b)
        if _pairs(len(g) for g in buckets.values()) <= max_pairs:
            break
    else:
        fastest = sorted(boards, key=lambda b: -b.speed)
        runs = max(k for k in range(1, len(fastest) + 1)
                   if k == 1 or _pairs(len(r) for r in _runs(fastest, k)) <= max_pairs)
        buckets = {(float(i),): run for i, run in enumerate(_runs(fastest, runs))}
        tolerance = math.inf
    kinds = [sorted(g, key=lambda b: -b.speed) for g in buckets.values()]
    reps = tuple(g[0] if tolerance == 0.0 else _least_capable(g) for g in kinds)
    return BoardKinds(reps, tuple(tuple(b.board_id for b in g) for g in kinds), tolerance == 0.0)


def _pairs(sizes: Iterable[int]) -> int:
    """(boards used, group added) pairs of kinds of these sizes: what the programme steps through per layer pair."""
    return math.prod((n + 1) * (n + 2) // 2 for n in sizes)


def _runs(boards: list[PipelineBoard], k: int) -> list[list[PipelineBoard]]:
    edges = [round(i * len(boards) / k) for i in range(k + 1)]
    return [boards[edges[i]:edges[i + 1]] for i in range(k)]


def _bucket(figures: tuple[float, ...], tolerance: float) -> tuple[float, ...]:
    if tolerance == 0.0:
        return figures
    return tuple(round(math.log(x) / math.log1p(tolerance)) if x > 0 else -math.inf for x in figures)


def _typical(group: list[PipelineBoard]) -> PipelineBoard:
    """A board with the median of each figure of ``group``."""
    figures = [statistics.median(values) for values in zip(*(b.kind for b in group))]
    speed, memory, up, down, active, idle, base, overhead = figures
    return PipelineBoard(board_id=group[0].board_id, speed=speed, memory_limit_bytes=int(memory), link_up_bytes_per_s=up,
                         link_down_bytes_per_s=down, active_power_w=max(active, idle), idle_power_w=idle,
                         base_memory_bytes=int(base), overhead_s=overhead)


def _least_capable(group: list[PipelineBoard]) -> PipelineBoard:
    return PipelineBoard(board_id=group[0].board_id, speed=min(b.speed for b in group),
                         memory_limit_bytes=min(b.memory_limit_bytes for b in group),
                         link_up_bytes_per_s=min(b.link_up_bytes_per_s for b in group),
                         link_down_bytes_per_s=min(b.link_down_bytes_per_s for b in group),
                         active_power_w=max(b.active_power_w for b in group), idle_power_w=max(b.idle_power_w for b in group),
                         base_memory_bytes=max(b.base_memory_bytes for b in group),
                         overhead_s=max(b.overhead_s for b in group))


def _programme(problem: PipelineProblem, kinds: BoardKinds, coster: StageCoster, micro_batches: int, schedule: str,
               objective: str, *, slack: float = 0.0) -> list[tuple[float, tuple[StageSpec, ...]]]:
    """The dynamic programme for one M and schedule: its best complete plans, best first, with their objective.

    A vector of board counts is coded as one mixed-radix integer, so that adding a group is an addition.

    **Bounding.** Every figure of a label only grows as stages are prepended (the serial sum, the flow's and the
    exchanges' maxima, busy energy, the boards used and so their power), so a partial plan's objective, computed as if
    it were complete, is a lower bound on every plan it can end in. A label whose bound exceeds the best complete plan
    found so far (times ``1 + slack``, which keeps runners-up) is dropped: the best plan is never among them, and the
    fronts stay small enough for later groups (their labels differ in more figures).
    """
    L, counts, reps = len(problem.layers), kinds.counts, kinds.representatives
    per_micro = problem.global_batch // micro_batches
    radix = list(itertools.accumulate((c + 1 for c in counts[:-1]), operator.mul, initial=1))
    vectors = {sum(x * r for x, r in zip(v, radix)): v for v in itertools.product(*(range(c + 1) for c in counts))}
    full = max(vectors)
    active = [r.active_power_w for r in reps]
    idle = [r.idle_power_w for r in reps]
    allowed = {code: _power_ok(problem, v, counts, active, idle) for code, v in vectors.items()}
    within: dict[int, list[int]] = {}   # the groups that fit in what is left, by what is left
    limit = problem.max_later_group
    timed, energy = objective != "power", objective in ("energy", "edp")
    fronts: list[dict[tuple[int, int], list[_Label]]] = [{} for _ in range(L + 1)]
    fronts[L][(0, 0)] = [_Label(0.0, 0.0, 0.0, 0.0, None, 0.0, (L, L, ()), None)]
    cache: dict[tuple[int, int, int, int], StageCost | None] = {}
    powers = {code: (sum(u * w for u, w in zip(v, active)), sum(u * w for u, w in zip(v, idle)))
              for code, v in vectors.items()}

    def value_of(label: _Label, used: int) -> float:
        step = label.serial_s + (micro_batches - 1) * label.flow_s + label.allreduce_s
        f = step_figures(problem, step_s=step, busy_j=label.busy_j, active_w=powers[used][0], idle_w=powers[used][1])
        return {"time": f.epoch_time_s, "energy": f.energy_per_epoch_j, "edp": f.edp_j_s, "power": f.power_w}[objective]

    best = math.inf  # the best complete plan's objective so far
    for j in range(L, 0, -1):
        for (used, r), front in fronts[j].items():
            flight = in_flight(schedule, micro_batches, r + 1, 0)
            left = full - used
            if left not in within:
                within[left] = [code for code, v in vectors.items() if 0 < sum(v) <= per_micro
                                and all(x <= y for x, y in zip(v, vectors[left]))]
            for g in within[left]:
                if not allowed[used + g]:
                    continue
                for i in range(j - 1, -1, -1):
                    if i and limit is not None and sum(vectors[g]) > limit:
                        continue  # a later stage's group larger than the problem allows
                    key = (i, j, g, flight)
                    if key not in cache:
                        boards = [reps[k] for k, x in enumerate(vectors[g]) for _ in range(x)]
                        costed = coster.cost(i, j, boards, micro_batches, flight)
                        cache[key] = costed if costed.fits else None
                    cost = cache[key]
                    if cost is None:
                        continue
                    target = fronts[i].setdefault((used + g, r + 1), [])
                    act = problem.layers[j - 1].activation_bytes_per_sample
                    for label in front:
                        new = _prepend(label, cost, (i, j, vectors[g]), act, micro_batches)
                        value = value_of(new, used + g)
                        if value > best * (1 + slack) * (1 + 1e-12):
                            continue  # no plan it ends in can be the best (bounding, above)
                        if i == 0:
                            best = min(best, value)  # a complete plan
                        new.key = (*((new.flow_s, new.serial_s, new.allreduce_s, cost.up_s_per_byte,
                                      cost.down_s_per_byte, new.unit_s) if timed else ()),
                                   *((new.busy_j,) if energy else ()))
                        _insert(target, new)
    ranked = [(value_of(label, used), label) for (used, _), front in fronts[0].items() for label in front]
    ranked.sort(key=lambda item: item[0])
    return [(value, _specs(label, kinds)) for value, label in ranked[:RECOST_BEST]]


def _power_ok(problem: PipelineProblem, used: tuple[int, ...], counts: tuple[int, ...], active: list[float],
              idle: list[float]) -> bool:
    if problem.max_power_w is None:
        return True
    power = sum(u * w for u, w in zip(used, active))
    if problem.count_idle:
        power += sum((c - u) * w for u, c, w in zip(used, counts, idle))
    return power <= problem.max_power_w * (1 + 1e-9)


def _prepend(label: _Label, cost: StageCost, stage: tuple[int, int, tuple[int, ...]], act_bytes: int,
             micro_batches: int) -> _Label:
    """The plan of ``label`` with the stage ``stage`` (costed ``cost``) in front of it (``pipeline_cost.step_time_s``
    term by term: the new stage's forward and backward, the cut between it and the label's first stage, stage 0's
    intercept)."""
    busy, allreduce = label.busy_j + cost.busy_j, max(label.allreduce_s, cost.allreduce_s)
    units = label.unit_s + cost.unit_s
    if label.first is None:  # the last stage; alone, a one-stage plan
        whole = stage[0] == 0
        return _Label(0.0 if whole else cost.forward_s, cost.whole_s if whole else cost.forward_s + cost.backward_s,
                      allreduce, busy, cost, units, stage, label)
    forward, back = boundary_s(cost, label.first, act_bytes, micro_batches)
    serial = label.serial_s + cost.forward_s + forward + cost.backward_s + back
    if stage[0] == 0:  # stage 0: its intercept, and its boards' micro-batches at every later stage
        serial += cost.intercept_s + sources_s(cost, label.unit_s, micro_batches)
    return _Label(max(label.flow_s, cost.forward_s, forward), serial, allreduce, busy, cost, units, stage, label)


def _insert(front: list[_Label], new: _Label) -> None:
    """Add ``new`` to a Pareto front unless a label there is at least as good on every figure of its key."""
    for old in front:
        if all(o <= n for o, n in zip(old.key, new.key)):
            return
    front[:] = [old for old in front if not all(n <= o for n, o in zip(new.key, old.key))]
    front.append(new)


def _specs(label: _Label, kinds: BoardKinds) -> tuple[StageSpec, ...]:
    """The plan a label ends: its stages front to back, each kind's members handed out in order."""
    taken = [0] * len(kinds.members)
    specs = []
    node: _Label | None = label
    while node is not None and node.rest is not None:
        first, stop, g = node.stage
        boards: list[str] = []
        for k, x in enumerate(g):
            boards += kinds.members[k][taken[k]:taken[k] + x]
            taken[k] += x
        specs.append(StageSpec(first, stop, tuple(boards)))
        node = node.rest
    return tuple(specs)


def exhaustive_search(problem: PipelineProblem, objective: str = "edp") -> PipelinePlan | None:
    """The best feasible plan by costing every plan (small problems only: it grows as (S + 1)^boards)."""
    best = None
    for plan in _every_plan(problem):
        if plan.feasible and (best is None or plan.objective_value(objective) < best.objective_value(objective)):
            best = plan
    return best


def _every_plan(problem: PipelineProblem) -> Iterator[PipelinePlan]:
    L, ids = len(problem.layers), [b.board_id for b in problem.boards]
    for S in range(1, min(L, len(ids)) + 1):
        for cuts in itertools.combinations(range(1, L), S - 1):
            edges = (0, *cuts, L)
            for owner in itertools.product(range(S + 1), repeat=len(ids)):  # 0: left out, s: stage s
                if len(set(owner) - {0}) < S:
                    continue
                specs = tuple(StageSpec(edges[s], edges[s + 1], tuple(b for b, o in zip(ids, owner) if o == s + 1))
                              for s in range(S))
                for micro_batches in problem.micro_batch_counts:
                    for schedule in problem.schedules:
                        yield evaluate_plan(problem, specs, micro_batches=micro_batches, schedule=schedule)


def equal_layers_baseline(problem: PipelineProblem, objective: str = "edp") -> PipelinePlan | None:
    """Greedy: the layers split evenly in count over the S fastest boards, one board a stage; the best S, M, schedule."""
    L = len(problem.layers)
    fastest = [b.board_id for b in sorted(problem.boards, key=lambda b: -b.speed)]
    options = []
    for S in range(1, min(L, len(fastest)) + 1):
        edges = [round(s * L / S) for s in range(S + 1)]
        options.append(tuple(StageSpec(edges[s], edges[s + 1], (fastest[s],)) for s in range(S)))
    return _best_of(problem, options, objective)


def data_parallel_baseline(problem: PipelineProblem, objective: str = "edp") -> PipelinePlan | None:
    """Greedy: every layer on the k fastest boards (plain data parallelism, micro-batches as accumulation); the best k, M."""
    fastest = [b.board_id for b in sorted(problem.boards, key=lambda b: -b.speed)]
    options = [(StageSpec(0, len(problem.layers), tuple(fastest[:k])),) for k in range(1, len(fastest) + 1)]
    return _best_of(problem, options, objective)


def memory_packing_baseline(problem: PipelineProblem, objective: str = "edp") -> PipelinePlan | None:
    """Greedy for models no board holds: the roomiest board takes as many layers as fit, the next roomiest the
    next, one board a stage (activations of all M micro-batches counted, as GPipe holds them); the best M, schedule."""
    coster = StageCoster(problem)
    roomiest = sorted(problem.boards, key=lambda b: -(b.memory_limit_bytes - b.base_memory_bytes))
    L, options = len(problem.layers), []
    for micro_batches in problem.micro_batch_counts:
        specs, first = [], 0
        for board in roomiest:
            stop = first
            while stop < L and coster.cost(first, stop + 1, [board], micro_batches, micro_batches).fits:
                stop += 1
            if stop > first:
                specs.append(StageSpec(first, stop, (board.board_id,)))
                first = stop
            if first == L:
                options.append(tuple(specs))
                break
    return _best_of(problem, options, objective)


def _best_of(problem: PipelineProblem, options: Sequence[tuple[StageSpec, ...]], objective: str) -> PipelinePlan | None:
    best = None
    for specs in options:
        for micro_batches in problem.micro_batch_counts:
            for schedule in problem.schedules:
                plan = evaluate_plan(problem, specs, micro_batches=micro_batches, schedule=schedule)
                if plan.feasible and (best is None or plan.objective_value(objective) < best.objective_value(objective)):
                    best = plan
    return best


__all__ = ["MAX_PAIRS", "BoardKinds", "board_kinds", "data_parallel_baseline", "equal_layers_baseline",
           "exhaustive_search", "memory_packing_baseline", "ranked_pipelines", "search_pipeline"]
