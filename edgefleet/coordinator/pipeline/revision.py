"""A pipeline revised around a board that slowed down for good (CEFT's run-time revision, issue 35).

A pipeline's step is as fast as its slowest stage. When a board slows (a Pi throttling under heat, a
co-tenant), :func:`revise` plans the run's boards again from what the run measured, not from the
profile taken before it:

* **The units.** The model's units (the layers between two admissible cuts, ``workloads.layer_timing``)
  timed on the coordinator: a line ``intercept + per_sample * n`` for each unit's forward and backward.
  They give the **shares** of a stage's work, not a board's speed.
* **Each board's speed.** A board's busy time in the steps since its slowdown (its own stage's forward
  and backward: the waits on its neighbours left out, ``agent.stage_runtime``) over the work its stage
  is at the units' figures plus a step's fixed work (:data:`FIXED_STEP_S`: Lightning's loop, the
  optimizer step, the exchange's round), a factor per board, the same for every unit it would run. The
  fixed work keeps a slowed board from looking free when it is left a single cheap layer.
* **The candidates.** The same boards in the same order with new cuts, stage 0's slices shared out by
  its boards' speeds (the global batch, and so every step's samples, stay the run's); and, for each
  slowed board of a later stage, the pipeline without it: a stage of one board leaves its layers to its
  neighbours, a group's board its micro-batches to the group's others.
* **Later groups.** A later stage's group runs the micro-batches ``protocol.stage_routes`` deals it (the
  fewest samples so far, from stage 0's slices), as train does: each of its boards is timed, and costed,
  on its own samples and micro-batches, and the stage takes as long as its slowest board. Dynamic programming over
  the units keeps, per stage and last unit, the Pareto front of (slowest stage, sum of stages): a GPipe
  step of M micro-batches takes about ``(sum + (M - 1) * slowest) / M``.
* **Stage 0's exchange.** Stage 0's boards send their stage's gradient to the coordinator every step
  (a later stage of one board at checkpoints only, with ``--stage-sync checkpoint``), over links whose
  speed the run does not measure. So stage 0 may gain at most :data:`STAGE0_GROWTH` of the model's
  parameter bytes over what it holds: a revision moves convolutions into it, not a dense head whose
  gradient would cross every stage-0 link every step (on fleet8 a re-plan without it moved conv_mlp's
  535 k-parameter layer there).
* **Memory is a constraint.** A board is given no stage whose parameters, gradients and two optimizer
  moments (4 x the parameters' bytes) and the activations its forward holds for its samples exceed what
  its present stage needs or :data:`MEMORY_SHARE` of its RAM, whichever is more.

The revision is taken only when it predicts a step at least ``min_gain`` shorter than the present plan
at the same speeds, and the time it saves over the steps left exceeds what the change costs
(``change_s``: the run stops at a whole step and goes on from it with the new plan, as after a lost
board). The caller switches at a step boundary, so no step is lost or trained twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgefleet.coordinator.pipeline.stage_plan import StagePlan
from edgefleet.coordinator.planning.cost_model import min_max_split
from edgefleet.protocol.profile_report import UnitReport
from edgefleet.protocol.stage_routes import stage_routes

log = logging.getLogger(__name__)

# A step's fixed work on the coordinator's scale: Lightning's loop, self.log, the optimizer step and the round take
# 6-8 ms of CPU at 0.12 of a core on a slow lab board (bench/step_fixed_costs.py), a few ms on a fast core.
FIXED_STEP_S = 0.003
STAGE0_GROWTH = 0.1   # stage 0 may gain this share of the model's parameter bytes (its gradient goes up every step)
MEMORY_SHARE = 0.5      # a revised stage may use up to this share of its board's RAM (or what its old stage needed)
OPTIMIZER_COPIES = 4    # parameters, gradients and two optimizer moments (Adam's): bytes = 4 x the parameters'


@dataclass(frozen=True)
class Revision:
    """The revised plan: its ``--pipeline`` text, boards and batch sizes (stage 0's slices, then 0 per later board),
    the step times it predicts now and after (s), and why, in words."""

    pipeline: str
    boards: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    current_s: float
    predicted_s: float
    why: str


@dataclass(frozen=True)
class _Option:
    slowest: float
    total: float
    ends: tuple[int, ...]  # the last unit of each stage so far


Groups = list[tuple[str, ...]]  # each later stage's boards, in stage order


def unit_ends(units: Sequence[UnitReport], cuts: Sequence[str]) -> list[int] | None:
    """The index of each stage's last unit under ``cuts`` (the last stage ends at the last unit); None when a cut is
    not the end of a unit (the units were timed on another cut of the model)."""
    names = [u.name for u in units]
    ends = []
    for cut in cuts:
        if cut not in names:
            return None
        ends.append(names.index(cut))
    if ends != sorted(set(ends)) or (ends and ends[-1] >= len(units) - 1):
        return None
    return [*ends, len(units) - 1]


def revise(plan: StagePlan, batch_sizes: Sequence[int], micro_batches: int, units: Sequence[UnitReport],
           busy_s: Mapping[str, float], *, slowed: Sequence[str], ram_bytes: Mapping[str, int] | None = None,
           min_gain: float = 0.15, steps_left: int | None = None, change_s: float = 0.0,
           fixed_s: float = FIXED_STEP_S) -> Revision | None:
    """The best revision of ``plan`` at the boards' measured speeds (module doc), or None when none gains enough.

    Args:
        plan: the pipeline in force.
        batch_sizes: stage 0's boards' slices first (their sum is the global batch).
        micro_batches: M.
        units: the model's units, in order (their names end the stages at ``plan.cuts``).
        busy_s: each board's busy time per step at the present plan (its recent median).
        slowed: the boards that slowed (a later one of them may be left out).
        ram_bytes: each board's RAM (0 or missing: its present stage's need is its limit).
        min_gain: the smallest fall of the predicted step time worth a change.
        steps_left: the run's steps after the change (None: unknown, no cost check).
        change_s: what the change costs, in seconds of the run.
        fixed_s: a step's fixed work on the units' scale (:data:`FIXED_STEP_S`).
    """
    measured = _measure(plan, batch_sizes, micro_batches, units, busy_s, ram_bytes, fixed_s, lost=())
    if measured is None:
        return None
    model, speeds, limits, ends = measured
    group, sizes, m = list(plan.boards[:plan.group]), model.sizes, model.m
    starts = [0, *(e + 1 for e in ends[:-1])]
    hosts = _later(plan)
    shares = _shares(model, sizes, hosts)
    assert shares is not None  # the plan in force: _measure checked its slices
    current = _gpipe([model.stage0(lo=0, hi=ends[0], group=group, speeds=speeds, sizes=sizes)[0],
                      *(_later_s(model, speeds, g, lo, hi, share)
                        for g, lo, hi, share in zip(hosts, starts[1:], ends[1:], shares))], m)
    candidates = [hosts, *(_without(hosts, {s}) for s in slowed if s in plan.boards[plan.group:])]
    best = _best_plan(model, plan, ends, group, candidates, speeds, limits, units)
    if best is None or (best.pipeline == plan.text() and best.batch_sizes[:plan.group] == tuple(sizes)):
        return None
    pays = steps_left is None or (current - best.predicted_s) * steps_left > change_s
    if best.predicted_s > current * (1 - min_gain) or not pays:
        log.debug("no revision: %.4f s a step predicted against %.4f s now (%s steps left)", best.predicted_s, current,
                  steps_left)
        return None
    return dataclasses.replace(best, current_s=current)


def replan_measured(plan: StagePlan, batch_sizes: Sequence[int], micro_batches: int, units: Sequence[UnitReport],
                    busy_s: Mapping[str, float], *, lost: Collection[str], ram_bytes: Mapping[str, int] | None = None,
                    fixed_s: float = FIXED_STEP_S) -> Revision | None:
    """The best plan of the boards ``plan`` has left after ``lost`` at their measured speeds (``busy_s``: theirs at
    ``plan``), its stages cut again rather than a lost stage merged into its neighbour (``pipeline.replan``); None when
    stage 0 has no board left, a board left has no busy time, or no plan fits their memory."""
    group = [b for b in plan.boards[:plan.group] if b not in lost]
    if not group:
        return None
    measured = _measure(plan, batch_sizes, micro_batches, units, busy_s, ram_bytes, fixed_s, lost=lost)
    if measured is None:
        return None
    model, speeds, limits, ends = measured
    best = _best_plan(model, plan, ends, group, [_without(_later(plan), set(lost))], speeds, limits, units, lost)
    if best is None:
        return None
    gone = ", ".join(sorted(set(lost) & set(plan.boards)))
    return dataclasses.replace(best, why=f"without {gone}, at the measured speeds: {best.why}")


def _measure(plan: StagePlan, batch_sizes: Sequence[int], micro_batches: int, units: Sequence[UnitReport],
             busy_s: Mapping[str, float], ram_bytes: Mapping[str, int] | None, fixed_s: float,
             lost: Collection[str]) -> tuple[_Costs, dict[str, float], dict[str, float], list[int]] | None:
    """The units' costs, each board's speed and memory limit under ``plan`` (the ``lost`` boards left out), and each
    stage's last unit; None when the units do not match the cuts or a board has no busy time."""
    ends = unit_ends(units, plan.cuts)
    if ends is None or any(b not in lost and not busy_s.get(b, 0.0) > 0 for b in plan.boards):
        return None
    sizes = [int(n) for n in batch_sizes[:plan.group]]
    model = _Costs(units, max(1, micro_batches), sum(sizes), sizes, fixed_s)
    shares = _shares(model, sizes, _later(plan))
    if shares is None:
        return None
    ram = dict(ram_bytes or {})
    speeds: dict[str, float] = {}
    limits: dict[str, float] = {}
    starts = [0, *(e + 1 for e in ends[:-1])]
    for k, (lo, hi) in enumerate(zip(starts, ends)):
        for i, b in enumerate(plan.stage_boards(k)):
            if b in lost:
                continue
            samples, micros = (sizes[i], None) if k == 0 else shares[k - 1][i]
            speeds[b] = busy_s[b] / model.work(lo, hi, samples, host=k > 0, micros=micros)
            limits[b] = max(model.memory(lo, hi, samples), MEMORY_SHARE * ram.get(b, 0))
    if not all(math.isfinite(v) for v in speeds.values()):
        return None
    return model, speeds, limits, ends


