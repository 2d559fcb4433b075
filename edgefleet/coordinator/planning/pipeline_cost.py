"""The cost of one pipeline plan: step time, energy, EDP, each board's memory and link bytes (issue 35).

Notation: stages s = 0..S-1, stage s trains layers [i_s, j_s) on the boards of its group G_s; the
global batch B is split into M micro-batches of b = B / M samples; board k of G_s takes m_k samples
of each micro-batch (summing to b over G_s), so M * m_k per optimizer step. W is the model's work
per sample at speed 1 (1.0 for a profile's layers). Per stage:

* F_s, K_s = the layers' forward and backward seconds per sample on a board of speed 1 (w_s their
  sum); P_s their parameter bytes; h_s the bytes per sample they hold from forward to backward;
  x_s = the activation bytes per sample at the cut after the stage;
* u_k = :data:`MICRO_FIXED_SHARE` x overhead_k: a micro-batch's own fixed cost on board k, each way (its
  frames, the runtime's loop and hooks: framework work, which the board's whole-step intercept
  overhead_k measures; none for a one-stage plan, which sends none);
* f_s = max_k (m_k F_s / speed_k + u_k): a micro-batch's forward on the slowest board;
  k_s = max_k M (m_k K_s / speed_k + u_k): a step's backward (every micro-batch's at once);
* stage 0's group splits each micro-batch: the split minimises max_k o_k + m_k c_k over integers 1 <= m_k <= cap_k,
  with c_k = w_s / speed_k + (x in + x out) (1 / up_k + 1 / down_k) and cap_k the most samples board k's memory holds;
* a later stage's group of n boards takes whole micro-batches in turn (``protocol.stage_routes``: each of stage 0's
  boards' micro-batches goes to the board of the group that has run the fewest samples so far). Where n divides M,
  that deals each source's M equal micro-batches out round-robin, so every board of the group runs B / n samples in
  G M / n micro-batches whatever stage 0's split (G = |G_0|): the model prices it as m_k = b / n of every
  micro-batch and u_k / n of its fixed cost (the flow's per-micro-batch figures then hold on average over n
  micro-batches: each runs whole on one board while the others run theirs). A plan whose later group does not divide
  M, or b, is ruled out (``group``): the routes would not share the samples evenly, or b / n would not be whole;
* I = max_k overhead_k x share_0: stage 0's fixed cost per step, share_0 = :data:`INTERCEPT_FIXED` +
  (1 - INTERCEPT_FIXED) x P_0 / P (the fixed cost's part that goes with the parameters is the
  optimizer's step, on each stage's own; a later stage's runs while the stages before it work);
* a cut between stages s and s + 1 carries a micro-batch's activations forward in a_s = x_s max(max_k
  m_k / up_k over G_s, max_k m_k / down_k over G_s+1) (the slower end binds) and a step's gradients
  back in d_s = M x_s max(max m_k / up_k over G_s+1, max m_k / down_k over G_s), after the next
  stage's backward (the lab shows no overlap between them worth counting: docs/pipeline.md);
* allreduce_s = max_k P_s / up_k + max(max_k P_s / down_k, |G_s| P_s / L) for the first stage, even of
  one board: its gradients go up to the coordinator's exchange every step and the average comes back,
  as the data-parallel cost model charges them (L: the coordinator's link, when given); the same for
  a later group; for a later stage of one board, its parameters and optimizer state at every
  :data:`STATE_EVERY`-th step (``train --stage-sync checkpoint``: its gradient stays on the board
  between), amortised: P_s (2 + o) / STATE_EVERY / up_k.

A step as the runtime runs it (``agent.stage_runtime``): the forwards flow a micro-batch at a time
through the stages and the cuts, then the loss, then each stage's backward in turn from the last
(a stage's backward waits for all its output gradients), then stage 0's exchange:

* T = I + sum(flow) + (M - 1) max(flow) + sum_s k_s + sum_s d_s + G (M 2 sum_s>0 u_s) + max_s allreduce_s
  where flow = (f_0, a_0, f_1, a_1, ..., f_S-1) and G = |G_0| - 1:
  a later stage takes each of stage 0's boards' micro-batches apart (u_s: its slowest board's u);
* a one-stage plan (data parallelism): T = max_k (overhead_k + M m_k w / speed_k) + allreduce_0;
* bubble = (S - 1) / (M + S - 1)                                   [share of the pipeline a stage idles]
* memory_k = base_k + P_s * (2 + o) + h_s * m_k * f_s              [bytes] parameters, gradients, optimizer
  state (o bytes per parameter byte) and the activations of f_s micro-batches: f_s = M in GPipe (every
  forward before any backward), min(M, S - s + 1) in 1F1B (stage s holds one per stage after it; 1F1B
  is costed with GPipe's time: train runs GPipe only, and 1F1B stays an answer to memory);
* power = sum over the taking-part boards of their active power (+ the others' idle power, count_idle)
* energy per step = sum_k idle_k * T + sum_k (active_k - idle_k) * (o_k + M (m_k w_s + 2 u) / speed_k)
  (+ the others' idle power * T, count_idle): a board draws its active power while it computes;
* epoch time = T * D / B, energy per epoch = energy per step * D / B, EDP = their product (D: samples per epoch).

The two constants are fitted to the lab (``bench/pipeline_picks.py``; docs/pipeline.md, "The
model"). Assumptions: the groups' gradient exchanges run after the flush, in parallel with each other,
so the longest counts; a stage's micro-batches all take as long as its slowest board's; boards send
activations to each other directly (over their own links; the coordinator's link carries only the
groups' gradients); moving bytes draws idle power; a later stage of one board sends its state to the
coordinator's replica at checkpoints only (what ``plan --pipeline``'s train flags ask for), charged as
if every step carried its share.

A plan is ruled out, in this order, by ``group`` (a later stage has more boards than
``max_later_group``, or a later group's size does not divide M and b), ``batch`` (a group has more boards
than a micro-batch has samples), ``memory`` (some board's memory_k over its limit, the board named) and
``power`` (over ``max_power_w``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from edgefleet.coordinator.planning.pipeline_model import (
    SCHEDULES,
    BoardMemory,
    LinkLoad,
    PipelineBoard,
    PipelinePlan,
    PipelineProblem,
    Stage,
    StageSpec,
)
from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)

STATE_EVERY = 50  # a later stage's state steps (--checkpoint-every's default), amortised over the steps between
# Fitted on bench/pipeline_picks.py's lab runs (docs/pipeline.md, "The model"):
MICRO_FIXED_SHARE = 0.08  # a micro-batch's own fixed cost at a stage, each way (its frames, the loop, the hooks), as
#                           a share of the board's whole-step fixed cost (both are the framework's work on that board)
INTERCEPT_FIXED = 0.1     # stage 0's share of its boards' whole-step fixed cost whatever its layers; the rest of it
#                           goes with the share of the model's parameters the stage holds (the optimizer's step)


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's figures on a group of boards (module doc); the search sums and maxes these."""

    micro_batch_sizes: tuple[int, ...]   # per board; () when the group has more boards than samples, or a later
    #                                      group does not divide M and b (``group_divides``)
    forward_s: float                     # the slowest board's forward of one micro-batch, with its fixed cost
    backward_s: float                    # the slowest board's backward of a step's micro-batches
    whole_s: float                       # as a one-stage plan: the slowest board's fixed cost and step
    intercept_s: float                   # as stage 0 of a pipeline: its boards' fixed cost per step (the largest)
    unit_s: float                        # a micro-batch's own fixed cost one way, the group's largest (u_k)
    up_s_per_byte: float                 # max over the group of m_k / up_k: a micro-batch's per-sample byte time up
    down_s_per_byte: float               # the same down
    allreduce_s: float
    busy_j: float                        # (active - idle) x compute time, summed over the group, per step
    memory_bytes: tuple[int, ...]        # per board
    up_bytes: tuple[int, ...]            # per board, per step
    down_bytes: tuple[int, ...]
    over: int                            # the index in the group of the board most over its memory; -1 if none

    @property
    def fits(self) -> bool:
        return bool(self.micro_batch_sizes) and self.over < 0


