"""Robust aggregation rules (``--aggregate``): the step's gradient from the boards' so that one lying board
cannot steer it, at the cost of exactness. numpy in and out; no boards, no sockets.

Where the coordinator does not hold the boards' data (``--data-mode local``) it cannot audit them
(``coordinator.audit``); these rules bound what a board holding valid keys can do to a step instead,
as Flower's robust strategies do. Each changes the mathematics, even with every board honest:

* ``trimmed-mean``: per coordinate, drop the ``t`` largest and ``t`` smallest of the boards' values
  and average the rest, unweighted (``t = max(1, floor(TRIM * k))`` of ``k`` boards; with ``k``
  below 3 nothing can be dropped and it is the plain mean). Up to ``t`` lying boards move a
  coordinate no further than the honest values' range.
* ``median``: per coordinate, the boards' median, unweighted. Fewer than half the boards lying
  cannot move it outside the honest values' range.
* ``clip``: each board's gradient scaled down to at most :data:`CLIP_FACTOR` times the median of
  the boards' norms (factor 1: the median norm itself), then the sample-weighted mean. A huge
  gradient counts as no more than a typical honest one; a wrong one of honest norm (turned around)
  still counts with its weight.

What one liar costs in accuracy, against the same rule's run without it (issue 36: at most 1 point),
is tested in tests/coordinator/test_robust_accuracy.py and measured in bench/robust_accuracy.py. At
factor 3 a 2,000x gradient counted as three honest ones at every step, which cost LeNet-5 on digits
2.5 to 12.6 points; at the median norm it counts as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgefleet.protocol.aggregates import AGGREGATES
from edgefleet.protocol.half_cast import cast_into

TRIM = 0.2          # trimmed-mean: the share of boards dropped at each end of every coordinate (at least one)
CLIP_FACTOR = 1.0   # clip: a gradient's norm is cut to this many times the median of the boards' norms


def trimmed_count(boards: int) -> int:
    """How many values ``trimmed-mean`` drops at each end of a coordinate among ``boards`` boards."""
    return max(1, math.floor(TRIM * boards)) if boards >= 3 else 0


def stacked(vectors: Sequence[np.ndarray], elements: int) -> np.ndarray:
    """The first ``elements`` of each vector, widened to float32, one row per board."""
    out = np.empty((len(vectors), elements), dtype=np.float32)
    for row, vector in zip(out, vectors):
        if vector.dtype == np.float32:
            row[:] = vector[:elements]
        else:
            cast_into(row, vector[:elements])
    return out


def aggregate(rule: str, rows: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
    """Write ``rule``'s aggregate of ``rows`` (one board's gradient each, with its sample count) into ``out``."""
    k = rows.shape[0]
    if rule == "median":
        np.median(rows, axis=0, out=out)
    elif rule == "trimmed-mean":
        t = trimmed_count(k)
        kept = np.sort(rows, axis=0)[t:k - t] if t else rows
        np.mean(kept, axis=0, dtype=np.float32, out=out)
    elif rule == "clip":
        norms = np.linalg.norm(rows.astype(np.float64), axis=1)
        limit = CLIP_FACTOR * float(np.median(norms))
        scales = np.where(norms > limit, limit / np.maximum(norms, 1e-300), 1.0)
        weights = np.asarray(counts, dtype=np.float64) / float(sum(counts))
        np.dot((weights * scales).astype(np.float32), rows, out=out)
    else:
        raise ValueError(f"aggregate {rule!r} is not one of {', '.join(AGGREGATES)}")


__all__ = ["CLIP_FACTOR", "TRIM", "aggregate", "stacked", "trimmed_count"]