def _later(plan: StagePlan) -> Groups:
    """``plan``'s later stages' boards, in stage order."""
    return [plan.stage_boards(k) for k in range(1, len(plan.sizes))]


def _without(hosts: Groups, gone: set[str]) -> Groups:
    """``hosts`` without the boards ``gone``: a stage left with none is dropped (its layers to its neighbours)."""
    kept = [tuple(b for b in g if b not in gone) for g in hosts]
    return [g for g in kept if g]


def _shares(model: _Costs, split: Sequence[int], hosts: Groups) -> list[list[tuple[int, int | None]]] | None:
    """Each later stage's boards' (samples, micro-batches) a step as train routes them from stage 0's ``split``
    (``protocol.stage_routes``; a stage of one board: the global batch, every micro-batch, micro-batches None); None
    when a slice is empty or a group's board would get no micro-batch (plans train refuses)."""
    if min(split, default=0) < 1:
        return None
    if all(len(g) == 1 for g in hosts):
        return [[(model.total, None)] for _ in hosts]
    routes = stage_routes((len(split), *(len(g) for g in hosts)), split, model.m)
    shares: list[list[tuple[int, int | None]]] = [[(routes.rows_of(k, i), len(routes.units_of(k, i)))
                                                    for i in range(len(g))] for k, g in enumerate(hosts, start=1)]
    return None if any(rows < 1 for share in shares for rows, _ in share) else shares


