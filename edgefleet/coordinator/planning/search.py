"""Choosing the configuration: every candidate estimated, the best one for the objective chosen.

Candidates are (participant subset, global batch, model variant, training mode); the batch sizes
of a candidate follow from the cost model (all participants finish together, capped by memory). Up to
:data:`EXHAUSTIVE_MAX_BOARDS` boards every non-empty subset is evaluated (vectorised, 65,535
subsets per option for 16 boards); above that a heuristic (described at its code below) whose gap to the
exhaustive answer :func:`heuristic_gap` measures on instances small enough for both.

Objectives minimise ``epoch_time_s`` (time), ``energy_per_epoch_j`` (energy) or ``edp_j_s``
(edp) among candidates that fit in memory, draw at most ``max_power_w`` and finish an epoch
within ``deadline_s``. Ties go to the faster, then the less energy-hungry, then the smaller set.
Near ties go to fewer boards: among the candidates whose objective is within
``fewer_boards_within`` (2%) of the best estimate, the one with the fewest boards is chosen (then
the best objective). An estimate is not exact to a few percent, and every board a candidate adds
is one more link to wait for and one more board that may straggle: on the emulated lab
(``bench/selection_accuracy.py``, five runs re-scored offline) the best estimate among near ties
was most often the one that added a slow board at a few samples, and the rule raised the picks'
expected hit rate (``bench/selection_ceiling.py``) from 84-91% to 86-93%, in every run.
Modes that change the mathematics (``modes`` module: local SGD) are searched like variants, each
(variant, mode) with its own link figures, but chosen only when the best of them beats the best
exact candidate by ``inexact_margin`` (10%) of the objective: an estimate is a few percent off,
and an inexact mode may need more epochs to the same accuracy, which a figure per epoch cannot
see. Then, among the inexact candidates within ``fewer_boards_within`` of their best (and still
beating exact by the margin), the one with the fewest boards, then the mode closest to exact
(local SGD's smallest H), then the best objective.
When nothing satisfies the request, :class:`PlanError` names the constraint that cannot be met
and by how much.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from edgefleet.coordinator.planning.cost_model import (
    CONSTRAINT_NAMES,
    DEADLINE,
    MEMORY,
    OK,
    POWER,
    TOO_SMALL,
    Candidate,
    Estimate,
    FleetArrays,
    SubsetStats,
    _estimate,
    allocate_batches,
    allocate_rows,
    busy_energy,
    exact_makespan,
    fill_per_board,
    format_duration,
    makespan_bounds,
    min_max_split,
    row_feasibility,
    row_figures,
)
from edgefleet.coordinator.planning.modes import EXACT, INEXACT_MARGIN, TrainingMode
from edgefleet.coordinator.planning.objectives import OBJECTIVE_KEY, OBJECTIVES
from edgefleet.coordinator.planning.profiles import FleetProfile
from edgefleet.protocol.errors import PlanError

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is 3.11+

log = logging.getLogger(__name__)

EXHAUSTIVE_MAX_BOARDS = 16
EXHAUSTIVE_HARD_LIMIT = 18     # 2^18 subsets per option (~100 MB of tables): beyond this exhaustive is refused
DEFAULT_GLOBAL_BATCHES = (32, 64, 128)
FEWER_BOARDS_WITHIN = 0.02     # near ties go to fewer boards (module doc)
MAX_FRONT_POINTS = 40          # Pareto points turned into full estimates (evenly thinned beyond)

__all__ = ["Candidate", "Exclusion", "GapReport", "PlanResult", "heuristic_gap", "plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Exclusion:
    """Candidates ruled out by one constraint (and, for memory, one board)."""

    constraint: str          # "batch", "memory", "power" or "deadline"
    board_id: str | None     # memory: the board that fits no sample (None: the boards together fall short)
    count: int               # candidates ruled out this way
    example: str             # one of them, with its figures


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """What :func:`plan` found."""

    objective: str
    method: str                       # "exhaustive" or "heuristic"
    chosen: Estimate
    ranked: tuple[Estimate, ...]      # the chosen candidate, then the best other feasible ones by objective
    front: tuple[Estimate, ...]       # time/energy Pareto front of the feasible candidates, fastest first
    ruled_out: tuple[Exclusion, ...]  # largest groups first
    evaluated: int                    # candidates estimated
    feasible: int                     # of which satisfy every constraint
    passed_over: Estimate | None = None  # the best estimate, when a near tie with fewer boards was chosen instead
    fewer_boards_within: float = FEWER_BOARDS_WITHIN
    modes: tuple[TrainingMode, ...] = (EXACT,)  # the training modes searched
    inexact_margin: float = INEXACT_MARGIN      # how much better than exact an inexact mode must be
    declined_inexact: Estimate | None = None    # the best inexact candidate, when better than exact but not by the margin
    best_exact: Estimate | None = None          # the best exact candidate, when an inexact one is chosen
    best_other_placement: Estimate | None = None  # the best exact candidate of the other kind than the chosen one's:
                                                  # data-parallel when layer placement is chosen, and the reverse

    @property
    def inexact_allowed(self) -> bool:
        """Some searched mode changes the mathematics (``--allow-inexact``)."""
        return any(not m.exact for m in self.modes)


@dataclass(frozen=True, slots=True, kw_only=True)
class GapReport:
    """The heuristic against exhaustive search on one instance."""

    objective: str
    exhaustive: Estimate
    heuristic: Estimate
    gap: float                        # heuristic objective / exhaustive objective - 1 (>= 0)


def plan(fleet_profiles_by_variant: Mapping[str, FleetProfile], *, objective: str, max_power_w: float | None = None,
         deadline_s: float | None = None, global_batches: Sequence[int] = DEFAULT_GLOBAL_BATCHES,
         count_idle: bool = False, max_memory_fraction: float = 0.9, method: str = "auto", top: int = 15,
         fewer_boards_within: float = FEWER_BOARDS_WITHIN, modes: Sequence[TrainingMode] = (EXACT,),
         inexact_margin: float = INEXACT_MARGIN) -> PlanResult:
    """Estimate every candidate and choose the best one for ``objective``.

    Args:
        fleet_profiles_by_variant: One fleet profile per model variant, keyed by a label shown
            in tables (``profiles.variant_label(variant)``); boards may differ between variants.
        objective: ``"time"``, ``"energy"`` or ``"edp"``.
        max_power_w: Power cap (W) on the candidate's power figure.
        deadline_s: Longest acceptable time per epoch (s). For a deadline on a whole run of E
            epochs pass the run's deadline divided by E.
        global_batches: Global batch sizes to consider (the CLI's ``--batch``).
        count_idle: Charge the idle power of boards left out.
        max_memory_fraction: Share of each board's memory a predicted peak may use.
        method: ``"auto"`` (exhaustive up to 16 boards), ``"exhaustive"`` or ``"heuristic"``.
        top: How many ranked candidates to return.
        fewer_boards_within: Choose the candidate with the fewest boards among those whose
            objective is within this fraction of the best (0: always the best estimate).
        modes: The training modes to search (``modes.candidate_modes``); the exact mode must be
            among them. Estimates are per epoch in each mode's steady state.
        inexact_margin: An inexact mode is chosen only when it beats the best exact candidate's
            objective by this fraction (module doc).

    Raises:
        PlanError: no candidate satisfies the request (names the constraint and the shortfall),
            or the arguments are unusable.
    """
    limits = _check_request(fleet_profiles_by_variant, objective, global_batches, max_memory_fraction, method,
                            max_power_w, deadline_s, count_idle, top)
    if not 0.0 <= fewer_boards_within < 1.0:
        raise PlanError(f"fewer_boards_within {fewer_boards_within:g} must be a fraction in [0, 1) (0.02 = 2%)")
    modes = _check_modes(modes, inexact_margin)
    largest = max(len(f.boards) for f in fleet_profiles_by_variant.values())
    if method == "auto":
        method = "exhaustive" if largest <= EXHAUSTIVE_MAX_BOARDS else "heuristic"
    if method == "exhaustive" and largest > EXHAUSTIVE_HARD_LIMIT:
        raise PlanError(f"exhaustive search over {largest} boards means 2^{largest} subsets per option; "
                        f"use the heuristic (the default above {EXHAUSTIVE_MAX_BOARDS} boards)")
    blocks = _evaluate_all(fleet_profiles_by_variant, global_batches, limits, objective, method, modes)
    if method == "heuristic" and objective != "time" and not _any_ok(blocks):
        # The heuristic aimed at the objective; aim at speed too before calling a deadline impossible.
        blocks += _evaluate_all(fleet_profiles_by_variant, global_batches, limits, "time", method, modes)
    if not _any_ok(blocks):
        raise PlanError(_explain_infeasible(blocks, limits, global_batches))
    ranked, passed_over, declined, best_exact, other_placement = _ranked(blocks, objective, top, limits,
                                                                         fewer_boards_within, inexact_margin)
    result = PlanResult(objective=objective, method=method, chosen=ranked[0], ranked=tuple(ranked),
                        front=tuple(_front(blocks, limits)), ruled_out=tuple(_exclusions(blocks, limits)),
                        evaluated=sum(len(b) for b in blocks), feasible=sum(int((b.code == OK).sum()) for b in blocks),
                        passed_over=passed_over, fewer_boards_within=fewer_boards_within, modes=modes,
                        inexact_margin=inexact_margin, declined_inexact=declined, best_exact=best_exact,
                        best_other_placement=other_placement)
    c = result.chosen
    log.info("plan (%s, %s): %d candidates, %d feasible; chosen %s x%d batch %s (%s, %s): %s per epoch, %.1f W",
             objective, method, result.evaluated, result.feasible, ",".join(c.candidate.boards),
             len(c.candidate.boards), c.candidate.global_batch, c.variant_label, c.mode.name,
             format_duration(c.epoch_time_s), c.power_w)
    return result


def _check_modes(modes: Sequence[TrainingMode], inexact_margin: float) -> tuple[TrainingMode, ...]:
    modes = tuple(modes)
    if not any(m.exact for m in modes):
        raise PlanError(f"modes {[m.name for m in modes]}: plan with the exact mode too (inexact ones are compared with it)")
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise PlanError(f"modes {names}: each training mode once")
    if not 0.0 <= inexact_margin < 1.0:
        raise PlanError(f"inexact_margin {inexact_margin:g} must be a fraction in [0, 1) (0.1 = 10%)")
    return modes


class PlanOptions(TypedDict, total=False):
    """The arguments of :func:`plan` that :func:`heuristic_gap` passes on to both searches."""

    max_power_w: float | None
    deadline_s: float | None
    global_batches: Sequence[int]
    count_idle: bool
    max_memory_fraction: float
    top: int
    modes: Sequence[TrainingMode]
    inexact_margin: float


def heuristic_gap(fleet_profiles_by_variant: Mapping[str, FleetProfile], *, objective: str,
                  **plan_kwargs: Unpack[PlanOptions]) -> GapReport:
    """Run the heuristic and exhaustive search on the same instance and compare their choices.

    Args:
        fleet_profiles_by_variant: As for :func:`plan` (at most 18 boards).
        objective: As for :func:`plan`.
        **plan_kwargs: Any other :func:`plan` argument except ``method`` and ``fewer_boards_within``
            (both searches choose the best estimate: the gap measures the search alone).
    """
    exact = plan(fleet_profiles_by_variant, objective=objective, method="exhaustive", fewer_boards_within=0.0, **plan_kwargs)
    rough = plan(fleet_profiles_by_variant, objective=objective, method="heuristic", fewer_boards_within=0.0, **plan_kwargs)
    objective = exact.objective
    best, found = exact.chosen.objective_value(objective), rough.chosen.objective_value(objective)
    return GapReport(objective=objective, exhaustive=exact.chosen, heuristic=rough.chosen, gap=found / best - 1.0)


def _check_request(fleets: Mapping[str, FleetProfile], objective: str, global_batches: Sequence[int],
                   max_memory_fraction: float, method: str, max_power_w: float | None, deadline_s: float | None,
                   count_idle: bool, top: int) -> Limits:
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if method not in ("auto", "exhaustive", "heuristic"):
        raise PlanError(f"method {method!r} is not auto, exhaustive or heuristic")
    if not fleets:
        raise PlanError("no fleet profile to plan with; run `edge-coordinator profile` first")
    if not global_batches or any(int(b) != b or b < 1 for b in global_batches):
        raise PlanError(f"--batch {list(global_batches)}: give one or more positive whole numbers")
    if not 0 < max_memory_fraction <= 1:
        raise PlanError(f"--max-memory-fraction {max_memory_fraction} must be in (0, 1]")
    if top < 1:
        raise PlanError(f"top = {top}: ask for at least one ranked candidate")
    for name, value in (("--max-power", max_power_w), ("--deadline", deadline_s)):
        if value is not None and not value > 0:
            raise PlanError(f"{name} {value} must be positive")
    return Limits(max_power_w, deadline_s, count_idle, max_memory_fraction)


def _evaluate_all(fleets: Mapping[str, FleetProfile], global_batches: Sequence[int], limits: Limits, objective: str,
                  method: str, modes: Sequence[TrainingMode]) -> list[Block]:
    """Every (variant, mode, global batch) block, in that order; each mode with its own link figures."""
    blocks = []
    for label, whole in fleets.items():
        for mode in modes:
            fleet = whole
            if mode.tail_board:  # the tail's board trains no head: the head's boards are the others
                if mode.tail_board not in whole.boards or len(whole.boards) < 2:
                    continue
                fleet = whole.select(b for b in whole.boards if b != mode.tail_board)
            fa = FleetArrays.from_fleet(fleet, limits.max_memory_fraction, mode)
            stats = SubsetStats.all_subsets(fa) if method == "exhaustive" else None
            for global_batch in sorted({int(b) for b in global_batches}):
                if mode.host_max_batch and global_batch > mode.host_max_batch:
                    continue  # the tail's board cannot hold the whole batch's activations
                if stats is not None:
                    blocks.append(_evaluate(label, fleet, fa, stats, global_batch, limits, mode=mode))
                else:
                    blocks.append(_heuristic(label, fleet, fa, global_batch, limits, objective, mode))
    return blocks


def _materialize(block: Block, row: int, limits: Limits) -> Estimate:
    return _materialize_many(block, np.array([row]), limits)[0]


def _materialize_many(block: Block, rows: np.ndarray, limits: Limits) -> list[Estimate]:
    """Full estimates of some rows of one block (their batch sizes allocated together)."""
    masks = block.masks[rows]
    k, _ = allocate_rows(block.fa, masks, block.global_batch)
    out = []
    for mask, sizes in zip(masks, k):
        ids = [block.fa.board_ids[i] for i in np.nonzero(mask)[0]]
        candidate = Candidate(boards=tuple(ids), batch_sizes=tuple(int(x) for x in sizes[mask]),
                              variant=dict(block.fleet.variant), mode=block.mode)
        est = _estimate(block.fa, candidate, block.fleet, count_idle=limits.count_idle,
                        max_memory_fraction=limits.max_memory_fraction, max_power_w=limits.max_power_w,
                        deadline_s=limits.deadline_s)
        out.append(est if est.variant_label == block.label else replace(est, variant_label=block.label))
    return out


def _materialize_flat(blocks: list[Block], flat: np.ndarray, limits: Limits) -> list[Estimate]:
    """Full estimates of rows given as indices into the stacked blocks, in the order given."""
    found: dict[int, Estimate] = {}
    start = 0
    for block in blocks:
        inside = flat[(flat >= start) & (flat < start + len(block))]
        if len(inside):
            found.update(zip(inside.tolist(), _materialize_many(block, inside - start, limits)))
        start += len(block)
    return [found[int(i)] for i in flat]


def _stack(blocks: list[Block], key: str, bound: str = "lb") -> np.ndarray:
    return np.concatenate([getattr(b, bound)[key] for b in blocks])


def _refine(blocks: list[Block], flat: np.ndarray, limits: Limits) -> None:
    """Make the figures of the rows ``flat`` (indices into the stacked blocks) exact."""
    start = 0
    for block in blocks:
        inside = flat[(flat >= start) & (flat < start + len(block))] - start
        _refine_rows(block, inside, limits)
        start += len(block)


def _any_ok(blocks: list[Block]) -> bool:
    return any(bool((b.code == OK).any()) for b in blocks)


def _ok(blocks: list[Block]) -> np.ndarray:
    return np.concatenate([b.code == OK for b in blocks])


def _ranked(blocks: list[Block], objective: str, top: int, limits: Limits, fewer_within: float,
            margin: float) -> tuple[list[Estimate], Estimate | None, Estimate | None, Estimate | None, Estimate | None]:
    """The chosen candidate and the best others by objective; the best estimate of the chosen
    kind (exact or not) if a near tie passed it over; the best inexact candidate if it beat exact
    by less than ``margin`` (module doc); the best exact one if an inexact one was chosen; the best
    exact one of the other placement kind than the chosen one's (layer placement or data-parallel)."""
    key = OBJECTIVE_KEY[objective]
    inexact = np.concatenate([np.full(len(b), not b.mode.exact) for b in blocks])
    placed_rows = np.concatenate([np.full(len(b), bool(b.mode.placement)) for b in blocks])
    ok = _ok(blocks)
    # each kind's best must be exact figures: they are compared (data-parallel, layer placement, inexact)
    for group in (ok & ~inexact & ~placed_rows, ok & ~inexact & placed_rows, ok & inexact):
        where = np.nonzero(group)[0]
        if not len(where):
            continue
        low, high = _stack(blocks, key)[where], _stack(blocks, key, "ub")[where]
        # Every row that could be among the best `top` once exact (lower bound within the top-th upper
        # bound), or within `fewer_within` of the best (lower bound within that of the least upper bound).
        bar = np.partition(high, top - 1)[top - 1] if len(high) > top else np.inf
        bar = max(bar, float(np.min(high)) * (1.0 + fewer_within))
        _refine(blocks, where[low <= bar], limits)
    refined = np.concatenate([b.exact for b in blocks])
    where = np.nonzero(ok & refined)[0]
    obj = _stack(blocks, key)[where]
    size = np.concatenate([b.stats.members for b in blocks])[where]
    departure = np.concatenate([np.full(len(b), b.mode.departure) for b in blocks])[where]
    order = np.lexsort((where, size, _stack(blocks, "energy_per_epoch_j")[where],
                        _stack(blocks, "epoch_time_s")[where], obj))
    plain, other = order[~inexact[where][order]], order[inexact[where][order]]   # by objective, the best first
    best_plain = float(obj[plain[0]]) if len(plain) else np.inf
    declined = best_exact = None
    if len(other) and obj[other[0]] <= best_plain * (1.0 - margin):
        bound = min(obj[other[0]] * (1.0 + fewer_within), best_plain * (1.0 - margin))
        near = other[obj[other] <= bound]
        pick = near[np.lexsort((np.arange(len(near)), departure[near], size[near]))[0]]
        head = other[0]
        if len(plain):
            best_exact = _materialize_flat(blocks, where[plain[:1]], limits)[0]
    else:
        near = plain[obj[plain] <= obj[plain[0]] * (1.0 + fewer_within)]
        pick = near[np.argmin(size[near])]                                # the first of the fewest boards
        head = plain[0]
        if len(other) and obj[other[0]] < best_plain:
            declined = _materialize_flat(blocks, where[other[:1]], limits)[0]
    rest = order[order != pick][:top - 1]
    ranked = _materialize_flat(blocks, where[np.concatenate([[pick], rest])], limits)
    placed = placed_rows[where]
    others = plain[placed[plain] != placed[pick]]
    other_placement = _materialize_flat(blocks, where[others[:1]], limits)[0] if len(others) else None
    passed_over = None
    if pick != head:  # the best estimate is usually in `rest` (the best of its kind heads it but for inexact picks)
        listed = np.nonzero(rest == head)[0]
        passed_over = ranked[1 + int(listed[0])] if len(listed) else _materialize_flat(blocks, where[[head]], limits)[0]
    return ranked, passed_over, declined, best_exact, other_placement


def _front(blocks: list[Block], limits: Limits) -> list[Estimate]:
    where = np.nonzero(_ok(blocks))[0]
    t_lo, e_lo = _stack(blocks, "epoch_time_s")[where], _stack(blocks, "energy_per_epoch_j")[where]
    t_hi, e_hi = _stack(blocks, "epoch_time_s", "ub")[where], _stack(blocks, "energy_per_epoch_j", "ub")[where]
    # A row is surely off the front if another row is, even at its upper bounds, strictly faster
    # than the row's lower bound and uses no more energy than the row's lower bound.
    by_time = np.argsort(t_hi, kind="stable")
    least_energy = np.minimum.accumulate(e_hi[by_time])
    steps = np.concatenate([[True], least_energy[1:] < least_energy[:-1]])  # the staircase's corners
    corner_t, corner_e = t_hi[by_time][steps], least_energy[steps]
    faster = np.searchsorted(corner_t, t_lo, side="left")
    beaten = (faster > 0) & (corner_e[np.maximum(faster - 1, 0)] <= e_lo)
    _refine(blocks, where[~beaten], limits)
    where = where[~beaten]
    time, energy = _stack(blocks, "epoch_time_s")[where], _stack(blocks, "energy_per_epoch_j")[where]
    order = np.lexsort((energy, time))
    e = energy[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(e)[:-1]])
    on_front = order[e < best_before]
    if len(on_front) > MAX_FRONT_POINTS:
        on_front = on_front[np.unique(np.linspace(0, len(on_front) - 1, MAX_FRONT_POINTS).round().astype(int))]
    return _materialize_flat(blocks, where[on_front], limits)


