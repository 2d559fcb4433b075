"""Pipeline stages (issue 35): the planner's inputs and its plans, and the inputs built from a profile file.

A pipeline plan cuts a model's layers into contiguous **stages**; each stage trains on a **group** of
one or more boards, data-parallel inside the group; the global batch is split into M **micro-batches**
run GPipe-style (every forward, every backward, one optimizer step after the flush) or 1F1B (each
stage starts a micro-batch's backward as soon as it can, so it holds fewer activations). The
arithmetic of a plan is ``planning.pipeline_cost``'s module doc; the search, ``planning.pipeline_search``.

Everything here is plain data: no torch, no sockets. :func:`problem_from_fleet` builds the inputs from
a profile file (a :class:`~edgefleet.coordinator.planning.profiles.FleetProfile` with its cuts, and
the per-layer figures the boards measured where they did) and says which figures the file does not
hold and what stands in for them.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

from edgefleet.coordinator.planning.cut_profile import FLOAT_BYTES, CutProfile
from edgefleet.coordinator.planning.layer_shares import MeasuredLayers, measured_layers
from edgefleet.coordinator.planning.profiles import REPROFILE_HINT, FleetProfile
from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b")
# What train runs (``agent.stage_runtime``): GPipe, which keeps any loss exact. 1F1B is costed for its memory only
# (docs/pipeline.md, "GPipe only").
TRAINED_SCHEDULES = ("gpipe",)
MAX_MICRO_BATCHES = 16           # the largest M the planner tries unless told otherwise
FORWARD_SHARE = 1 / 3            # a layer's forward against its forward + backward, where only the sum is known
NOTABLE_SPREAD = 0.05            # boards' measured shares of a layer this far apart (of a sample) are worth a note


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """One layer (or one run of layers the model can only be cut around) as the planner sees it."""

    name: str
    forward_s_per_sample: float       # on a board of speed 1.0 (a board of speed v takes 1/v of it)
    backward_s_per_sample: float      # ditto
    param_bytes: int                  # its parameters; their gradient and optimizer state scale with them
    activation_bytes_per_sample: int  # its output: what crosses a cut after it, forward (and its gradient back)
    held_bytes_per_sample: int        # what its forward keeps for its backward, per sample of a micro-batch

    def __post_init__(self) -> None:
        figures = (self.forward_s_per_sample, self.backward_s_per_sample, self.param_bytes,
                   self.activation_bytes_per_sample, self.held_bytes_per_sample)
        if not all(math.isfinite(x) and x >= 0 for x in figures):
            raise PlanError(f"layer {self.name!r}: every figure must be a finite number >= 0, got {figures}")

    @property
    def work_s_per_sample(self) -> float:
        """Forward plus backward of one sample on a board of speed 1.0."""
        return self.forward_s_per_sample + self.backward_s_per_sample


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineBoard:
    """One board as the pipeline planner sees it."""

    board_id: str
    speed: float                     # relative compute speed: a layer takes its s_per_sample / speed here
    memory_limit_bytes: int          # what a plan may use on it (its memory x the allowed fraction)
    link_up_bytes_per_s: float
    link_down_bytes_per_s: float
    active_power_w: float            # while computing
    idle_power_w: float              # while waiting or moving bytes
    base_memory_bytes: int = 0       # the training process without the model (runtime, data loader)
    overhead_s: float = 0.0          # the board's fixed cost per step (its whole-step intercept), whatever the batch

    def __post_init__(self) -> None:
        positive = (self.speed, self.memory_limit_bytes, self.link_up_bytes_per_s, self.link_down_bytes_per_s)
        rest = (self.active_power_w, self.idle_power_w, self.base_memory_bytes, self.overhead_s)
        if not all(math.isfinite(x) and x > 0 for x in positive) or not all(math.isfinite(x) and x >= 0 for x in rest):
            raise PlanError(f"board {self.board_id!r}: speed, memory limit and link rates must be > 0 and power, base "
                            f"memory and overhead >= 0; got {positive + rest}")
        if self.active_power_w < self.idle_power_w:
            raise PlanError(f"board {self.board_id!r}: active power {self.active_power_w} W below its idle power "
                            f"{self.idle_power_w} W; give the draw while computing as the active power")

    @property
    def kind(self) -> tuple[float, ...]:
        """Every figure but the id: boards of one kind are interchangeable in a plan."""
        return (self.speed, self.memory_limit_bytes, self.link_up_bytes_per_s, self.link_down_bytes_per_s,
                self.active_power_w, self.idle_power_w, self.base_memory_bytes, self.overhead_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineProblem:
    """What to plan: the layers, the boards, the global batch and the limits."""

    layers: tuple[LayerCost, ...]
    boards: tuple[PipelineBoard, ...]
    global_batch: int                        # samples per optimizer step, over all micro-batches
    dataset_len: int                         # samples per epoch
    optimizer_bytes_per_param_byte: float = 1.0   # optimizer state: plain SGD 0, SGD with momentum 1, Adam 2
    coordinator_link_bytes_per_s: float | None = None  # the exchange endpoint's link (groups' gradients); None: ample
    max_power_w: float | None = None         # the peak draw a plan may reach (--max-power)
    count_idle: bool = False                 # charge the idle power of the boards a plan leaves out
    micro_batches: tuple[int, ...] = ()      # the M to try; (): the divisors of global_batch up to MAX_MICRO_BATCHES
    schedules: tuple[str, ...] = SCHEDULES
    max_later_group: int | None = None       # the most boards a stage after the first may have (None: any)

    def __post_init__(self) -> None:
        if not self.layers or not self.boards:
            raise PlanError(f"a pipeline needs layers and boards; got {len(self.layers)} layers and "
                            f"{len(self.boards)} boards")
        ids = [b.board_id for b in self.boards]
        if len(set(ids)) != len(ids):
            raise PlanError(f"board ids must be unique; got {ids}")
        if self.global_batch < 1 or self.dataset_len < 1:
            raise PlanError(f"global batch {self.global_batch} and dataset length {self.dataset_len} must be >= 1")
        bad = [m for m in self.micro_batches if m < 1 or self.global_batch % m]
        if bad:
            raise PlanError(f"micro-batch counts {bad} do not divide the global batch {self.global_batch}; "
                            f"pick divisors of it")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise PlanError(f"schedules {list(self.schedules)}: each must be one of {', '.join(SCHEDULES)}")
        if self.max_later_group is not None and self.max_later_group < 1:
            raise PlanError(f"max_later_group {self.max_later_group} must be >= 1 (or None: any group)")
        if self.optimizer_bytes_per_param_byte < 0 or (self.max_power_w is not None and self.max_power_w <= 0):
            raise PlanError(f"optimizer bytes per parameter byte {self.optimizer_bytes_per_param_byte} must be >= 0 "
                            f"and --max-power {self.max_power_w} > 0")

    @property
    def micro_batch_counts(self) -> tuple[int, ...]:
        """The M to try."""
        if self.micro_batches:
            return tuple(sorted(set(self.micro_batches)))
        return tuple(m for m in range(1, min(MAX_MICRO_BATCHES, self.global_batch) + 1) if self.global_batch % m == 0)

    def board(self, board_id: str) -> PipelineBoard:
        for b in self.boards:
            if b.board_id == board_id:
                return b
        raise PlanError(f"no board {board_id!r} in the pipeline problem; it has {', '.join(b.board_id for b in self.boards)}")


@dataclass(frozen=True, slots=True)
class StageSpec:
    """The choice a plan makes for one stage: layers [first_layer, stop_layer) on these boards."""

    first_layer: int
    stop_layer: int
    boards: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One stage of a costed plan."""

    first_layer: int
    stop_layer: int                      # exclusive
    boards: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]   # per board, its samples of each micro-batch
    micro_batch_s: float                 # its slowest board's forward of a micro-batch and its share of the backward
    allreduce_s: float                   # its group's gradient exchange after the flush (0 for one board)
    in_flight: int                       # micro-batches whose activations it holds at once


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardMemory:
    """What a plan puts in one board's memory, against what it may use."""

    board_id: str
    used_bytes: int
    limit_bytes: int

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.limit_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkLoad:
    """The bytes one board's link carries per optimizer step: activations, their gradients and its group's exchange."""

    board_id: str
    up_bytes: int
    down_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePlan:
    """A costed plan (``planning.pipeline_cost``): feasible when ``constraint`` is empty."""

    stages: tuple[Stage, ...]
    micro_batches: int
    schedule: str
    global_batch: int
    step_time_s: float
    bubble_fraction: float               # (S - 1) / (M + S - 1): the share of the pipeline a stage idles
    power_w: float                       # peak draw: every taking-part board computing (+ the others idle, if counted)
    energy_per_step_j: float
    epoch_time_s: float
    energy_per_epoch_j: float
    edp_j_s: float
    memory: tuple[BoardMemory, ...]      # per taking-part board, in stage order
    links: tuple[LinkLoad, ...]          # ditto
    constraint: str = ""                 # "", "group", "batch", "memory" or "power"
    ruled_out: str = ""                  # why, with the figures

    @property
    def feasible(self) -> bool:
        return not self.constraint

    @property
    def specs(self) -> tuple[StageSpec, ...]:
        return tuple(StageSpec(s.first_layer, s.stop_layer, s.boards) for s in self.stages)

    def board_batches(self) -> dict[str, int]:
        """Each taking-part board's samples per optimizer step (its micro-batch share x M)."""
        return {b: m * self.micro_batches for s in self.stages for b, m in zip(s.boards, s.micro_batch_sizes)}

    def objective_value(self, objective: str) -> float:
        """The figure ``objective`` (time, energy, edp; see ``planning.objectives``) minimises."""
        return {"time": self.epoch_time_s, "energy": self.energy_per_epoch_j, "edp": self.edp_j_s,
                "power": self.power_w}[objective]


