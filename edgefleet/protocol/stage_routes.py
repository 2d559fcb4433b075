"""Which board of each pipeline stage handles each unit of a step (issue 35): the routes of a pipeline with groups.

A step's **units** are its micro-batches as stage 0 makes them: each board ``src`` of stage 0's group splits its
slice of the global batch into micro-batches (:func:`micro_rows`), and a unit ``(src, micro)`` keeps its samples
together through every stage. A later stage may be a **group** of boards, data-parallel among them: each unit goes to
one of them, so each board of the group runs its stage's layers on some of the step's units, and the group's
gradients are averaged by the exchange, weighted by the samples each board ran (``agent.stage_runtime``).

The routes are a function of the plan alone (the stages' board counts, stage 0's slices and M), computed alike by the
coordinator and every board from the signed train command, so no frame says where a unit goes: each unit goes to the
board of the group that has run the fewest samples so far (the first of them on a tie), units in order (by source
board, then micro-batch). A stage of one board takes every unit.

Pure Python (no torch or numpy): the coordinator's exchange and the boards' links both use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Unit = tuple[int, int, int]  # (source board of stage 0, micro-batch, its samples)


def micro_rows(rows: int, micro_batches: int) -> list[int]:
    """The samples of each micro-batch of a batch of ``rows``: as equal as can be, the larger first
    (``torch.tensor_split``'s split); fewer micro-batches than asked when the batch is smaller."""
    count = max(1, min(micro_batches, rows))
    base, extra = divmod(rows, count)
    return [base + 1] * extra + [base] * (count - extra)


@dataclass(frozen=True)
class StageRoutes:
    """Every unit of a step, and the board of each stage that handles it.

    Args:
        sizes: the boards of each stage, stage 0's group first (S entries, each at least 1).
        batch_sizes: stage 0's boards' slices of the global batch (``sizes[0]`` entries, each at least 1).
        micro_batches: M, the micro-batches each slice is split into.

    Raises:
        ValueError: sizes or slices that do not fit together.
    """

    sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    micro_batches: int
    _members: list[dict[tuple[int, int], int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ValueError(f"a pipeline's stages {list(self.sizes)} need at least two stages of at least one board")
        if len(self.batch_sizes) != self.sizes[0] or min(self.batch_sizes) < 1:
            raise ValueError(f"stage 0's {self.sizes[0]} board(s) need a slice of at least one sample each, not "
                             f"{list(self.batch_sizes)}")
        if self.micro_batches < 1:
            raise ValueError(f"{self.micro_batches} micro-batches: at least 1")
        members: list[dict[tuple[int, int], int]] = []
        for stage, size in enumerate(self.sizes):
            taken = [0] * size
            chosen: dict[tuple[int, int], int] = {}
            for src, micro, rows in self.units():
                member = src if stage == 0 else min(range(size), key=lambda m: (taken[m], m))
                taken[member] += rows
                chosen[(src, micro)] = member
            members.append(chosen)
        object.__setattr__(self, "_members", members)

    @property
    def stages(self) -> int:
        return len(self.sizes)

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    def units(self) -> list[Unit]:
        """Every unit of a step, by source board then micro-batch."""
        return [(src, micro, rows) for src, slice_rows in enumerate(self.batch_sizes)
                for micro, rows in enumerate(micro_rows(slice_rows, self.micro_batches))]

    def member(self, stage: int, src: int, micro: int) -> int | None:
        """The board of ``stage`` (its place in the stage's group) that handles unit ``(src, micro)``; None: no such
        unit."""
        return self._members[stage].get((src, micro))

    def units_of(self, stage: int, member: int) -> list[Unit]:
        """The units board ``member`` of ``stage`` handles, in order."""
        return [u for u in self.units() if self._members[stage][(u[0], u[1])] == member]

    def rows_of(self, stage: int, member: int) -> int:
        """The samples board ``member`` of ``stage`` runs a step."""
        return sum(rows for _, _, rows in self.units_of(stage, member))

    def micro_count(self, src: int) -> int:
        """How many micro-batches source board ``src`` splits its slice into."""
        return len(micro_rows(self.batch_sizes[src], self.micro_batches))


def stage_routes(sizes: Sequence[int], batch_sizes: Sequence[int], micro_batches: int) -> StageRoutes:
    """:class:`StageRoutes` of the plan (raises ValueError as it does)."""
    return StageRoutes(tuple(int(s) for s in sizes), tuple(int(b) for b in batch_sizes), int(micro_batches))


__all__ = ["StageRoutes", "Unit", "micro_rows", "stage_routes"]