def _exclusions(blocks: list[Block], limits: Limits) -> list[Exclusion]:
    counts: Counter[tuple[int, str | None]] = Counter()
    examples: dict[tuple[int, str | None], tuple[Block, int]] = {}
    for block in blocks:
        bad = np.nonzero(block.code != OK)[0]
        if not len(bad):
            continue
        keys = np.stack([block.code[bad].astype(np.int64), block.culprit[bad]], axis=1)
        uniq, first, count = np.unique(keys, axis=0, return_index=True, return_counts=True)
        for (code, culprit), i, n in zip(uniq, first, count):
            key = (int(code), block.fa.board_ids[culprit] if culprit >= 0 else None)
            counts[key] += int(n)
            examples.setdefault(key, (block, int(bad[i])))
    out = []
    for (code, board), n in counts.most_common():
        block, row = examples[(code, board)]
        out.append(Exclusion(constraint=CONSTRAINT_NAMES[code], board_id=board, count=n,
                             example=_describe_exclusion(block, row, limits)))
    return out


def _describe_exclusion(block: Block, row: int, limits: Limits) -> str:
    ids = [block.fa.board_ids[i] for i in np.nonzero(block.masks[row])[0]]
    mode = "" if block.mode.exact else f", {block.mode.name}"
    what = f"{'+'.join(ids)} at global batch {block.global_batch} ({block.label}{mode})"
    code = block.code[row]
    if code == TOO_SMALL:
        return f"{what}: fewer samples than boards"
    if code == MEMORY:
        try:
            allocate_batches([block.fleet.boards[b] for b in ids], global_batch=block.global_batch,
                             max_memory_fraction=limits.max_memory_fraction)
        except PlanError as exc:
            return f"{what}: {exc}"
        return f"{what}: does not fit in memory"
    return f"{what}: {_materialize(block, row, limits).ruled_out}"


