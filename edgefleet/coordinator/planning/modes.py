"""Training modes the planner can choose: today's exact exchange, and modes that send fewer bytes.

A mode changes what a step puts on the wire and, for some, what it computes; the cost model
(``cost_model`` module doc) charges a candidate in mode m as if the gradient were

    wire_bytes(m) = G * wire_fraction + round_bytes        [bytes per step, each way]

and its compute line were ``compute_scale`` times the profiled one. Every link figure of the cost
model (each board's upload folded into its finish time, the average's download, the coordinator's
broadcast, the link energy) scales with these bytes, so a mode needs no formula of its own beyond
these three numbers.

* ``exact``: every step sends the full gradient up and the average down (1, 0, 1). The
  mathematics equal single-process training on the global batch.
* local SGD every H steps (``--sync-every H``): each board steps on its own gradients and the
  parameters' delta (the gradient's size) goes up and down only every H steps; a small exchange
  round of a few dozen bytes still runs every step. Amortised: (1/H, :data:`ROUND_BYTES`, 1).
  The figure is the steady state: the warm-up of exact steps (``--sync-warmup``, by default the
  first epoch) runs at the exact mode's speed and is not in it; nor is the small round's latency
  (the model counts bytes, and a few dozen bytes cost a link next to nothing), nor the average at
  every epoch's end (at most one more exchange per epoch). Spreading the average's transfer over
  H steps is the mean when every board's gradient is ready together (the allocation aims at
  that); a board on a slow link that waits less on the other H - 1 steps makes the real mean a
  little longer.

Adding a mode is one constructor here (its three numbers, its ``train`` flags and JobSpec
keywords, its words) and, if the planner should try it by itself, an entry in
:func:`candidate_modes`. Modes that overlap the exchange with backward need a formula of their
own in the cost model (a max instead of a sum), not just fewer bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)

ROUND_BYTES = 64                 # local SGD's per-step round, each way: a few dozen bytes of header and counts
LOCAL_SGD_EVERY = (2, 4, 8)      # the periods --allow-inexact lets the planner try
INEXACT_MARGIN = 0.10            # an inexact mode must beat the best exact candidate by this (search module doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingMode:
    """How the boards exchange: what the cost model charges and what ``train`` is told.

    Attributes:
        name: Short id, in tables and JSON: ``exact``, ``local-sgd-4``.
        description: In words, for the chosen line: ``local SGD, averaging every 4 steps``.
        exact: The mathematics equal single-process training on the global batch.
        wire_fraction: Full-size bytes per step on each link, as a fraction of the exact gradient's (amortised).
        round_bytes: Fixed bytes per step each way besides them (a mode's small per-step round).
        compute_scale: The step's compute against the profiled one (1: unchanged).
        departure: How far the mathematics strays from exact (0 exact; local SGD 1 - 1/H): of near
            ties among inexact candidates the least departing is chosen.
        train_flags: The ``train`` flags that run the mode (() for exact).
        job_options: The JobSpec keywords that run it ({} for exact).
    """

    name: str
    description: str
    exact: bool = True
    wire_fraction: float = 1.0
    round_bytes: int = 0
    compute_scale: float = 1.0
    departure: float = 0.0
    train_flags: tuple[str, ...] = ()
    job_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0.0 < self.wire_fraction <= 1.0 and self.round_bytes >= 0 and self.compute_scale > 0
                and 0.0 <= self.departure < 1.0):
            raise PlanError(f"training mode {self.name!r}: wire_fraction {self.wire_fraction:g} must be in (0, 1], "
                            f"round_bytes {self.round_bytes} >= 0, compute_scale {self.compute_scale:g} > 0, "
                            f"departure {self.departure:g} in [0, 1)")
        if self.exact and (self.departure or self.job_options):
            raise PlanError(f"training mode {self.name!r} is exact but departs from exact or sets {dict(self.job_options)}")

    def wire_bytes(self, grad_bytes: int) -> float:
        """Bytes per step each way on a board's link, amortised (module doc)."""
        return grad_bytes * self.wire_fraction + self.round_bytes

    @property
    def sync_every(self) -> int:
        """Steps between full exchanges (1 for exact): what a step-time measurement must average over."""
        return int(self.job_options.get("sync_every", 1))

    @property
    def headline(self) -> str:
        """``"local SGD, averaging every 4 steps: changes the mathematics"``, or ``"exact"``."""
        return self.description if self.exact else f"{self.description}: changes the mathematics"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "exact": self.exact,
                "wire_fraction": self.wire_fraction, "round_bytes": self.round_bytes,
                "compute_scale": self.compute_scale, "train_flags": list(self.train_flags),
                "job_options": dict(self.job_options)}


EXACT = TrainingMode(name="exact", description="exact (every step averages the gradients)")


def local_sgd(every: int) -> TrainingMode:
    """Local SGD averaging every ``every`` steps (``train --sync-every``); module doc for its cost.

    Raises:
        PlanError: ``every`` is not a whole number of at least 2.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise PlanError(f"local SGD averages every H steps with H a whole number >= 2, not {every!r} "
                        "(H = 1 is the exact mode)")
    return TrainingMode(name=f"local-sgd-{every}", description=f"local SGD, averaging every {every} steps", exact=False,
                        wire_fraction=1.0 / every, round_bytes=ROUND_BYTES, departure=1.0 - 1.0 / every,
                        train_flags=("--sync-every", str(every)), job_options={"sync_every": every})


def candidate_modes(*, allow_inexact: bool) -> tuple[TrainingMode, ...]:
    """The modes a plan tries: exact alone, or with ``allow_inexact`` local SGD every 2, 4 and 8 steps too."""
    return (EXACT, *(local_sgd(h) for h in LOCAL_SGD_EVERY)) if allow_inexact else (EXACT,)


__all__ = ["EXACT", "INEXACT_MARGIN", "LOCAL_SGD_EVERY", "ROUND_BYTES", "TrainingMode",
           "candidate_modes", "local_sgd"]