def _later_s(model: _Costs, speeds: Mapping[str, float], boards: Sequence[str], lo: int, hi: int,
             share: Sequence[tuple[int, int | None]]) -> float:
    """A later stage's busy time a step over units lo..hi: its slowest board's, each on its own share."""
    return max(speeds[b] * model.work(lo, hi, rows, host=True, micros=micros) for b, (rows, micros) in zip(boards, share))


def _best_plan(model: _Costs, plan: StagePlan, ends: Sequence[int], group: list[str], candidates: Sequence[Groups],
               speeds: Mapping[str, float], limits: Mapping[str, float], units: Sequence[UnitReport],
               lost: Collection[str] = ()) -> Revision | None:
    """The fastest of the candidates' best cuts (each the later stages' boards, in order), or None; ``ends``:
    each stage's last unit under ``plan``."""
    stage0_params = model.params[ends[0] + 1] + STAGE0_GROWTH * model.params[-1]
    best: Revision | None = None
    for hosts in candidates:
        found = _best_cuts(model, group, hosts, speeds, limits, model.m, len(units), stage0_params)
        if found is None:
            continue
        step_s, ends_new, split = found
        if best is not None and step_s >= best.predicted_s - 1e-12:
            continue
        cuts = tuple(units[e].name for e in ends_new[:-1])
        later = tuple(b for g in hosts for b in g)
        text = StagePlan(boards=(*group, *later), cuts=cuts, group=len(group),
                         sizes=(len(group), *(len(g) for g in hosts))).text() if hosts else ""
        kept = {b for g in hosts for b in g}
        dropped = [b for b in plan.boards[plan.group:] if b not in kept and b not in lost]
        why = "".join(f"{b}'s {'layers to its neighbours' if len(g) == 1 else 'micro-batches to its group'}; "
                      for g in _later(plan) for b in g if b in dropped)
        why += f"cuts {','.join(cuts)}" if cuts else "data-parallel on stage 0's boards"
        if tuple(split) != tuple(model.sizes):
            why += f"; stage 0's slices {','.join(map(str, model.sizes))} -> {','.join(map(str, split))}"
        best = Revision(pipeline=text, boards=(*group, *later), batch_sizes=(*split, *(0,) * len(later)),
                        current_s=math.nan, predicted_s=step_s, why=why)
    return best