def _explain_infeasible(blocks: list[Block], limits: Limits, global_batches: Sequence[int]) -> str:
    code = np.concatenate([b.code for b in blocks])
    fits = (code != MEMORY) & (code != TOO_SMALL)
    if not fits.any():
        room = max(int(np.minimum(b.fa.max_batch, b.global_batch).sum()) for b in blocks)
        smallest = min(global_batches)
        if room < 1:
            return ("no board can fit even one sample of any variant in "
                    f"{limits.max_memory_fraction:.0%} of its memory; choose a smaller variant or raise --max-memory-fraction")
        return (f"no configuration fits in memory: at {limits.max_memory_fraction:.0%} of their memory all boards "
                f"together hold at most {room} samples per step, the smallest --batch is {smallest} "
                f"({smallest - room} short). Lower --batch, raise --max-memory-fraction or add boards.")
    power = _stack(blocks, "power_w")  # exact: it does not depend on the batch split
    cap = limits.max_power_w
    if cap is not None and not (fits & (power <= cap)).any():
        least = float(np.min(power[fits]))
        return (f"the lowest-power configuration draws {least:.1f} W; --max-power {cap:g} W is {least - cap:.1f} W short"
                + (" (idle boards are counted)" if limits.count_idle else ""))
    assert limits.deadline_s is not None
    allowed = fits & (code != POWER)
    fastest = _least_exact(blocks, allowed, "epoch_time_s", limits)
    message = (f"the fastest feasible configuration needs {format_duration(fastest)} per epoch; --deadline "
               f"{format_duration(limits.deadline_s)} is {format_duration(fastest - limits.deadline_s)} short")
    unlimited = _least_exact(blocks, fits, "epoch_time_s", limits)
    if cap is not None and unlimited < fastest:
        message += (f" (within --max-power {cap:g} W; without it the fastest needs {format_duration(unlimited)})")
    return message