def problem_from_fleet(fleet: FleetProfile, *, global_batch: int, max_memory_fraction: float = 0.9,
                       optimizer_bytes_per_param_byte: float = 1.0, max_power_w: float | None = None,
                       count_idle: bool = False) -> tuple[PipelineProblem, tuple[str, ...]]:
    """The pipeline problem for a profiled fleet, with what the profile lacks and what stands in for it.

    The layers are the runs of the model between its admissible cuts (``FleetProfile.cuts``): a
    pipeline can only be cut where layer placement can. A board's speed is 1 / its profiled seconds
    per sample. A run's share of that time, its forward against its backward, and its bytes are
    what the boards measured of it (``planning.layer_shares``: the median share over the boards that
    timed their units); a profile without such figures (an older agent's) gets stand-ins: the run's
    share of the model's floating-point operations, forward : backward 1 : 2, and the boards' memory
    per sample split by the same shares.

    Returns:
        The problem and one line per stand-in (figures the profile file does not hold), naming the
        boards that fell back to them.

    Raises:
        PlanError: the profile holds no cut of the model (the fix: profile again).
    """
    if not fleet.cuts:
        raise PlanError("the profile file holds no cut of this model, so no pipeline can be planned: "
                        f"{REPROFILE_HINT} (it profiles every admissible cut)")
    cuts = sorted(fleet.cuts, key=lambda c: (c.head_share, c.head_params))
    measured = measured_layers(fleet, [c.name for c in cuts])
    layers, missing = _measured(cuts, measured) if measured else _stand_ins(fleet, cuts)
    total_param_bytes = sum(layer.param_bytes for layer in layers)
    static = total_param_bytes * (2 + optimizer_bytes_per_param_byte)
    boards = tuple(PipelineBoard(board_id=b.board_id, speed=1.0 / b.time_fit.slope,
                                 memory_limit_bytes=math.floor(b.memory_total_bytes * max_memory_fraction),
                                 link_up_bytes_per_s=1.0 / b.up_s_per_byte, link_down_bytes_per_s=1.0 / b.down_s_per_byte,
                                 active_power_w=max(b.active_power_w, b.idle_power_w), idle_power_w=b.idle_power_w,
                                 base_memory_bytes=max(round(b.memory_fit.intercept - static), 0),
                                 overhead_s=b.time_fit.intercept) for b in fleet.boards.values())
    problem = PipelineProblem(layers=layers, boards=boards, global_batch=global_batch,
                              dataset_len=fleet.dataset_len, optimizer_bytes_per_param_byte=optimizer_bytes_per_param_byte,
                              coordinator_link_bytes_per_s=fleet.coordinator_link_bytes_per_s, max_power_w=max_power_w,
                              count_idle=count_idle)
    missing += (
        "a micro-batch's own fixed cost at a stage: 0.08 of its board's whole-step intercept each way, fitted on the lab "
        "(not in the profile); "
        "stage 0 pays 0.1 of its boards' whole-step intercept plus its share of the parameters",
        "the optimizer's state: "
        f"{optimizer_bytes_per_param_byte:g} x the parameters (not in the profile; pass the job's optimizer)",
    )
    return problem, missing


