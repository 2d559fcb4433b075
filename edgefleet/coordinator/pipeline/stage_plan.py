"""``--pipeline BOARD,CUT@BOARD,...``: which board trains which stage.

The first item is stage 0's board (it holds the data and runs ``training_step``); each later item
``CUT@BOARD`` cuts the model after layer ``CUT`` and puts the layers from there to the next cut on
``BOARD``. ``--pipeline p1,net.2@p2,net.8@p3`` trains LeNet-5's first convolution on p1, the layers
from there to the first dense layer on p2 and the rest on p3.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

MAX_STAGES = 64


@dataclass(frozen=True)
class StagePlan:
    """The stages' boards (stage order) and the S-1 cuts between them."""

    boards: tuple[str, ...]
    cuts: tuple[str, ...]

    def text(self) -> str:
        return ",".join([self.boards[0], *(f"{c}@{b}" for c, b in zip(self.cuts, self.boards[1:]))])


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
        raise ConfigError(f"--pipeline {text!r}: the first item is stage 0's board alone (it holds the data), {example}")
    boards, cuts = [items[0]], []
    for item in items[1:]:
        cut, at, board = item.partition("@")
        if not at or not cut.strip() or not board.strip():
            raise ConfigError(f"--pipeline {text!r}: {item!r} is not CUT@BOARD, {example}")
        cuts.append(cut.strip())
        boards.append(board.strip())
    twice = sorted({b for b in boards if boards.count(b) > 1})
    if twice:
        raise ConfigError(f"--pipeline {text!r}: board {twice[0]} holds two stages; each stage needs a board of its own")
    if len(boards) > MAX_STAGES:
        raise ConfigError(f"--pipeline {text!r}: {len(boards)} stages; at most {MAX_STAGES}")
    return StagePlan(boards=tuple(boards), cuts=tuple(cuts))


__all__ = ["MAX_STAGES", "StagePlan", "parse_stage_plan"]