def _least_exact(blocks: list[Block], rows: np.ndarray, key: str, limits: Limits) -> float:
    """The exact minimum of ``key`` over the selected rows (bool over the stacked blocks)."""
    where = np.nonzero(rows)[0]
    bar = np.min(_stack(blocks, key, "ub")[where])
    _refine(blocks, where[_stack(blocks, key)[where] <= bar], limits)
    return float(np.min(_stack(blocks, key)[where]))


# ------------------------------------------------------------------------------------------------
# Blocks: the evaluated candidate subsets of one (variant, global batch).
#
# A block holds the rows (subsets) that were evaluated, bounds on their figures, their exact
# feasibility code and, where a decision needed them, their exact figures; the search merges
# blocks across variants and global batches. Exhaustive search evaluates one block of every
# subset; the heuristic (below) several small ones, concatenated.
# ------------------------------------------------------------------------------------------------

FIGURES = ("compute_s", "exchange_s", "step_time_s", "samples_per_s", "epoch_time_s", "power_w",
           "energy_per_epoch_j", "edp_j_s")
_PENALTY = 1e30           # score of a row that misses power or deadline: worse than any feasible one


@dataclass(frozen=True, slots=True)
class Limits:
    """The request's constraints and accounting options."""

    max_power_w: float | None
    deadline_s: float | None
    count_idle: bool
    max_memory_fraction: float