class _Costs:
    """The units' work (seconds on the coordinator) and memory for a run of them."""

    def __init__(self, units: Sequence[UnitReport], micro_batches: int, total: int, sizes: Sequence[int],
                 fixed_s: float) -> None:
        self.m, self.total, self.sizes, self.fixed_s = micro_batches, total, list(sizes), fixed_s
        self.intercept = np.concatenate([[0.0], np.cumsum([u.forward_intercept_s + u.backward_intercept_s for u in units])])
        self.per_sample = np.concatenate([[0.0], np.cumsum([u.forward_s_per_sample + u.backward_s_per_sample
                                                             for u in units])])
        self.params = np.concatenate([[0], np.cumsum([u.param_bytes for u in units])])
        self.held = np.concatenate([[0], np.cumsum([u.held_bytes_per_sample + u.activation_bytes_per_sample
                                                     for u in units])])
        self.host_micros = sum(min(micro_batches, n) for n in sizes)

    def work(self, lo: int, hi: int, samples: int, *, host: bool, micros: int | None = None) -> float:
        """A step's work (s at the units' pace) for units lo..hi over ``samples`` in ``micros`` micro-batches (None: a
        later stage's board takes every micro-batch, stage 0's board its M): the fixed work, then the units'."""
        if micros is None:
            micros = self.host_micros if host else min(self.m, max(samples, 1))
        return self.fixed_s + float(max(self.intercept[hi + 1] - self.intercept[lo], 0.0) * micros
                     + max(self.per_sample[hi + 1] - self.per_sample[lo], 0.0) * samples)

    def memory(self, lo: int, hi: int, samples: int) -> float:
        return float(OPTIMIZER_COPIES * (self.params[hi + 1] - self.params[lo]) + (self.held[hi + 1] - self.held[lo]) * samples)

    def stage0(self, *, lo: int, hi: int, group: Sequence[str], speeds: Mapping[str, float],
               sizes: Sequence[int] | None = None) -> tuple[float, list[int]]:
        """Stage 0's time on ``group`` over units lo..hi, and its slices (``sizes``, or shared out by speed)."""
        inter = float(self.intercept[hi + 1] - self.intercept[lo]) * self.m
        per = float(self.per_sample[hi + 1] - self.per_sample[lo])
        s = np.array([speeds[b] for b in group])
        if sizes is None:  # shared out by speed (the global batch stays the run's)
            if len(group) == 1:
                sizes = [self.total]
            elif per > 0 and self.total >= len(group):
                split = min_max_split(s * (self.fixed_s + inter), s * per, np.ones((1, len(group)), dtype=bool),
                                      np.full(len(group), self.total, dtype=np.int64), self.total)[0]
                sizes = [int(n) for n in split]
            else:
                share, extra = divmod(self.total, len(group))
                sizes = [share + (1 if i < extra else 0) for i in range(len(group))]
        sizes = list(sizes)
        return max(speeds[b] * self.work(lo, hi, n, host=False) for b, n in zip(group, sizes)), sizes


