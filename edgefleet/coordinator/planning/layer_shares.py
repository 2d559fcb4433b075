"""The pipeline planner's per-layer figures from the boards' measured units (issue 35).

The planner's cost model gives every board one speed and every layer one forward and one
backward time at speed 1 (``planning.pipeline_cost``). The boards' profiles hold more: each board
timed each pipeline unit (``planning.unit_profile``). :func:`measured_layers` folds those into the
model's form:

* a layer's **share** of a sample's forward and backward on a board is its measured seconds per
  sample over the board's sum over all units; the planner takes the median share over the boards
  that timed it (normalised to sum to 1), and each board's own whole-step seconds per sample (its
  profiled line, which also holds the loss, the data and the loop) stay its speed;
* the bytes (parameters, the output crossing a cut, what is held for backward) are the same on
  every board of one job; the largest any board measured is taken.

How far the boards' own shares stray from the median is kept (:attr:`MeasuredLayers.spread`): the
one-speed-per-board model cannot show a board that is fast on convolutions and slow on the dense
layers, and the planner's notes say by how much that matters.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from edgefleet.coordinator.planning.profiles import FleetProfile
from edgefleet.coordinator.planning.unit_profile import UnitProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredLayers:
    """Per layer (unit), in forward order: the shares of a sample's work and the bytes, and who measured them."""

    forward_share: tuple[float, ...]        # of a sample's forward + backward over the whole model (all sum to 1)
    backward_share: tuple[float, ...]
    param_bytes: tuple[int, ...]
    activation_bytes_per_sample: tuple[int, ...]
    held_bytes_per_sample: tuple[int, ...]
    boards: tuple[str, ...]                 # the boards whose units these are
    fell_back: tuple[str, ...]              # the boards without them (an older agent; other cuts than the coordinator's)
    spread: float                           # the largest gap between a board's share of a layer and the median
    spread_board: str                       # the board with that gap ("" with one board)


def measured_layers(fleet: FleetProfile, cut_names: Sequence[str]) -> MeasuredLayers | None:
    """The layers' figures from the boards' units, the layers ending at ``cut_names`` and the model's last;
    None when no board holds units that match them."""
    timed = {board_id: board.units for board_id, board in fleet.boards.items() if _matches(board.units, cut_names)}
    if not timed:
        return None
    shares = {board_id: [(u.forward_s_per_sample / total, u.backward_s_per_sample / total) for u in units]
              for board_id, units in timed.items() for total in [sum(u.work_s_per_sample for u in units)]}
    count = len(cut_names) + 1
    forward = [statistics.median(s[i][0] for s in shares.values()) for i in range(count)]
    backward = [statistics.median(s[i][1] for s in shares.values()) for i in range(count)]
    scale = sum(forward) + sum(backward)
    forward, backward = [f / scale for f in forward], [b / scale for b in backward]
    gaps = {(board_id, i): abs(sum(s[i]) - forward[i] - backward[i]) for board_id, s in shares.items() for i in range(count)}
    worst = max(gaps, key=gaps.__getitem__)

    def largest(figure: str) -> tuple[int, ...]:
        return tuple(max(getattr(units[i], figure) for units in timed.values()) for i in range(count))

    return MeasuredLayers(forward_share=tuple(forward), backward_share=tuple(backward),
                          param_bytes=largest("param_bytes"),
                          activation_bytes_per_sample=(*largest("activation_bytes_per_sample")[:-1], 0),
                          held_bytes_per_sample=largest("held_bytes_per_sample"), boards=tuple(timed),
                          fell_back=tuple(b for b in fleet.boards if b not in timed),
                          spread=gaps[worst], spread_board=worst[0] if len(timed) > 1 else "")


def _matches(units: tuple[UnitProfile, ...], cut_names: Sequence[str]) -> bool:
    """Whether a board's units are the runs between these cuts (the same model and cutter as the coordinator's)."""
    return (len(units) == len(cut_names) + 1 and [u.name for u in units[:-1]] == list(cut_names)
            and sum(u.work_s_per_sample for u in units) > 0)


__all__ = ["MeasuredLayers", "measured_layers"]