@dataclass(slots=True)
class Block:
    """Evaluated rows of one (variant, training mode, global batch).

    Each row's figures are kept as a lower and an upper bound (from the makespan bounds of
    the cost model); :func:`_refine_rows` replaces both by the exact figures where a decision needs them.
    The feasibility ``code`` is always exact.
    """

    label: str
    fleet: FleetProfile
    fa: FleetArrays
    global_batch: int
    stats: SubsetStats
    code: np.ndarray                   # per-row feasibility code (OK, TOO_SMALL, MEMORY, POWER, DEADLINE)
    culprit: np.ndarray                # board index that fits no sample (MEMORY rows), else -1
    room: np.ndarray                   # samples the row's boards hold within the memory limit
    lb: dict[str, np.ndarray]          # per-row figures, lower bounds (NaN where code is TOO_SMALL or MEMORY)
    ub: dict[str, np.ndarray]          # upper bounds
    exact: np.ndarray                  # rows whose lb and ub are the exact figures
    mode: TrainingMode = EXACT         # the training mode the figures are for

    @property
    def masks(self) -> np.ndarray:
        return self.stats.masks

    def __len__(self) -> int:
        return len(self.code)


def _evaluate(label: str, fleet: FleetProfile, fa: FleetArrays, stats: SubsetStats, global_batch: int,
             limits: Limits, table: np.ndarray | None = None, *, mode: TrainingMode = EXACT) -> Block:
    """Bounds and feasibility of every row of ``stats`` (rows near the deadline are made exact).

    ``table``: the rows' fill at every breakpoint, if the caller has it (see ``makespan_bounds``).
    """
    masks, count = stats.masks, len(stats.masks)
    code, room = row_feasibility(fa, stats, global_batch)
    bad = code != OK
    low, high = makespan_bounds(fa, stats, global_batch, table)
    # Energy bounds: computing above idle costs at least nothing and at most every participant
    # computing until its gradient must leave (row_figures' default).
    lb = row_figures(fa, stats, low, global_batch, count_idle=limits.count_idle, busy_j=np.zeros(count))
    ub = row_figures(fa, stats, high, global_batch, count_idle=limits.count_idle)
    for figures in (lb, ub):
        for name, v in figures.items():
            if name != "power_w":  # power does not depend on the split: known for every row
                v[bad] = np.nan
    if limits.max_power_w is not None:
        code[(code == OK) & (lb["power_w"] > limits.max_power_w)] = POWER
    culprit = np.full(count, -1)
    unfit = np.nonzero(fa.max_batch < 1)[0]
    if len(unfit):
        hit = masks[:, unfit]
        culprit = np.where(hit.any(axis=1), unfit[hit.argmax(axis=1)], -1)
    block = Block(label, fleet, fa, global_batch, stats, code, culprit, room, lb, ub, np.zeros(count, dtype=bool), mode)
    if limits.deadline_s is not None:
        code[(code == OK) & (lb["epoch_time_s"] > limits.deadline_s)] = DEADLINE
        _refine_rows(block, np.nonzero((code == OK) & (ub["epoch_time_s"] > limits.deadline_s))[0], limits)
    return block