def _gpipe(stage_s: Sequence[float], micro_batches: int) -> float:
    """A GPipe step's time from its stages' busy times: the fill and drain, then the slowest stage's pace."""
    return (sum(stage_s) + (micro_batches - 1) * max(stage_s)) / micro_batches


def _best_cuts(model: _Costs, group: list[str], hosts: Groups, speeds: Mapping[str, float],
               limits: Mapping[str, float], m: int, n_units: int,
               stage0_params: float = math.inf) -> tuple[float, list[int], list[int]] | None:
    """The best ends of the stages on ``group`` then ``hosts`` (in order): the predicted step, the ends, stage 0's
    slices; None when no cut fits every board's memory.

    A later group's share of the samples follows stage 0's slices (``_shares``), so the fronts are kept per stage 0's
    end as well as per stage's end."""
    stages = 1 + len(hosts)
    if n_units < stages:
        return None
    fronts: dict[tuple[int, int], list[_Option]] = {}   # (this stage's last unit, stage 0's) -> options
    splits: dict[int, list[int]] = {}
    shares: dict[int, list[list[tuple[int, int | None]]]] = {}
    for end in range(n_units - stages + 1):  # stage 0: units 0..end
        if not 0 < model.params[end + 1] <= stage0_params:  # a parameter (it sends the gradients back), few more
            continue
        t0, split = model.stage0(lo=0, hi=end, group=group, speeds=speeds)
        routed = _shares(model, split, hosts)
        if routed is None or any(model.memory(0, end, n) > limits[b] for b, n in zip(group, split)):
            continue
        fronts[(end, end)] = [_Option(t0, t0, (end,))]
        splits[end], shares[end] = split, routed
    for k, boards in enumerate(hosts, start=1):
        last = k == stages - 1
        nxt: dict[tuple[int, int], list[_Option]] = {}
        for (end, root), options in fronts.items():
            share = shares[root][k - 1]
            for new_end in ([n_units - 1] if last else range(end + 1, n_units - (stages - k) + 1)):
                if any(model.memory(end + 1, new_end, rows) > limits[b] for b, (rows, _) in zip(boards, share)):
                    continue
                t = _later_s(model, speeds, boards, end + 1, new_end, share)
                for o in options:
                    nxt.setdefault((new_end, root), []).append(_Option(max(o.slowest, t), o.total + t,
                                                                       (*o.ends, new_end)))
        fronts = {key: _pareto(opts) for key, opts in nxt.items()}
    finals = [o for (e, _), opts in fronts.items() if e == n_units - 1 for o in opts]
    if not finals:
        return None
    best = min(finals, key=lambda o: ((o.total + (m - 1) * o.slowest) / m, o.ends))
    return (best.total + (m - 1) * best.slowest) / m, list(best.ends), splits[best.ends[0]]


def _pareto(options: list[_Option]) -> list[_Option]:
    """The options no other beats on both the slowest stage and the sum."""
    options.sort(key=lambda o: (o.slowest, o.total, o.ends))
    kept: list[_Option] = []
    for o in options:
        if not kept or o.total < kept[-1].total - 1e-15:
            kept.append(o)
    return kept


__all__ = ["MEMORY_SHARE", "STAGE0_GROWTH", "Revision", "replan_measured", "revise", "unit_ends"]
