"""The cost model of DESIGN.md ("Choosing the configuration"): one candidate's time, power and energy.

Notation for a candidate: participants S (|S| = N), batch sizes b_i, fleet profile of the
candidate's model variant. Per board i the profile gives the fitted lines
``t_i(b) = a_i + c_i * b`` (s) and ``m_i(b) = m0_i + m1_i * b`` (bytes), its memory M_i (bytes),
its link up/down rates (bytes/s; where the probe timed gradient-sized rounds, scaled so that
G / up_i + G / down_i is that round's time: ``BoardProfile.exchange_link_s_per_byte``), and its
active, link and idle power (W). G is the bytes per step on each link: the gradient's size on
the wire in the exact mode, ``TrainingMode.wire_bytes`` in a mode that sends fewer (``modes``
module doc: local SGD every H steps sends G/H amortised plus a small round), with the compute
lines scaled by the mode's ``compute_scale``. L is the coordinator's link (bytes/s), D the samples
per epoch.

Formulas (units in brackets):

* compute_i = t_i(b_i)                                    [s]
* ready_i = compute_i + G / up_i                           [s]  board i's gradient is at the coordinator
* tail = max( max_i G / down_i,  G * N / L )               [s]  the average travels back over the
  slowest download, or over the coordinator's link to all N boards (the gradients coming in
  overlap the boards' own uploads, already in ready_i)
* step_time = max_i ready_i + tail                         [s]  the last gradient to arrive gates the step
* exchange = step_time - max_i compute_i                   [s]  the time not spent computing (reported)
* samples_per_s = K * (sum_i b_i) / step_time              [samples/s]
* epoch_time = D / samples_per_s                           [s]
  K is the profile's gradient accumulation (``FleetProfile.accumulate``, 1 without): the boards were
  timed over whole optimizer steps of K batches of b_i each, one exchange per step, so the lines t_i
  and m_i stay per batch size b_i (the memory of one batch) and a step trains K x the global batch
* power = sum_{i in S} P_i(active)  (+ sum_{j not in S} P_j(idle) with count_idle)  [W]
  the draw while every participant computes: the peak, and what --max-power caps
* mean_power = sum_{i in S} ( P_i(idle) + (P_i(active) - P_i(idle)) * compute_i / step_time
                              + (P_i(link) - P_i(idle)) * (G / up_i + G / down_i) / step_time )
  (a board that waits for a slower one's link computes for compute_i only, not the whole step;
  P_i(link) is its draw while it moves bytes, measured during the link probe, idle if unmeasured)
               (+ sum_{j not in S} P_j(idle) with count_idle)   [W]
* energy_per_epoch = mean_power * epoch_time               [J]
* edp = energy_per_epoch * epoch_time                      [J*s]
* memory headroom_i = 1 - m_i(b_i) / M_i                   [fraction of the board's memory]

A mode (``modes``) scales these: the bytes G, each board's per-sample compute and per-sample
bytes (layer placement: c_i = c_i * sample_scale + s * (1/up_i + 1/down_i) for s bytes a sample
each way), and a serial part of the step on the coordinator, host = host_a + host_c * N (the
tail's forward and backward over the global batch N, and the N activations over its link), added
to the exchange: step_time = max_i ready_i + tail + host.

The batch allocation equalises ``ready_i``: a board on a slow uplink gets fewer samples, so that
its gradient arrives with the others (charging up + down after the slowest compute would count a
fast board's transfer twice). For energy, a participant draws its active power while it computes,
its link power while its gradient goes up and the average comes down, and its idle power while it
waits: a board on a slow link spends most of a small model's step sending, which active power would
overcharge, and moving megabytes a step costs a slow board real CPU, which idle power would miss.

A candidate is ruled out, in this order, by: ``batch`` (fewer samples than boards), ``memory``
(some m_i(b_i) > M_i * max_memory_fraction; the board is named), ``power`` (power > max_power_w),
``deadline`` (epoch_time > deadline_s).

The second half of the module is the same model on numpy arrays (rows = candidate subsets,
columns = boards): :func:`estimate` calls it with one row and the search with up to 65,535
rows per option, so both always give the same figures. It also holds the batch allocation
(all participants finish together, capped by memory) that :func:`allocate_batches` exposes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.coordinator.planning.modes import EXACT, TrainingMode
from edgefleet.coordinator.planning.objectives import OBJECTIVE_KEY
from edgefleet.coordinator.planning.profiles import BoardProfile, FleetProfile, variant_label
from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One configuration: which boards take part, each one's batch size, the model variant and the training mode."""

    boards: tuple[str, ...]
    batch_sizes: tuple[int, ...]          # aligned with boards
    variant: dict[str, Any]               # model options of the variant, e.g. {"layers": 3}
    mode: TrainingMode = EXACT            # how the boards exchange (modes module)

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The predicted figures of one candidate (formulas in the module doc)."""

    candidate: Candidate
    variant_label: str
    compute_s: tuple[float, ...]          # per participant, s
    exchange_s: float
    step_time_s: float
    samples_per_s: float
    epoch_time_s: float
    power_w: float
    energy_per_epoch_j: float
    edp_j_s: float
    peak_memory_bytes: tuple[int, ...]    # per participant, predicted
    memory_headroom: tuple[float, ...]    # per participant, fraction of its memory left at the peak
    power_estimated: bool                 # some participant's power is an estimate, not a sensor reading
    constraint: str = ""                  # "", "batch", "memory", "power" or "deadline"
    ruled_out: str = ""                   # why, with the figures; "" when feasible
    ruled_out_board: str | None = None    # the board that broke the memory limit

    @property
    def feasible(self) -> bool:
        return not self.constraint

    @property
    def min_memory_headroom(self) -> float:
        return min(self.memory_headroom)

    @property
    def mode(self) -> TrainingMode:
        return self.candidate.mode

    def objective_value(self, objective: str) -> float:
        """The figure ``objective`` minimises: epoch_time_s, energy_per_epoch_j or edp_j_s."""
        return float(getattr(self, OBJECTIVE_KEY[objective]))


def allocate_batches(boards: Sequence[BoardProfile], *, global_batch: int | None = None,
                     per_board_batch: int | None = None, max_memory_fraction: float = 0.9,
                     grad_bytes: int = 0, mode: TrainingMode = EXACT) -> tuple[int, ...]:
    """Split the work so that every board finishes its step at (nearly) the same time.

    Board i gets b_i samples with its step time ``a_i + c_i * b_i`` as equal as integers allow
    (with no intercepts this is b_i proportional to the board's throughput 1/c_i), capped by
    memory: ``m_i(b_i) <= memory_total_i * max_memory_fraction``; every board gets at least one.

    Args:
        boards: The participants' profiles (one variant).
        global_batch: Mode 1: the b_i sum to exactly this (the training semantics depend only
            on it, so every subset trains the same model).
        per_board_batch: Mode 2: the fastest board takes this many samples (memory permitting)
            and every other board as many as it can finish in the same time; the sum varies.
        max_memory_fraction: Share of each board's memory the predicted peak may use.
        grad_bytes: The gradient's size on the wire: a board's upload time is part of its finish
            time (see ``ready_i`` in the module doc). 0: compute alone.
        mode: The training mode (its bytes and compute scales: layer placement's per-sample bytes).

    Returns:
        The batch sizes, aligned with ``boards``.

    Raises:
        PlanError: naming the board whose memory rules the request out, or the shortfall.
    """
    if (global_batch is None) == (per_board_batch is None):
        raise ValueError("give exactly one of global_batch and per_board_batch")
    if (global_batch or per_board_batch or 0) < 1:
        raise PlanError(f"batch size {global_batch or per_board_batch} must be at least 1")
    fa = FleetArrays.from_fleet(_bare_fleet(boards, grad_bytes), max_memory_fraction, mode)
    for board, cap in zip(boards, fa.max_batch):
        if cap < 1:
            raise PlanError(_no_fit_message(board, max_memory_fraction))
    if per_board_batch is not None:
        cap = np.minimum(fa.max_batch, per_board_batch)
        level = float(np.min(fa.a + fa.c * cap))
        k = np.clip(np.floor((level - fa.a) / fa.c + 1e-9), 1, cap).astype(np.int64)
        return tuple(int(x) for x in k)
    assert global_batch is not None
    mask = np.ones((1, len(boards)), dtype=bool)
    k, code = allocate_rows(fa, mask, global_batch)
    if code[0] == TOO_SMALL:
        raise PlanError(f"global batch {global_batch} is smaller than the {len(boards)} boards: each board needs "
                        f"at least one sample. Raise --batch or use fewer boards.")
    if code[0] == MEMORY:
        caps = np.minimum(fa.max_batch, global_batch)
        parts = ", ".join(f"{b.board_id} <= {int(u)}" for b, u in zip(boards, caps))
        raise PlanError(f"global batch {global_batch} does not fit in memory: at {max_memory_fraction:.0%} of their "
                        f"memory these boards hold at most {int(caps.sum())} samples per step ({parts}), "
                        f"{global_batch - int(caps.sum())} short. Lower --batch, raise --max-memory-fraction or add boards.")
    return tuple(int(x) for x in k[0])


def estimate(candidate: Candidate, fleet: FleetProfile, *, count_idle: bool = False, max_memory_fraction: float = 0.9,
             max_power_w: float | None = None, deadline_s: float | None = None) -> Estimate:
    """Predict one candidate's figures and check it against the constraints (module doc).

    Args:
        candidate: Participants, their batch sizes and the training mode; every board must be in ``fleet``.
        fleet: The profile of the candidate's model variant.
        count_idle: Charge the idle power of the fleet's boards that do not take part.
        max_memory_fraction: Share of each board's memory the predicted peak may use.
        max_power_w: Power cap (W) or None.
        deadline_s: Longest acceptable time per epoch (s) or None.

    Returns:
        The estimate; ``constraint``/``ruled_out`` say what rules it out, if anything.
    """
    fa = FleetArrays.from_fleet(fleet, max_memory_fraction, candidate.mode)
    return _estimate(fa, candidate, fleet, count_idle=count_idle, max_memory_fraction=max_memory_fraction,
                     max_power_w=max_power_w, deadline_s=deadline_s)


def _estimate(fa: FleetArrays, candidate: Candidate, fleet: FleetProfile, *, count_idle: bool,
              max_memory_fraction: float, max_power_w: float | None, deadline_s: float | None) -> Estimate:
    """estimate() with the fleet's arrays already built (the search builds them once per variant and mode)."""
    column = {board_id: i for i, board_id in enumerate(fa.board_ids)}
    mask = np.zeros((1, fa.n), dtype=bool)
    k = np.zeros((1, fa.n), dtype=np.int64)
    for board_id, b in zip(candidate.boards, candidate.batch_sizes):
        if board_id not in column:
            raise PlanError(f"board {board_id!r} is not in the fleet profile ({variant_label(fleet.variant)})")
        mask[0, column[board_id]], k[0, column[board_id]] = True, b
    stats = SubsetStats.of(fa, mask)
    makespan = exact_makespan(fa, mask, k)
    f = {name: float(v[0]) for name, v in
         row_figures(fa, stats, makespan, candidate.global_batch, count_idle=count_idle,
                     busy_j=busy_energy(fa, mask, k)).items()}
    profiles = [fleet.boards[b] for b in candidate.boards]
    peaks = tuple(round(p.peak_memory(b)) for p, b in zip(profiles, candidate.batch_sizes))
    constraint, why, culprit = "", "", None
    if len(candidate.boards) > candidate.global_batch or min(candidate.batch_sizes) < 1:
        constraint, why = "batch", f"batch sizes {candidate.batch_sizes}: every board needs at least one sample"
    else:
        over = [(p, b, peak) for p, b, peak in zip(profiles, candidate.batch_sizes, peaks)
                if peak > p.memory_total_bytes * max_memory_fraction]
        if over:
            p, b, peak = max(over, key=lambda o: o[2] / o[0].memory_total_bytes)
            constraint, culprit = "memory", p.board_id
            why = (f"{p.board_id} needs ~{_mb(peak)} for batch {b}, over {max_memory_fraction:.0%} of its "
                   f"{_mb(p.memory_total_bytes)} ({_mb(p.memory_total_bytes * max_memory_fraction)})")
        elif max_power_w is not None and f["power_w"] > max_power_w:
            constraint = "power"
            why = f"draws {f['power_w']:.1f} W, over --max-power {max_power_w:g} W"
        elif deadline_s is not None and f["epoch_time_s"] > deadline_s:
            constraint = "deadline"
            why = f"needs {format_duration(f['epoch_time_s'])} per epoch, over --deadline {format_duration(deadline_s)}"
    compute = tuple(p.step_time(b) * candidate.mode.compute_scale for p, b in zip(profiles, candidate.batch_sizes))
    return Estimate(
        candidate=candidate, variant_label=variant_label(candidate.variant), compute_s=compute,
        exchange_s=f["step_time_s"] - max(compute), step_time_s=f["step_time_s"], samples_per_s=f["samples_per_s"],
        epoch_time_s=f["epoch_time_s"], power_w=f["power_w"], energy_per_epoch_j=f["energy_per_epoch_j"],
        edp_j_s=f["edp_j_s"], peak_memory_bytes=peaks,
        memory_headroom=tuple(1.0 - peak / p.memory_total_bytes for p, peak in zip(profiles, peaks)),
        power_estimated=any(p.power_source == "estimated" for p in profiles),
        constraint=constraint, ruled_out=why, ruled_out_board=culprit)


def format_duration(seconds: float) -> str:
    """``"42.0 s"`` under two minutes, ``"14.2 min"`` under two hours, else ``"3.5 h"``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _no_fit_message(board: BoardProfile, max_memory_fraction: float) -> str:
    need = board.peak_memory(1)
    return (f"{board.board_id} cannot fit even one sample: ~{_mb(need)} needed, {max_memory_fraction:.0%} of its "
            f"{_mb(board.memory_total_bytes)} is {_mb(board.memory_total_bytes * max_memory_fraction)}. "
            f"Leave it out (--exclude {board.board_id}) or choose a smaller variant.")


def _bare_fleet(boards: Sequence[BoardProfile], grad_bytes: int) -> FleetProfile:
    # allocate_batches needs the compute and memory lines and the uploads; the rest are placeholders.
    key = boards[0].model_key
    return FleetProfile(model_key=key, grad_bytes=max(1, grad_bytes), coordinator_link_bytes_per_s=1.0, dataset_len=1,
                        boards={b.board_id: b for b in boards})


# ------------------------------------------------------------------------------------------------
# The cost model on numpy arrays: many candidate subsets of one fleet evaluated at once.
#
# Rows are candidates, columns are boards; ``mask[k, i]`` says board i takes part in candidate k.
#
# Allocation (global batch B over the participants S, board i with the fitted step time
# ``a_i + c_i * b`` and the memory cap ``u_i``): integers ``1 <= b_i <= u_i``, ``sum b_i = B``,
# minimising the makespan ``max_i (a_i + c_i * b_i)``: all boards finish together as nearly as
# integers allow.
#
# 1. The continuous optimum: the water level T with ``sum_i clip((T - a_i) / c_i, 1, u_i) = B``.
#    The left side is piecewise linear in T with breakpoints ``a_i + c_i`` and ``a_i + c_i u_i``:
#    a binary search over the fleet's breakpoints finds the bracketing pair and a linear
#    interpolation inside it is exact (for all subsets at once the sums at every breakpoint come
#    from a table built by doubling, 2^n x breakpoints additions). The continuous makespan
#    ``T_lb = max(T, max_i (a_i + c_i))`` bounds the integer one from below, and
#    ``T_ub = T_lb + max_i c_i`` from above (at T_ub every board fits at least its continuous share).
# 2. Integers (:func:`min_max_split`): ``b_i = clip(floor((T - a_i) / c_i), 1, u_i)`` leaves a
#    deficit d < |S|; the d smallest "next sample" finishing times ``a_i + c_i (b_i + 1)`` (a board
#    may take several) get one sample each, in rounds of every next-sample time below the smallest
#    second-next one. This takes the B smallest elements of the union of the boards'
#    finishing-time ladders: the exact integer min-max allocation.
#
# The search uses the bounds for every row and the exact integers only for the rows whose place
# in the ranking, the Pareto front or the deadline check the bounds cannot settle.
# ------------------------------------------------------------------------------------------------

# Feasibility codes, in the order they are checked.
OK, TOO_SMALL, MEMORY, POWER, DEADLINE = 0, 1, 2, 3, 4
CONSTRAINT_NAMES = {TOO_SMALL: "batch", MEMORY: "memory", POWER: "power", DEADLINE: "deadline"}


@dataclass(frozen=True, slots=True)
class FleetArrays:
    """One fleet profile in one training mode as per-board arrays (board order = ``board_ids``)."""

    board_ids: tuple[str, ...]
    a: np.ndarray            # fitted step-time intercept per board, s
    c: np.ndarray            # fitted step time per sample per board, s/sample
    max_batch: np.ndarray    # largest batch within the memory limit per board (int64; 0 = none fits)
    link_s: np.ndarray       # the average down over the board's own link, s per step (its upload is in ``a``)
    up_s: np.ndarray         # the gradient up over the board's own link, s per step (the mode's bytes)
    link_j: np.ndarray       # (link - idle power) x (up + down time) per board, J per step
    coord_s: float           # grad_bytes / coordinator link, s per participant per step (the broadcast)
    active_w: np.ndarray
    idle_w: np.ndarray
    dataset_len: int
    host_a: float = 0.0      # a step's serial work on the coordinator: host_a + host_c * global batch, s (layer placement)
    host_c: float = 0.0
    host_idle_w: float = 0.0  # a tail board's power (its idle, and computing): the coordinator's is not counted
    host_active_w: float = 0.0
    accumulate: int = 1      # batches per optimizer step (FleetProfile.accumulate): a step trains this x the global batch
    grids: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)

    def grid(self, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The breakpoints and each board's fill at them (boards x breakpoints) for a global batch, cached."""
        if global_batch not in self.grids:
            cap = np.maximum(np.minimum(self.max_batch, global_batch), 1)
            points = _breakpoints(self.a, self.c, cap)
            self.grids[global_batch] = (points, _fill(self.a, self.c, cap, points))
        return self.grids[global_batch]

    @classmethod
    def from_fleet(cls, fleet: FleetProfile, max_memory_fraction: float, mode: TrainingMode = EXACT) -> FleetArrays:
        boards = list(fleet.boards.values())
        wire, scale = mode.wire_bytes(fleet.grad_bytes), mode.compute_scale
        per_sample = mode.per_sample_bytes  # each way, before the board can finish its step (layer placement)
        return cls(
            board_ids=tuple(b.board_id for b in boards),
            a=np.array([b.time_fit.intercept * scale + wire * b.up_s_per_byte for b in boards]),
            c=np.array([b.time_fit.slope * scale * mode.sample_scale
                        + per_sample * (b.up_s_per_byte + b.down_s_per_byte) for b in boards]),
            max_batch=np.array([b.max_batch(max_memory_fraction) for b in boards], dtype=np.int64),
            link_s=np.array([wire * b.down_s_per_byte for b in boards]),
            up_s=np.array([wire * b.up_s_per_byte for b in boards]),
            link_j=np.array([max(0.0, (b.link_power_w if b.link_power_w is not None else b.idle_power_w) - b.idle_power_w)
                             * wire * b.exchange_link_s_per_byte for b in boards]),
            coord_s=wire / fleet.coordinator_link_bytes_per_s,
            active_w=np.array([b.active_power_w for b in boards]),
            idle_w=np.array([b.idle_power_w for b in boards]),
            dataset_len=fleet.dataset_len,
            host_a=mode.host_a_s,
            # and every slice over the coordinator's link (a tail board's own link is in its host figures)
            host_c=mode.host_c_s + (0.0 if mode.tail_board else 2 * per_sample / fleet.coordinator_link_bytes_per_s),
            host_idle_w=mode.host_idle_w, host_active_w=mode.host_active_w,
            accumulate=fleet.accumulate,
        )

    @property
    def n(self) -> int:
        return len(self.board_ids)


@dataclass(frozen=True, slots=True)
class SubsetStats:
    """Rows (subsets) and what their figures need besides the makespan; independent of the batch."""

    masks: np.ndarray        # rows x boards, bool
    every: bool              # rows are all non-empty subsets in bit order (sums by doubling, no matmul)
    members: np.ndarray      # participants per row
    link_max: np.ndarray     # slowest participant link time, s
    lo_max: np.ndarray       # max a_i + c_i: the makespan of one sample each, s
    c_max: np.ndarray        # max c_i, s/sample
    active_w: np.ndarray     # sum of the participants' active power, W
    idle_out_w: np.ndarray   # sum of the other boards' idle power, W
    up_j: np.ndarray         # sum of (active - idle) power x upload time, J: energy not spent computing
    link_j: np.ndarray       # sum of (link - idle) power x transfer time, J: energy of moving the gradients

    @classmethod
    def of(cls, fa: FleetArrays, masks: np.ndarray) -> SubsetStats:
        """Any rows."""
        w = masks.astype(np.float64)
        return cls(masks, False, masks.sum(axis=1), _masked_max(masks, fa.link_s), _masked_max(masks, fa.a + fa.c),
                   _masked_max(masks, fa.c), w @ fa.active_w, fa.idle_w.sum() - w @ fa.idle_w,
                   w @ ((fa.active_w - fa.idle_w) * fa.up_s), w @ fa.link_j)

    @classmethod
    def all_subsets(cls, fa: FleetArrays) -> SubsetStats:
        """Every non-empty subset; row r is the subset whose bits are r + 1."""
        n = fa.n
        members = _doubling(np.ones(n, dtype=np.int64), np.add, 0)
        return cls(all_subsets(n), True, members, _doubling(fa.link_s, np.maximum, -np.inf),
                   _doubling(fa.a + fa.c, np.maximum, -np.inf), _doubling(fa.c, np.maximum, -np.inf),
                   _doubling(fa.active_w, np.add, 0.0), fa.idle_w.sum() - _doubling(fa.idle_w, np.add, 0.0),
                   _doubling((fa.active_w - fa.idle_w) * fa.up_s, np.add, 0.0), _doubling(fa.link_j, np.add, 0.0))

    @classmethod
    def concat(cls, parts: list[SubsetStats]) -> SubsetStats:
        """The rows of several stats of one fleet, one after the other."""
        if len(parts) == 1:
            return parts[0]
        return cls(np.concatenate([p.masks for p in parts]), False,
                   *(np.concatenate([getattr(p, name) for p in parts])
                     for name in ("members", "link_max", "lo_max", "c_max", "active_w", "idle_out_w", "up_j",
                                  "link_j")))

    def subset_sum(self, values: np.ndarray) -> np.ndarray:
        """Per row, the sum over its members of ``values`` (boards, or boards x columns)."""
        if self.every:
            return _doubling(values, np.add, 0)
        total: np.ndarray = self.masks.astype(values.dtype if values.dtype.kind == "f" else np.int64) @ values
        return total


def _doubling(values: np.ndarray, op: np.ufunc, empty: float) -> np.ndarray:
    """``op`` over the members of every non-empty subset, O(2^n) work: each board doubles the table."""
    n = len(values)
    out = np.empty((1 << n, *values.shape[1:]), dtype=np.result_type(values, type(empty)))
    out[0] = empty
    for i in range(n):
        h = 1 << i
        op(out[:h], values[i], out=out[h:2 * h])
    return out[1:]


def _masked_max(masks: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the largest of ``values`` over the row's members (-inf for an empty row)."""
    order = np.argsort(-values, kind="stable")
    first = masks[:, order].argmax(axis=1)          # the first member in descending order of value
    return np.where(masks.any(axis=1), values[order][first], -np.inf)


def row_feasibility(fa: FleetArrays, stats: SubsetStats, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the code OK, TOO_SMALL (fewer samples than participants) or MEMORY (a participant
    fits no sample, or the participants' caps sum to less than the batch), and that sum (samples)."""
    cap = np.minimum(fa.max_batch, global_batch)
    room = stats.subset_sum(cap)
    return _codes(stats.members, stats.subset_sum((cap < 1).astype(np.int64)), room, global_batch), room


def _codes(members: np.ndarray, unfit: np.ndarray, room: np.ndarray, global_batch: int) -> np.ndarray:
    code = np.full(len(members), OK, dtype=np.int8)
    code[members > global_batch] = TOO_SMALL
    code[(code == OK) & ((unfit > 0) | (room < global_batch))] = MEMORY
    return code


def makespan_bounds(fa: FleetArrays, stats: SubsetStats, global_batch: int,
                    table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(T_lb, T_ub)`` of the integer makespan per row (module doc); meaningless where infeasible.

    ``table``: the rows' fill at every breakpoint (:func:`fill_per_board` summed over each
    row's members) when the caller has it already.
    """
    cap = np.maximum(np.minimum(fa.max_batch, global_batch), 1)
    level = _water_level(fa.a, fa.c, table if table is not None else stats, cap, global_batch, fa.grid(global_batch))
    low = np.maximum(level, stats.lo_max)
    return low, low + stats.c_max


def fill_per_board(fa: FleetArrays, global_batch: int) -> np.ndarray:
    """Each board's share ``clip((T - a_i)/c_i, 1, u_i)`` at every breakpoint T (boards x breakpoints)."""
    return fa.grid(global_batch)[1]


def _breakpoints(a: np.ndarray, c: np.ndarray, cap: np.ndarray) -> np.ndarray:
    return np.unique(np.concatenate([a + c, a + c * cap]))


def _fill(a: np.ndarray, c: np.ndarray, cap: np.ndarray, points: np.ndarray) -> np.ndarray:
    fill: np.ndarray = np.clip((points[None, :] - a[:, None]) / c[:, None], 1.0, cap[:, None])
    return fill


def allocate_rows(fa: FleetArrays, masks: np.ndarray, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact integer batch sizes per row: ``(k, code)``, k = 0 for non-participants and where code != OK."""
    cap = np.minimum(fa.max_batch, global_batch)
    code = _codes(masks.sum(axis=1), (masks & (cap < 1)).sum(axis=1), np.where(masks, cap, 0).sum(axis=1), global_batch)
    k = np.zeros(masks.shape, dtype=np.int64)
    good = code == OK
    if good.any():
        cap = np.maximum(np.minimum(fa.max_batch, global_batch), 1)
        k[good] = min_max_split(fa.a, fa.c, masks[good], cap, global_batch, fa.grid(global_batch))
    return k, code


def _water_level(a: np.ndarray, c: np.ndarray, rows: SubsetStats | np.ndarray, cap: np.ndarray,
                 global_batch: int, grid: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """The continuous level T per row: ``sum_i clip((T - a_i)/c_i, 1, u_i) = B``.

    The sum is piecewise linear between the fleet's breakpoints, so a binary search for the
    bracketing pair of breakpoints and a linear interpolation inside it are exact. ``rows`` is
    a float table of every row's sum at every breakpoint, all subsets (``SubsetStats.every``:
    the table comes from doubling), other subsets (each probe sums the members directly), or a
    bool mask of them.
    """
    points, fill = grid if grid is not None else (_breakpoints(a, c, cap), None)
    if fill is None:
        fill = _fill(a, c, cap, points)
    if isinstance(rows, SubsetStats) and rows.every:
        rows = rows.subset_sum(fill)
    if isinstance(rows, np.ndarray) and rows.dtype.kind == "f":
        table, index = rows, np.arange(len(rows))

        def filled(j: np.ndarray) -> np.ndarray:
            values: np.ndarray = table[index, j]
            return values
    else:
        weights = (rows.masks if isinstance(rows, SubsetStats) else rows).astype(np.float64)
        per_board = fill.T                                                 # breakpoints x boards

        def filled(j: np.ndarray) -> np.ndarray:
            values: np.ndarray = np.einsum("ij,ij->i", per_board[j], weights)
            return values
    count = len(rows.members) if isinstance(rows, SubsetStats) else len(rows)
    lo, hi = np.zeros(count, dtype=np.int64), np.full(count, len(points) - 1)
    target = global_batch - 1e-9
    while (lo < hi).any():
        mid = (lo + hi) // 2
        searching = lo < hi
        below = filled(mid) < target
        lo, hi = np.where(searching & below, mid + 1, lo), np.where(searching & ~below, mid, hi)
    j, prev = lo, np.maximum(lo - 1, 0)
    f0, f1, p0, p1 = filled(prev), filled(j), points[prev], points[j]
    # j = 0 means B = |S|: every member at one sample.
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(j > 0, p0 + (global_batch - f0) * (p1 - p0) / (f1 - f0), p1)


def min_max_split(a: np.ndarray, c: np.ndarray, masks: np.ndarray, cap: np.ndarray, global_batch: int,
                  grid: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Integers ``1 <= k_i <= cap_i`` over each row's members summing to B, minimising max ``a_i + c_i k_i``.

    Every row must be feasible (members <= B <= sum of the members' caps, every cap >= 1, c > 0).
    """
    level = _water_level(a, c, masks, cap, global_batch, grid)
    # A hair below the level, so rounding error never hands out more than B; the deficit is refilled.
    k = np.floor((level[:, None] - a) / c * (1 - 1e-12)).astype(np.int64)
    k = np.where(masks, np.clip(k, 1, cap), 0)
    need = global_batch - k.sum(axis=1)
    while (need < 0).any():  # safety net, not expected: give back from the slowest board
        rows = np.nonzero(need < 0)[0]
        t = np.where(masks[rows] & (k[rows] > 1), a + c * k[rows], -np.inf)
        k[rows, t.argmax(axis=1)] -= 1
        need[rows] += 1
    n = masks.shape[1]
    while (need > 0).any():
        rows = np.nonzero(need > 0)[0]
        kr, mr = k[rows], masks[rows]
        nxt = np.where(mr & (kr < cap), a + c * (kr + 1), np.inf)
        nxt2 = np.where(mr & (kr + 1 < cap), a + c * (kr + 2), np.inf)
        theta = nxt2.min(axis=1, keepdims=True)
        rank = np.empty((len(rows), n), dtype=np.int64)
        np.put_along_axis(rank, np.argsort(nxt, axis=1, kind="stable"), np.arange(n)[None, :], axis=1)
        take = (rank < need[rows, None]) & (nxt <= theta) & np.isfinite(nxt)
        k[rows] = kr + take
        need[rows] -= take.sum(axis=1)
    return k


def row_figures(fa: FleetArrays, stats: SubsetStats, makespan: np.ndarray, global_batch: int | np.ndarray, *,
            count_idle: bool, rows: np.ndarray | slice = slice(None), busy_j: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-row figures from the makespan (the last gradient's arrival); the module doc's formulas.

    ``busy_j``: per row, sum_i (P_i(active) - P_i(idle)) * compute_i, the energy of computing
    above idle; exact from the batch sizes (:func:`busy_energy`). None: its upper bound for this
    makespan, every participant computing until its gradient must leave (exact when the split
    is balanced; a board held back by a slower one's link computes less).
    """
    with np.errstate(divide="ignore", invalid="ignore"):  # rows that fit no allocation give inf; callers mask them
        return _row_figures(fa, stats, makespan, global_batch, count_idle=count_idle, rows=rows, busy_j=busy_j)


def busy_energy(fa: FleetArrays, masks: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row, sum over the participants of (active - idle power) x their compute time at ``k``, J."""
    compute = (fa.a - fa.up_s) + fa.c * k  # the intercept without the upload folded into ``a``
    busy: np.ndarray = np.where(masks, (fa.active_w - fa.idle_w) * compute, 0.0).sum(axis=1)
    return busy


def _row_figures(fa: FleetArrays, stats: SubsetStats, makespan: np.ndarray, global_batch: int | np.ndarray, *,
             count_idle: bool, rows: np.ndarray | slice, busy_j: np.ndarray | None) -> dict[str, np.ndarray]:
    exchange = np.maximum(stats.link_max[rows], fa.coord_s * stats.members[rows]) + fa.host_a + fa.host_c * global_batch
    step = makespan + exchange
    samples_per_s = fa.accumulate * global_batch / step  # a step is accumulate batches of the global batch
    epoch = fa.dataset_len / samples_per_s
    idle_out = stats.idle_out_w[rows] if count_idle else 0.0
    power = stats.active_w[rows] + idle_out + fa.host_active_w
    idle_in = fa.idle_w.sum() - stats.idle_out_w[rows]  # the participants' idle power
    # sum_i (active_i - idle_i) * compute_i with compute_i = makespan - up_i (every gradient ready together)
    if busy_j is None:
        busy_j = np.maximum((stats.active_w[rows] - idle_in) * makespan - stats.up_j[rows], 0.0)
    host_j = (fa.host_active_w - fa.host_idle_w) * (fa.host_a + fa.host_c * global_batch)  # a tail board's work
    mean_power = idle_in + (busy_j + stats.link_j[rows] + host_j) / step + idle_out + fa.host_idle_w
    energy = mean_power * epoch
    return {"compute_s": makespan, "exchange_s": exchange, "step_time_s": step, "samples_per_s": samples_per_s,
            "epoch_time_s": epoch, "power_w": power, "energy_per_epoch_j": energy, "edp_j_s": energy * epoch}


def exact_makespan(fa: FleetArrays, masks: np.ndarray, k: np.ndarray) -> np.ndarray:
    makespan: np.ndarray = np.where(masks, fa.a + fa.c * k, -np.inf).max(axis=1)
    return makespan


def all_subsets(n: int) -> np.ndarray:
    """Every non-empty subset of n boards as a (2^n - 1) x n bool mask; row r is the bits of r + 1."""
    rows = np.arange(1, 2**n, dtype=np.int64)
    return ((rows[:, None] >> np.arange(n)) & 1).astype(bool)