def _names(cuts: list[CutProfile]) -> list[str]:
    """A run is named by the cut that ends it; the last one, "output"."""
    return [c.name for c in cuts] + ["output"]


def _measured(cuts: list[CutProfile], measured: MeasuredLayers) -> tuple[tuple[LayerCost, ...], tuple[str, ...]]:
    """The layers from the boards' units, and the lines saying what is still assumed and which boards fell back."""
    layers = tuple(LayerCost(name=name, forward_s_per_sample=fwd, backward_s_per_sample=bwd, param_bytes=params,
                             activation_bytes_per_sample=act, held_bytes_per_sample=held)
                   for name, fwd, bwd, params, act, held in zip(
                       _names(cuts), measured.forward_share, measured.backward_share, measured.param_bytes,
                       measured.activation_bytes_per_sample, measured.held_bytes_per_sample))
    spread = (f"; the boards' own shares of a layer differ from the median by up to {measured.spread:.0%} of a sample "
              f"({measured.spread_board})" if measured.spread_board and measured.spread >= NOTABLE_SPREAD else "")
    notes: tuple[str, ...] = (
        f"per-layer times on each board: its profiled seconds per sample x the layer's share of it, measured on "
        f"{len(measured.boards)} board(s) (the median share; one speed per board){spread}",)
    if measured.fell_back:
        notes += (f"boards {', '.join(measured.fell_back)} hold no per-layer figures for these cuts (profiled by an "
                  "older agent, or by other model code): the measured boards' shares and bytes stand in",)
    return layers, notes