def _refine_rows(block: Block, rows: np.ndarray, limits: Limits) -> None:
    """Replace the bounds of ``rows`` (feasible in memory) by the exact figures; re-check the deadline."""
    rows = rows[~block.exact[rows]]
    if not len(rows):
        return
    fa, masks = block.fa, block.masks[rows]
    cap = np.maximum(np.minimum(fa.max_batch, block.global_batch), 1)
    k = min_max_split(fa.a, fa.c, masks, cap, block.global_batch, fa.grid(block.global_batch))
    makespan = exact_makespan(fa, masks, k)
    for name, v in row_figures(fa, block.stats, makespan, block.global_batch, count_idle=limits.count_idle,
                               rows=rows, busy_j=busy_energy(fa, masks, k)).items():
        block.lb[name][rows] = v
        block.ub[name][rows] = v
    block.exact[rows] = True
    if limits.deadline_s is not None:
        code = block.code[rows]
        timed = (code == OK) | (code == DEADLINE)
        late = block.lb["epoch_time_s"][rows] > limits.deadline_s
        block.code[rows] = np.where(timed, np.where(late, DEADLINE, OK), code)


def _score(block: Block, objective: str, limits: Limits) -> np.ndarray:
    """Objective (lower bound) per row, for the heuristic's moves.

    Rows that miss the power cap or the deadline rank after every feasible row, by how far they
    miss; rows whose boards cannot hold the batch (or have too few samples) after those, by
    their shortfall, so that moves from an infeasible set head for feasibility.
    """
    batch = block.global_batch
    power_miss = np.zeros(len(block))
    if limits.max_power_w is not None:
        power_miss = np.maximum(block.lb["power_w"] / limits.max_power_w - 1.0, 0.0)
    late = np.zeros(len(block))
    if limits.deadline_s is not None:
        late = np.nan_to_num(np.maximum(block.lb["epoch_time_s"] / limits.deadline_s - 1.0, 0.0))
    short = np.maximum(batch - block.room, 0) / batch + np.maximum(block.stats.members - batch, 0) / batch
    s = np.where(block.code == OK, block.lb[OBJECTIVE_KEY[objective]], _PENALTY * (1.0 + power_miss + late))
    return np.where((block.code == MEMORY) | (block.code == TOO_SMALL), _PENALTY**2 * (1.0 + short + power_miss), s)