def _no_split(n: int) -> StageCost:
    inf = math.inf
    return StageCost((), inf, inf, inf, inf, inf, inf, inf, inf, inf, (0,) * n, (0,) * n, (0,) * n, -1)


class StageCoster:
    """Costs stages of one problem: the layers' running sums, computed once."""

    def __init__(self, problem: PipelineProblem) -> None:
        self.problem = problem
        layers = problem.layers
        self.work = [0.0, *itertools.accumulate(layer.work_s_per_sample for layer in layers)]
        self.forward = [0.0, *itertools.accumulate(layer.forward_s_per_sample for layer in layers)]
        self.params = [0, *itertools.accumulate(layer.param_bytes for layer in layers)]
        self.held = [0, *itertools.accumulate(layer.held_bytes_per_sample for layer in layers)]
        self.state_factor = 2.0 + problem.optimizer_bytes_per_param_byte

    def intercept_share(self, first: int, stop: int) -> float:
        """The share of a board's whole-step fixed cost a stage of layers [first, stop) pays per step (module doc)."""
        if first > 0:
            return 0.0  # a later stage's loop and optimizer step run while the stages before it work or wait
        if stop == len(self.problem.layers) or not self.params[-1]:
            return 1.0
        return INTERCEPT_FIXED + (1 - INTERCEPT_FIXED) * self.params[stop] / self.params[-1]

    def cost(self, first: int, stop: int, boards: Sequence[PipelineBoard], micro_batches: int, in_flight: int) -> StageCost:
        """Layers [first, stop) on ``boards``, M = ``micro_batches``, holding ``in_flight`` micro-batches' activations."""
        layers, problem = self.problem.layers, self.problem
        b = problem.global_batch // micro_batches
        n = len(boards)
        later_group = first > 0 and n > 1  # whole micro-batches in turn, the same samples each (module doc)
        if n > b or (later_group and not group_divides(n, micro_batches, b)):
            return _no_split(n)
        work, params, held = self.work[stop] - self.work[first], self.params[stop] - self.params[first], \
            self.held[stop] - self.held[first]
        forward = self.forward[stop] - self.forward[first]
        x = (layers[first - 1].activation_bytes_per_sample if first > 0 else 0) + \
            (layers[stop - 1].activation_bytes_per_sample if stop < len(layers) else 0)
        per_sample = [work / k.speed + x * (1 / k.link_up_bytes_per_s + 1 / k.link_down_bytes_per_s) for k in boards]
        share = self.intercept_share(first, stop)
        overheads = [k.overhead_s * share for k in boards]
        static = [k.base_memory_bytes + params * self.state_factor for k in boards]
        caps = [b if held == 0 else max(0, min(b, math.floor((k.memory_limit_bytes - s) / (held * in_flight))))
                for k, s in zip(boards, static)]
        if later_group:
            split: list[int] | None = [b // n] * n if min(caps) >= b // n else None
        else:
            split = split_micro_batch(b, overheads, per_sample, caps)
        over = -1
        if split is None:  # memory cannot hold it: the split memory aside, to report how far over
            split = [b // n] * n if later_group else split_micro_batch(b, overheads, per_sample, [b] * n)
            assert split is not None
        memory = tuple(math.ceil(s + held * m * in_flight) for s, m in zip(static, split))
        excess = [(used - k.memory_limit_bytes) / k.memory_limit_bytes for used, k in zip(memory, boards)]
        if max(excess) > 0:
            over = max(range(n), key=excess.__getitem__)
        M = micro_batches
        # a micro-batch's own cost each way on each board, a share of its fixed cost (a one-stage plan sends no frames)
        share_u = 0.0 if first == 0 and stop == len(layers) else MICRO_FIXED_SHARE
        units = [share_u * k.overhead_s / (n if later_group else 1) for k in boards]  # a later group's: 1 in n each
        forward_s = max(m * forward / k.speed + u for k, m, u in zip(boards, split, units))
        backward_s = max(M * (m * (work - forward) / k.speed + u) for k, m, u in zip(boards, split, units))
        whole_s = max(o + M * m * work / k.speed for o, k, m in zip(overheads, boards, split))
        up = max(m / k.link_up_bytes_per_s for k, m in zip(boards, split))
        down = max(m / k.link_down_bytes_per_s for k, m in zip(boards, split))
        exchanged = n > 1 or first == 0  # stage 0 and any group: a gradient up and its average down, every step
        if exchanged:
            down_x = max(params / k.link_down_bytes_per_s for k in boards)
            if problem.coordinator_link_bytes_per_s:
                down_x = max(down_x, n * params / problem.coordinator_link_bytes_per_s)
            allreduce = max(params / k.link_up_bytes_per_s for k in boards) + down_x
        else:  # a later stage of one board: its state at checkpoints only
            allreduce = params * self.state_factor / STATE_EVERY / boards[0].link_up_bytes_per_s
        busy = sum((k.active_power_w - k.idle_power_w) * (o + M * (m * work / k.speed + 2 * u))
                   for o, k, m, u in zip(overheads, boards, split, units))
        state = 0 if exchanged else round(params * self.state_factor / STATE_EVERY)
        up_bytes = tuple(M * m * x + (params if exchanged else state) for m in split)
        down_bytes = tuple(M * m * x + (params if exchanged else 0) for m in split)
        unit = max(units)
        return StageCost(tuple(split), forward_s, backward_s, whole_s, max(overheads), unit, up, down, allreduce, busy,
                         memory, up_bytes, down_bytes, over)


def group_divides(boards: int, micro_batches: int, micro_batch: int) -> bool:
    """Whether a later stage's group of ``boards`` runs as the model prices it: M and a micro-batch's samples b both
    multiples of the group's size (module doc)."""
    return micro_batches % boards == 0 and micro_batch % boards == 0


def boundary_s(before: StageCost, after: StageCost, act_bytes: int, micro_batches: int) -> tuple[float, float]:
    """The cut between two neighbouring stages: (one micro-batch's activations forward, a step's gradients back).

    Each way the slower end binds: the sending boards' uplinks (each its own rows) or the receiving ones' downlinks.
    """
    forward = act_bytes * max(before.up_s_per_byte, after.down_s_per_byte)
    backward = micro_batches * act_bytes * max(after.up_s_per_byte, before.down_s_per_byte)
    return forward, backward


def sources_s(first: StageCost, later_unit_s: float, micro_batches: int) -> float:
    """What stage 0's group of G boards adds to the later stages' micro-batches' fixed costs: each later stage takes
    every board's micro-batches apart (G x M a step, both ways), where the stages' own figures count M."""
    return (len(first.micro_batch_sizes) - 1) * micro_batches * 2 * later_unit_s


def step_time_s(costs: Sequence[StageCost], act_bytes: Sequence[int], micro_batches: int) -> float:
    """A step of the stages ``costs`` in order (``act_bytes``: per sample at each cut), M = ``micro_batches``."""
    if len(costs) == 1:
        return costs[0].whole_s + costs[0].allreduce_s
    flow = [c.forward_s for c in costs]
    serial = costs[0].intercept_s + sum(c.backward_s for c in costs) + \
        sources_s(costs[0], sum(c.unit_s for c in costs[1:]), micro_batches)
    for before, after, x in zip(costs, costs[1:], act_bytes):
        forward, back = boundary_s(before, after, x, micro_batches)
        flow.append(forward)
        serial += back
    return sum(flow) + (micro_batches - 1) * max(flow) + serial + max(c.allreduce_s for c in costs)


def split_micro_batch(total: int, overhead_s: Sequence[float], per_sample_s: Sequence[float],
                      caps: Sequence[int]) -> list[int] | None:
    """Integers 1 <= m_k <= caps_k summing to ``total`` that minimise max_k overhead_k + per_sample_k * m_k.

    None when they cannot (a cap below 1, or the caps summing to less than ``total``). Filled from the
    continuous water level, then one sample at a time to the board that would finish first.
    """
    n = len(caps)
    if min(caps) < 1 or sum(caps) < total or n > total:
        return None
    rate = sum(1 / c for c in per_sample_s)
    level = (total + sum(o / c for o, c in zip(overhead_s, per_sample_s))) / rate
    m = [max(1, min(cap, math.floor((level - o) / c))) for o, c, cap in zip(overhead_s, per_sample_s, caps)]
    while sum(m) > total:  # the floor of the level can still overshoot where the 1-sample floor binds
        k = max((k for k in range(n) if m[k] > 1), key=lambda k: overhead_s[k] + per_sample_s[k] * m[k])
        m[k] -= 1
    heap = [(overhead_s[k] + per_sample_s[k] * (m[k] + 1), k) for k in range(n) if m[k] < caps[k]]
    heapq.heapify(heap)
    for _ in range(total - sum(m)):
        _, k = heapq.heappop(heap)
        m[k] += 1
        if m[k] < caps[k]:
            heapq.heappush(heap, (overhead_s[k] + per_sample_s[k] * (m[k] + 1), k))
    return m


def in_flight(schedule: str, micro_batches: int, stages: int, position: int) -> int:
    """Micro-batches whose activations stage ``position`` (0-based) of ``stages`` holds at once."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - position)


@dataclass(frozen=True, slots=True)
class StepFigures:
    """A plan's whole-step figures from its stages' maxima and sums (module doc)."""

    step_time_s: float
    power_w: float
    energy_per_step_j: float
    epoch_time_s: float
    energy_per_epoch_j: float
    edp_j_s: float


def step_figures(problem: PipelineProblem, *, step_s: float, busy_j: float, active_w: float,
                 idle_w: float) -> StepFigures:
    """The figures of a step of ``step_s`` seconds; ``active_w``/``idle_w``: the taking-part boards' summed power."""
    left_out = sum(b.idle_power_w for b in problem.boards) - idle_w if problem.count_idle else 0.0
    energy = (idle_w + left_out) * step_s + busy_j
    steps_per_epoch = problem.dataset_len / problem.global_batch
    epoch = step_s * steps_per_epoch
    energy_epoch = energy * steps_per_epoch
    return StepFigures(step_s, active_w + left_out, energy, epoch, energy_epoch, energy_epoch * epoch)


def cut_bytes(problem: PipelineProblem, specs: Sequence[StageSpec]) -> list[int]:
    """The activation bytes per sample at each cut between the stages ``specs``."""
    return [problem.layers[spec.stop_layer - 1].activation_bytes_per_sample for spec in specs[:-1]]


def evaluate_plan(problem: PipelineProblem, specs: Sequence[StageSpec], *, micro_batches: int,
                  schedule: str) -> PipelinePlan:
    """Cost the plan ``specs`` (its stages in order) with M = ``micro_batches`` under ``schedule``.

    Returns:
        The plan; ``constraint``/``ruled_out`` say what rules it out, if anything.

    Raises:
        PlanError: the specs are not a plan (layers not covered in order, a board twice or unknown, M not
            dividing the global batch, an unknown schedule).
    """
    _check_specs(problem, specs, micro_batches, schedule)
    coster = StageCoster(problem)
    S = len(specs)
    stages, costs = [], []
    for position, spec in enumerate(specs):
        boards = [problem.board(b) for b in spec.boards]
        flight = in_flight(schedule, micro_batches, S, position)
        cost = coster.cost(spec.first_layer, spec.stop_layer, boards, micro_batches, flight)
        costs.append((spec, boards, cost))
        stages.append(Stage(first_layer=spec.first_layer, stop_layer=spec.stop_layer, boards=spec.boards,
                            micro_batch_sizes=cost.micro_batch_sizes,
                            micro_batch_s=cost.forward_s + cost.backward_s / micro_batches,
                            allreduce_s=cost.allreduce_s, in_flight=flight))
    used = [k for _, boards, _ in costs for k in boards]
    step = step_time_s([c for _, _, c in costs], cut_bytes(problem, specs), micro_batches)
    figures = step_figures(problem, step_s=step, busy_j=sum(c.busy_j for _, _, c in costs),
                           active_w=sum(k.active_power_w for k in used), idle_w=sum(k.idle_power_w for k in used))
    memory = tuple(BoardMemory(board_id=k.board_id, used_bytes=m, limit_bytes=k.memory_limit_bytes)
                   for _, boards, c in costs for k, m in zip(boards, c.memory_bytes))
    links = tuple(LinkLoad(board_id=k.board_id, up_bytes=u, down_bytes=d)
                  for _, boards, c in costs for k, u, d in zip(boards, c.up_bytes, c.down_bytes))
    constraint, why = _ruled_out(problem, costs, micro_batches, figures.power_w)
    return PipelinePlan(stages=tuple(stages), micro_batches=micro_batches, schedule=schedule,
                        global_batch=problem.global_batch, step_time_s=figures.step_time_s,
                        bubble_fraction=(S - 1) / (micro_batches + S - 1), power_w=figures.power_w,
                        energy_per_step_j=figures.energy_per_step_j, epoch_time_s=figures.epoch_time_s,
                        energy_per_epoch_j=figures.energy_per_epoch_j, edp_j_s=figures.edp_j_s, memory=memory,
                        links=links, constraint=constraint, ruled_out=why)


def _ruled_out(problem: PipelineProblem, costs: list[tuple[StageSpec, list[PipelineBoard], StageCost]],
               micro_batches: int, power_w: float) -> tuple[str, str]:
    limit = problem.max_later_group
    for position, (spec, boards, _) in enumerate(costs):
        if position and limit is not None and len(boards) > limit:
            return "group", (f"stage {position} is a group of {len(boards)} boards ({'+'.join(spec.boards)}), over the "
                             f"{limit} a later stage may have")
        b = problem.global_batch // micro_batches
        if position and 1 < len(boards) <= b and not group_divides(len(boards), micro_batches, b):
            return "group", (f"stage {position}'s group of {len(boards)} boards ({'+'.join(spec.boards)}) takes whole "
                             f"micro-batches in turn, the same samples each: {micro_batches} micro-batches of {b} "
                             f"samples do not share out evenly (both must be multiples of {len(boards)})")
    for spec, boards, cost in costs:
        if not cost.micro_batch_sizes:
            return "batch", (f"stage of layers {spec.first_layer}..{spec.stop_layer - 1} has {len(boards)} boards but a "
                             f"micro-batch only {problem.global_batch // micro_batches} samples")
    for spec, boards, cost in costs:
        if cost.over >= 0:
            k, used = boards[cost.over], cost.memory_bytes[cost.over]
            return "memory", (f"{k.board_id} needs ~{used / 1e6:.0f} MB for layers {spec.first_layer}.."
                              f"{spec.stop_layer - 1}, over its limit of {k.memory_limit_bytes / 1e6:.0f} MB")
    if problem.max_power_w is not None and power_w > problem.max_power_w:
        return "power", f"draws {power_w:.1f} W, over --max-power {problem.max_power_w:g} W"
    return "", ""


def _check_specs(problem: PipelineProblem, specs: Sequence[StageSpec], micro_batches: int, schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if micro_batches < 1 or problem.global_batch % micro_batches:
        raise PlanError(f"{micro_batches} micro-batches do not divide the global batch {problem.global_batch}")
    edges = [(s.first_layer, s.stop_layer) for s in specs]
    if not specs or edges[0][0] != 0 or edges[-1][1] != len(problem.layers) or any(
            a >= b for a, b in edges) or any(edges[i][1] != edges[i + 1][0] for i in range(len(edges) - 1)):
        raise PlanError(f"stages {edges} do not cover layers 0..{len(problem.layers) - 1} in order without gaps")
    ids = [b for s in specs for b in s.boards]
    if any(not s.boards for s in specs) or len(set(ids)) != len(ids):
        raise PlanError(f"each stage needs boards of its own; got {[list(s.boards) for s in specs]}")
    for b in ids:
        problem.board(b)


__all__ = ["INTERCEPT_FIXED", "MICRO_FIXED_SHARE", "STATE_EVERY", "StageCost", "StageCoster",
           "StepFigures", "boundary_s", "cut_bytes", "evaluate_plan", "group_divides", "in_flight", "sources_s",
           "split_micro_batch", "step_figures", "step_time_s"]
