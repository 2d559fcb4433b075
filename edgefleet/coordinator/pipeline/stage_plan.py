"""``--pipeline BOARD,CUT@BOARD,...``: which board trains which stage.

The first item is stage 0's board, or boards joined by ``+`` (they hold the data and run
``training_step``, data-parallel among them); each later item ``CUT@BOARD`` cuts the model after
layer ``CUT`` and puts the layers from there to the next cut on ``BOARD``. ``--pipeline
p1,net.2@p2,net.8@p3`` trains LeNet-5's first convolution on p1, the layers from there to the
first dense layer on p2 and the rest on p3; ``--pipeline p1+p2+p3,net.6@p4`` trains its
convolutions on p1, p2 and p3, each on its slice of the batch, and its dense layers on p4 (layer
placement with the tail on a board). A later stage may be a group too: ``--pipeline p1,net.6@p2+p3``
shares each step's micro-batches out between p2 and p3 (``protocol.stage_routes``), data-parallel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.pipeline_command import stage_and_member

log = logging.getLogger(__name__)

MAX_STAGES = 64


@dataclass(frozen=True)
class StagePlan:
    """The pipeline's boards stage by stage (stage 0's group of ``group``, then each later stage's: one board, or
    ``sizes`` says how many) and the S-1 cuts."""

    boards: tuple[str, ...]
    cuts: tuple[str, ...]
    group: int = 1
    sizes: tuple[int, ...] = ()  # each stage's boards, stage 0's first; (): one a later stage

    def __post_init__(self) -> None:
        if not self.sizes:
            object.__setattr__(self, "sizes", (self.group,) + (1,) * (len(self.boards) - self.group))

    @property
    def hosts(self) -> tuple[str, ...]:
        """The later stages' first boards, in stage order (each later stage's one board, where none is a group)."""
        return tuple(self.stage_boards(k)[0] for k in range(1, len(self.sizes)))

    @property
    def later_groups(self) -> bool:
        """Whether a stage after the first has more than one board."""
        return any(size > 1 for size in self.sizes[1:])

    def stage_boards(self, stage: int) -> tuple[str, ...]:
        """The boards of ``stage``."""
        start = sum(self.sizes[:stage])
        return self.boards[start:start + self.sizes[stage]]

    def stage_of(self, board_index: int) -> int:
        """The stage of the ``board_index``-th of :attr:`boards`."""
        return stage_and_member(list(self.sizes), board_index)[0]

    def text(self) -> str:
        return ",".join(["+".join(self.stage_boards(0)),
                         *(f"{c}@{'+'.join(self.stage_boards(k))}" for k, c in enumerate(self.cuts, start=1))])


def parse_stage_plan(text: str) -> StagePlan:
    """Read ``--pipeline``.

    Raises:
        ConfigError: fewer than two stages, an item that is not ``CUT@BOARD`` after the first, a board twice.
    """
    items = [item.strip() for item in text.split(",")]
    example = "e.g. --pipeline p1,net.2@p2,net.8@p3"
    if len(items) < 2 or any(not item for item in items):
        raise ConfigError(f"--pipeline {text!r}: give stage 0's board, then CUT@BOARD for each later stage, {example}")
    if "@" in items[0]:
        raise ConfigError(f"--pipeline {text!r}: the first item is stage 0's board (or boards, joined by +) without a "
                          f"cut (it holds the data), {example}")
    group = [b.strip() for b in items[0].split("+")]
    if any(not b for b in group):
        raise ConfigError(f"--pipeline {text!r}: stage 0's boards are joined by + with no empty name, e.g. p1+p2")
    boards, cuts, sizes = list(group), [], [len(group)]
    for item in items[1:]:
        cut, at, board = item.partition("@")
        members = [b.strip() for b in board.split("+")]
        if not at or not cut.strip() or not all(members):
            raise ConfigError(f"--pipeline {text!r}: {item!r} is not CUT@BOARD (or CUT@BOARD+BOARD for a group), "
                              f"{example}")
        cuts.append(cut.strip())
        boards += members
        sizes.append(len(members))
    twice = sorted({b for b in boards if boards.count(b) > 1})
    if twice:
        raise ConfigError(f"--pipeline {text!r}: board {twice[0]} holds two stages; each stage needs a board of its own")
    if len(cuts) + 1 > MAX_STAGES or max(sizes) > MAX_STAGES:
        raise ConfigError(f"--pipeline {text!r}: {len(cuts) + 1} stages and {max(sizes)} boards in a stage; at most "
                          f"{MAX_STAGES} of each")
    return StagePlan(boards=tuple(boards), cuts=tuple(cuts), group=len(group), sizes=tuple(sizes))


__all__ = ["MAX_STAGES", "StagePlan", "parse_stage_plan"]