def _concat(blocks: list[Block]) -> Block:
    """One block holding the rows of several blocks of the same (variant, mode, global batch)."""
    first = blocks[0]
    stats = SubsetStats.concat([b.stats for b in blocks])
    return Block(first.label, first.fleet, first.fa, first.global_batch, stats,
                 np.concatenate([b.code for b in blocks]), np.concatenate([b.culprit for b in blocks]),
                 np.concatenate([b.room for b in blocks]),
                 {k: np.concatenate([b.lb[k] for b in blocks]) for k in FIGURES},
                 {k: np.concatenate([b.ub[k] for b in blocks]) for k in FIGURES},
                 np.concatenate([b.exact for b in blocks]), first.mode)


# ------------------------------------------------------------------------------------------------
# The heuristic search for fleets above the exhaustive limit (one variant, one global batch).
#
# 1. Starting sets. Rank the boards by an efficiency figure and grow a set along the ranking
#    ("sort by efficiency, grow the set"), keeping the set at every size (every size up to 24,
#    then 8% apart). Under a power cap a board that would break the cap is skipped and the next
#    one tried, as in a greedy knapsack. Because the exchange waits for the slowest link, the
#    growth is repeated among the boards whose link time is under each of a few thresholds.
#    Efficiency figures, each at two reference batch sizes (B spread over the fleet, and all of B
#    on one board, capped by memory): samples/s of the board on its own including its link time;
#    that per marginal watt; its square per marginal watt (the EDP analogue). And memory
#    capacity, alone and per watt, for a batch that only several boards can hold together.
# 2. Moves. From each of the three best starting sets try: add one board, drop one, drop the
#    members on the slowest links; when none of those helps, swap (one of the 12 least harmful
#    drops with one of the 12 most helpful additions). Take the best move while the objective
#    improves; a start that reaches a set an earlier start passed through stops there.
#
# Decisions use the lower bounds of the cost model; the search then ranks the evaluated rows
# on exact figures. Rows that miss the power cap or the deadline rank after every feasible row,
# by how far they miss, and rows that cannot hold the batch after those, by their shortfall, so
# the moves head for feasibility first. :func:`search.heuristic_gap`
# measures what this gives away against exhaustive search.
# ------------------------------------------------------------------------------------------------

MAX_MOVES = 200       # improvement rounds at most, per start
STARTS = 3            # the best starting sets the moves start from
SWAP_WIDTH = 12       # drops x additions tried as swaps per round
LINK_LEVELS = 8       # link-time thresholds for the starting sets (plus "all links")


def _heuristic(label: str, fleet: FleetProfile, fa: FleetArrays, global_batch: int, limits: Limits,
              objective: str, mode: TrainingMode = EXACT) -> Block:
    """Starting sets, then moves (module doc); returns every row evaluated."""
    n = fa.n
    fit = np.minimum(fa.max_batch, global_batch) >= 1
    marginal_w = fa.active_w - (fa.idle_w if limits.count_idle else 0.0)
    base_w = float(fa.idle_w.sum()) if limits.count_idle else 0.0
    starts = [np.eye(n, dtype=bool)[fit]]
    for link_limit in _link_levels(fa.link_s[fit]):
        allowed = fit & (fa.link_s <= link_limit)
        for order in _rankings(fa, global_batch, np.maximum(marginal_w, 1e-3)):
            starts.append(_grown_sets(order[allowed[order]], n, marginal_w, base_w, limits.max_power_w))
    blocks = [_evaluate(label, fleet, fa, SubsetStats.of(fa, _distinct_rows(np.concatenate(starts))), global_batch,
                       limits, mode=mode)]
    scores = _score(blocks[0], objective, limits)
    visited: set[bytes] = set()  # sets a previous start's moves went through: the rest of the path is known
    for start in np.argsort(scores, kind="stable")[:STARTS]:
        blocks += _improve(label, fleet, fa, global_batch, limits, objective, fit, blocks[0].masks[start],
                           float(scores[start]), visited, mode)
    return _concat(blocks)


def _improve(label: str, fleet: FleetProfile, fa: FleetArrays, global_batch: int, limits: Limits, objective: str,
             fit: np.ndarray, current: np.ndarray, current_score: float, visited: set[bytes],
             mode: TrainingMode = EXACT) -> list[Block]:
    """Best-improvement moves from ``current`` until none improves; returns the rows evaluated."""
    per_board = fill_per_board(fa, global_batch)  # moves differ from the current set by a few boards:
    blocks = []                                   # their fill tables are the current one plus/minus those
    for _ in range(MAX_MOVES):
        key = np.packbits(current).tobytes()
        if key in visited:
            break
        visited.add(key)
        fill = per_board[current].sum(axis=0)
        moves, tables = _single_moves(current, fit, fa.link_s, fill, per_board)
        if not len(moves):
            break
        block = _evaluate(label, fleet, fa, SubsetStats.of(fa, moves), global_batch, limits, tables, mode=mode)
        s = _score(block, objective, limits)
        swaps = _swaps(current, moves, s) if not s.min() < current_score * (1 - 1e-12) else moves[:0]
        if len(swaps):  # only when no single move helps: swaps cost SWAP_WIDTH^2 rows
            swap_block = _evaluate(label, fleet, fa, SubsetStats.of(fa, swaps), global_batch, limits,
                                  _move_tables(current, fill, per_board, swaps), mode=mode)
            block = _concat([block, swap_block])
            s = np.concatenate([s, _score(swap_block, objective, limits)])
        blocks.append(block)
        i = int(np.argmin(s))
        if not s[i] < current_score * (1 - 1e-12):
            break
        current, current_score = block.masks[i].copy(), float(s[i])
    return blocks