def _stand_ins(fleet: FleetProfile, cuts: list[CutProfile]) -> tuple[tuple[LayerCost, ...], tuple[str, ...]]:
    """The layers from the coordinator's operation counts, for a profile without per-layer figures."""
    total_params = cuts[0].head_params + cuts[0].tail_params
    per_sample = statistics.median(b.memory_fit.slope for b in fleet.boards.values())
    layers, share_before, params_before = [], 0.0, 0
    for cut, name in zip([*cuts, None], _names(cuts)):
        share = (cut.head_share if cut else 1.0) - share_before
        params = (cut.head_params if cut else total_params) - params_before
        layers.append(LayerCost(name=name, forward_s_per_sample=share * FORWARD_SHARE,
                                backward_s_per_sample=share * (1 - FORWARD_SHARE), param_bytes=max(params, 0) * FLOAT_BYTES,
                                activation_bytes_per_sample=cut.boundary_elements * FLOAT_BYTES if cut else 0,
                                held_bytes_per_sample=round(per_sample * share)))
        if cut:
            share_before, params_before = cut.head_share, cut.head_params
    boards = ", ".join(fleet.boards)
    notes = (
        f"per-layer times on each board ({boards}: no per-layer figures in the profile): each board's profiled "
        "seconds per sample scaled by the layer's share of the model's operations (measured on the coordinator)",
        f"forward against backward: taken as {FORWARD_SHARE:.2f} : {1 - FORWARD_SHARE:.2f} of each layer's time",
        "per-layer memory held for backward: the boards' median memory per sample "
        f"({per_sample / 1e6:.2f} MB) split by each layer's share of the operations",
    )
    return tuple(layers), notes


__all__ = ["FORWARD_SHARE", "MAX_MICRO_BATCHES", "SCHEDULES", "BoardMemory", "LayerCost", "LinkLoad",
           "PipelineBoard", "PipelinePlan", "PipelineProblem", "Stage", "StageSpec", "problem_from_fleet"]
