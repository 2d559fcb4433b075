"""Where each stage's gradient lands in the replica's vector, for a pipelined job's exchange (issue 35).

In a pipeline every board trains one stage, so its vector is that stage's trainable parameters'
gradient (in the stage's parameter order), not the whole model's. The coordinator's replica still
takes the whole model's gradient every step (it checkpoints and validates), so the exchange
scatters each board's vector into the replica's: :class:`PipelineLayout` says how, as runs of
(offset in the board's vector, offset in the replica's vector, count). It is built once by the run
(``coordinator.pipeline.piped_run``) and checked here once, so that the step's scatter
(``coordinator.exchange.modes.PipelineStages``) needs no check of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from edgefleet.coordinator.exchange.board_state import ExchangeError
from edgefleet.protocol.pipeline_command import stage_and_member
from edgefleet.protocol.stage_sync import StageSync

log = logging.getLogger(__name__)

Run = tuple[int, int, int]  # (offset in the board's vector, offset in the replica's vector, count)


@dataclass(frozen=True)
class PipelineLayout:
    """A pipelined job's boards (in board order, stage 0 first) and where their vectors' values go.

    ``elements[i]``: board ``i``'s vector length (its stage's trainable parameters); ``slots[i]``: its
    runs, covering its vector exactly once; ``full_elements``: the replica's vector length (its
    ``param_count``; values no board covers stay 0, an unused parameter); ``global_batch``: the samples
    of a step, which every stage handles (stage 0 holds the data); ``group``: stage 0's boards (the first
    ``group``), data-parallel among them: their vectors have the same length and slots, and their
    sample-weighted average lands there; a later stage may be a group too (``sizes``), its boards' average weighted by
    the samples each ran (``rows``). ``sync``: when the later stages' boards send their gradient, their state or
    nothing (``protocol.stage_sync``; None: their gradient every step).

    Raises:
        ExchangeError: a count out of range, a run outside either vector, two runs writing the same
            values of the replica's vector, or a board's runs not covering its vector exactly.
    """

    elements: list[int]
    slots: list[list[Run]]
    full_elements: int
    global_batch: int
    group: int = 1
    sync: StageSync | None = None
    sizes: tuple[int, ...] = ()  # each stage's boards, stage 0's first; (): ``group``, then one a later stage
    rows: tuple[int, ...] = ()   # each board's samples a step (``protocol.stage_routes``); (): a later board's N
    # each board's stage and its stage's first board, and whether its vector is averaged: asked per board per step
    _stages: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _averaged: tuple[bool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sizes:
            object.__setattr__(self, "sizes", (self.group,) + (1,) * (len(self.elements) - self.group))
        self._check_shape()
        places = [stage_and_member(list(self.sizes), board) for board in range(len(self.elements))]
        object.__setattr__(self, "_stages", tuple(stage for stage, _ in places))
        object.__setattr__(self, "_firsts", tuple(board - member for board, (_, member) in enumerate(places)))
        object.__setattr__(self, "_averaged", tuple(board < self.group or self.sizes[stage] > 1
                                                    for board, (stage, _) in enumerate(places)))
        self._check_boards()

    def _check_shape(self) -> None:
        if not self.elements:
            raise ExchangeError("the pipeline layout has no board: give each stage's board its vector length")
        if len(self.slots) != len(self.elements):
            raise ExchangeError(f"the pipeline layout gives {len(self.elements)} boards' vector lengths but "
                                f"{len(self.slots)} boards' slots: give one of each per board")
        if self.full_elements < 1 or self.global_batch < 1:
            raise ExchangeError(f"the pipeline layout's full_elements ({self.full_elements}) and global_batch "
                                f"({self.global_batch}) must be positive")
        if not 1 <= self.group < len(self.elements):
            raise ExchangeError(f"the pipeline layout's stage 0 group of {self.group} boards leaves no board for a later "
                                f"stage of its {len(self.elements)}")
        if self.sizes[0] != self.group or sum(self.sizes) != len(self.elements) or min(self.sizes) < 1:
            raise ExchangeError(f"the pipeline layout's stages of {list(self.sizes)} boards do not fit its "
                                f"{len(self.elements)} boards with stage 0's {self.group}")
        if self.rows and (len(self.rows) != len(self.elements) or min(self.rows) < 1):
            raise ExchangeError(f"the pipeline layout gives {len(self.rows)} boards' samples for {len(self.elements)} "
                                "boards: one figure of at least 1 each")

    def _check_boards(self) -> None:
        for board in range(len(self.elements)):
            first = self.first_of(board)
            if self.elements[board] != self.elements[first] or self.slots[board] != self.slots[first]:
                raise ExchangeError(f"the pipeline layout gives stage {self.stage_of(board)}'s board {board} other slots "
                                    f"than its board {first}: a stage's boards train the same layers")
        placed: list[tuple[int, int, int]] = []  # (start in the replica's vector, end, board)
        for board, (length, runs) in enumerate(zip(self.elements, self.slots)):
            _check_board(board, length, runs, self.full_elements)
            if board == self.first_of(board):  # a stage's boards share their slots: their average lands there
                placed += [(dst, dst + count, board) for _, dst, count in runs]
        placed.sort()
        for (_, end, board), (next_start, _, other) in pairwise(placed):
            if next_start < end:
                raise ExchangeError(f"the pipeline layout puts board {board}'s and board {other}'s values both at "
                                    f"offset {next_start} of the replica's vector: each value has one owner")

    @property
    def boards(self) -> int:
        return len(self.elements)

    def stage_of(self, board: int) -> int:
        """The stage of ``board``."""
        return self._stages[board]

    def first_of(self, board: int) -> int:
        """The first board of ``board``'s stage."""
        return self._firsts[board]

    def averaged(self, board: int) -> bool:
        """Whether ``board``'s vector is averaged with others (sample-weighted): stage 0's boards, and a later stage's
        group's; a later stage of one board sends its own stage's gradient (or its state, with a sparse sync)."""
        return self._averaged[board]

    def stage_boards(self, stage: int) -> range:
        """The boards of ``stage``."""
        start = sum(self.sizes[:stage])
        return range(start, start + self.sizes[stage])

    def max_state_elements(self, board: int) -> int:
        """The longest vector a later stage's ``board`` may send at a state step: its gradient and parameters (twice
        its elements), then its optimizer state, at most five values a parameter (Adam with amsgrad holds three
        tensors of a parameter's shape and a step count a tensor)."""
        return 7 * self.elements[board]

    def check_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """The job's batch sizes (by board index) must be the layout's: stage 0's boards the global batch between them,
        each at least one sample, the later stages' boards 0.

        Raises:
            ExchangeError: another number of boards, or another split, naming what it takes.
        """
        sizes, group = list(batch_sizes), self.group
        if (len(sizes) != self.boards or min(sizes[:group], default=0) < 1 or sum(sizes[:group]) != self.global_batch
                or any(sizes[group:])):
            raise ExchangeError(f"a pipelined job's batch sizes must give stage 0's {group} board(s) the global batch of "
                                f"{self.global_batch} between them and each of the {self.boards - group} later stages' "
                                f"boards 0, not {sizes}")


def _check_board(board: int, length: int, runs: Sequence[Run], full_elements: int) -> None:
    """Board ``board``'s runs lie inside both vectors and cover its ``length`` values exactly once."""
    if length < 0:
        raise ExchangeError(f"the pipeline layout gives board {board} a vector of {length} values: it must be 0 or more")
    covered = 0
    for src, dst, count in sorted(runs):
        if count < 1 or src < 0 or dst < 0 or src + count > length or dst + count > full_elements:
            raise ExchangeError(f"the pipeline layout's run {(src, dst, count)} of board {board} lies outside its vector "
                                f"of {length} values or the replica's of {full_elements}")
        if src != covered:
            raise ExchangeError(f"the pipeline layout's runs of board {board} "
                                f"{'overlap' if src < covered else 'leave a gap'} at offset {min(src, covered)} of its "
                                "vector: they must cover it exactly once")
        covered += count
    if covered != length:
        raise ExchangeError(f"the pipeline layout's runs of board {board} cover {covered} of its {length} values: "
                            "they must cover its vector exactly")


__all__ = ["PipelineLayout", "Run"]