def _move_tables(current: np.ndarray, fill: np.ndarray, per_board: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """Each move's fill at every breakpoint: the current fill plus the boards added, minus those dropped."""
    rows, boards = np.nonzero(moves != current[None, :])       # row-major: grouped by move
    change = np.where(current[boards], -1.0, 1.0)[:, None] * per_board[boards]
    starts = np.searchsorted(rows, np.arange(len(moves)))
    return fill[None, :] + np.add.reduceat(change, starts, axis=0)


def _rankings(fa: FleetArrays, global_batch: int, marginal_w: np.ndarray) -> list[np.ndarray]:
    cap = np.maximum(np.minimum(fa.max_batch, global_batch), 1)
    orders = []
    for reference in (max(1, global_batch // fa.n), global_batch):
        b = np.minimum(reference, cap)
        solo = b / (fa.a + fa.c * b + np.maximum(fa.link_s, fa.coord_s))
        for metric in (solo, solo / marginal_w, solo * solo / marginal_w):
            orders.append(np.argsort(-metric, kind="stable"))
    # Memory first: for a batch that only several boards can hold together.
    orders.append(np.argsort(-cap, kind="stable"))
    orders.append(np.argsort(-cap / marginal_w, kind="stable"))
    return orders


def _link_levels(link_s: np.ndarray) -> np.ndarray:
    levels = np.unique(link_s)
    if len(levels) > LINK_LEVELS + 1:
        levels = np.unique(np.quantile(link_s, np.linspace(0, 1, LINK_LEVELS + 1), method="higher"))
    return levels


def _grown_sets(order: np.ndarray, n: int, marginal_w: np.ndarray, base_w: float, cap_w: float | None) -> np.ndarray:
    """Sets grown along ``order`` (skipping boards that break the power cap), at the kept sizes."""
    if cap_w is not None:
        room = cap_w - base_w
        spent = np.cumsum(marginal_w[order])
        fits = int(np.searchsorted(spent, room, side="right"))      # the prefix that fits as it is
        kept = list(order[:fits])
        room -= float(spent[fits - 1]) if fits else 0.0
        for i in order[fits:][marginal_w[order[fits:]] <= room]:    # then skip what no longer fits
            if marginal_w[i] <= room:
                kept.append(i)
                room -= marginal_w[i]
        order = np.array(kept, dtype=np.int64)
    if not len(order):
        return np.zeros((0, n), dtype=bool)
    sizes = _sizes(len(order))
    rows = np.zeros((len(sizes), n), dtype=bool)
    rows[:, order] = sizes[:, None] > np.arange(len(order))[None, :]
    return rows


@functools.lru_cache(maxsize=64)
def _sizes(count: int) -> np.ndarray:
    """Every size up to 24, then sizes 8% apart (the moves fill the gaps), and ``count``."""
    sizes = set(range(1, min(count, 24) + 1))
    size = 24.0
    while size < count:
        size *= 1.08
        sizes.add(min(count, round(size)))
    sizes.add(count)
    return np.array(sorted(sizes))


def _single_moves(current: np.ndarray, fit: np.ndarray, link_s: np.ndarray, fill: np.ndarray,
                  per_board: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Add one board, drop one board, or drop every member on the k slowest links; and their fill tables."""
    n = len(current)
    flips = current[None, :] ^ np.eye(n, dtype=bool)
    flip_tables = fill[None, :] + np.where(current, -1.0, 1.0)[:, None] * per_board
    members = np.nonzero(current)[0]
    members = members[np.argsort(-link_s[members], kind="stable")]   # slowest link first
    levels = np.unique(link_s[members])[::-1][:-1]                    # all but the fastest level
    drops = current[None, :] & (link_s[None, :] < levels[:, None])
    dropped = (link_s[members][None, :] >= levels[:, None]).sum(axis=1)   # the first `dropped` members go
    drop_tables = fill[None, :] - np.cumsum(per_board[members], axis=0)[dropped - 1]
    moves, tables = np.concatenate([flips, drops]), np.concatenate([flip_tables, drop_tables])
    keep = moves.any(axis=1) & ~(moves & ~fit[None, :]).any(axis=1)
    return moves[keep], tables[keep]


def _swaps(current: np.ndarray, moves: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """One of the least harmful drops with one of the most helpful additions."""
    n = len(current)
    single = moves[: min(len(moves), n)]
    changed = (single != current[None, :]).sum(axis=1) == 1
    flipped = np.argmax(single != current[None, :], axis=1)
    s = scores[: len(single)]
    dropped = changed & current[flipped]
    added = changed & ~current[flipped]
    drop_boards = flipped[dropped][np.argsort(s[dropped], kind="stable")][:SWAP_WIDTH]
    add_boards = flipped[added][np.argsort(s[added], kind="stable")][:SWAP_WIDTH]
    if not len(drop_boards) or not len(add_boards):
        return np.zeros((0, n), dtype=bool)
    rows = np.repeat(current[None, :], len(drop_boards) * len(add_boards), axis=0)
    pairs = np.array([(d, a) for d in drop_boards for a in add_boards])
    rows[np.arange(len(rows)), pairs[:, 0]] = False
    rows[np.arange(len(rows)), pairs[:, 1]] = True
    return rows


def _distinct_rows(masks: np.ndarray) -> np.ndarray:
    packed = np.packbits(masks, axis=1)
    keys = packed.view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first = np.unique(keys, return_index=True)
    return masks[np.sort(first)]
