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
* DiLoCo every H steps (``--sync-every H --outer-optimizer diloco``, :func:`diloco`): local SGD whose
  average goes through an outer SGD with Nesterov momentum (``protocol.outer_optimizer``). The
  boards and the replica compute the outer step alike from the same average, so its bytes are local
  SGD's for the same H: (1/H, :data:`ROUND_BYTES`, 1). With ``--allow-inexact --outer-optimizer
  diloco`` the planner weighs it at :data:`DILOCO_EVERY` beside local SGD: at a period local SGD
  also has, the two cost the same and the tie goes to local SGD (listed first); the longer period
  is DiLoCo's own. Opt-in, because its accuracy depends on the model more than local SGD's does: in
  bench/inexact_accuracy.py (8 boards, 3 seeds) LeNet-5 ended 0.5 points below exact at H = 16,
  resnet_small 6.7 below.

* layer placement after a cut (``--placement CUT``, :func:`placed`): the boards train the layers
  before the cut and send their activations; the coordinator trains the rest over the whole global
  batch (``workloads.layer_cut``). The same mathematics as exact. On each link a step moves the
  head's gradient (``wire_fraction`` = the head's parameters over the model's) plus, per sample,
  the activation and the tail output's gradient (``per_sample_bytes`` each way); a board computes
  the head's share of the per-sample compute (``sample_scale``, measured on the coordinator:
  ``planning.layer_profile``) and all of its fixed cost per step (Lightning's loop does not shrink
  with the model); and every step waits for the tail on the coordinator, ``host_a_s + host_c_s *
  N`` for a global batch of N, plus the activations over the coordinator's own link.

Adding a mode is one constructor here (its three numbers, its ``train`` flags and JobSpec
keywords, its words) and, if the planner should try it by itself, an entry in
:func:`candidate_modes`. Modes that overlap the exchange with backward need a formula of their
own in the cost model (a max instead of a sum), not just fewer bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import PlanError
from edgefleet.protocol.outer_optimizer import AVERAGE, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DILOCO, outer_problem

log = logging.getLogger(__name__)

ROUND_BYTES = 64                 # local SGD's per-step round, each way: a few dozen bytes of header and counts
LOCAL_SGD_EVERY = (2, 4, 8)      # the periods --allow-inexact lets the planner try
DILOCO_EVERY = (8, 16)           # ... and DiLoCo's, when asked to weigh it (module doc)
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
        sample_scale: The per-sample compute against the profiled one, on top of ``compute_scale``
            (layer placement: the head's share; its fixed cost per step stays).
        per_sample_bytes: Bytes per sample on each link, each way, besides the fixed ones (layer
            placement: the activation up and its gradient down, the output down and its gradient up).
        host_a_s, host_c_s: A step's serial work on the coordinator, ``host_a_s + host_c_s * N``
            for a global batch of N (layer placement: the tail's forward and backward).
        why: Why it may win, in words, for the plan's chosen line ("").
        tail_board: Layer placement with the tail on this board (``--placement CUT@BOARD``, a two-stage pipeline):
            the host figures are the board's own (its tail compute, every sample's activations over its link), the
            board takes no part in the head's data parallelism, and its power is the host's (``host_idle_w``,
            ``host_active_w``); "" for the coordinator's tail (whose power the plan does not count).
        host_max_batch: The largest global batch the tail's host holds in memory (0: no limit known).
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
    sample_scale: float = 1.0
    per_sample_bytes: float = 0.0
    host_a_s: float = 0.0
    host_c_s: float = 0.0
    why: str = ""
    tail_board: str = ""
    host_idle_w: float = 0.0
    host_active_w: float = 0.0
    host_max_batch: int = 0

    def __post_init__(self) -> None:
        if not (0.0 < self.wire_fraction <= 1.0 and self.round_bytes >= 0 and self.compute_scale > 0
                and 0.0 <= self.departure < 1.0):
            raise PlanError(f"training mode {self.name!r}: wire_fraction {self.wire_fraction:g} must be in (0, 1], "
                            f"round_bytes {self.round_bytes} >= 0, compute_scale {self.compute_scale:g} > 0, "
                            f"departure {self.departure:g} in [0, 1)")
        if self.exact and (self.departure or set(self.job_options) - EXACT_JOB_OPTIONS):
            raise PlanError(f"training mode {self.name!r} is exact but departs from exact or sets {dict(self.job_options)}")
        if not (self.sample_scale > 0 and self.per_sample_bytes >= 0 and self.host_a_s >= 0 and self.host_c_s >= 0):
            raise PlanError(f"training mode {self.name!r}: sample_scale {self.sample_scale:g} must be > 0, per_sample_bytes, "
                            "host_a_s and host_c_s >= 0")

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

    @property
    def placement(self) -> str:
        """The cut of a layer placement mode ("" for any other)."""
        return str(self.job_options.get("placement", ""))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "exact": self.exact,
                "wire_fraction": self.wire_fraction, "round_bytes": self.round_bytes,
                "compute_scale": self.compute_scale, "train_flags": list(self.train_flags),
                "job_options": dict(self.job_options), "sample_scale": self.sample_scale,
                "per_sample_bytes": self.per_sample_bytes, "host_a_s": self.host_a_s, "host_c_s": self.host_c_s,
                **({"tail_board": self.tail_board} if self.tail_board else {})}


EXACT_JOB_OPTIONS = frozenset({"placement"})  # the JobSpec keywords an exact mode may set (the mathematics stay)
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


def diloco(every: int, *, lr: float = DEFAULT_OUTER_LR, momentum: float = DEFAULT_OUTER_MOMENTUM) -> TrainingMode:
    """DiLoCo every ``every`` steps (``train --sync-every H --outer-optimizer diloco``): local SGD's bytes, module doc.

    Raises:
        PlanError: ``every`` is not a whole number of at least 2, or the outer settings are out of range.
    """
    base = local_sgd(every)
    problem = outer_problem(DILOCO, lr, momentum)
    if problem:
        raise PlanError(problem)
    flags: tuple[str, ...] = ("--sync-every", str(every), "--outer-optimizer", DILOCO)
    if (lr, momentum) != (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM):
        flags += ("--outer-lr", f"{lr:g}", "--outer-momentum", f"{momentum:g}")
    return dataclasses.replace(base, name=f"diloco-{every}", description=f"DiLoCo, outer Nesterov SGD every {every} steps",
                               train_flags=flags, job_options={"sync_every": every, "outer_optimizer": DILOCO,
                                                               "outer_lr": lr, "outer_momentum": momentum})


def placed(cut: str, *, grad_bytes: int, head_bytes: int, per_sample_bytes: float, sample_scale: float,
           host_a_s: float, host_c_s: float) -> TrainingMode:
    """Layer placement after ``cut`` (``train --placement CUT``); module doc for its cost.

    Args:
        grad_bytes, head_bytes: the whole model's gradient on the wire, and the head's.
        per_sample_bytes: a sample's activation and output bytes, each way.
        sample_scale: the head's share of a sample's forward and backward compute.
        host_a_s, host_c_s: the tail's forward and backward on the coordinator, per step and per sample.
    """
    fraction = min(1.0, max(head_bytes, 1) / max(grad_bytes, 1))
    why = (f"each board sends its head's {_kib(head_bytes)} gradient and {_kib(per_sample_bytes)} a sample each way "
           f"instead of the whole {_kib(grad_bytes)} gradient")
    return TrainingMode(name=f"placed-{cut}", description=f"layer placement after {cut}", wire_fraction=fraction,
                        sample_scale=max(sample_scale, 1e-3), per_sample_bytes=per_sample_bytes, host_a_s=host_a_s,
                        host_c_s=host_c_s, train_flags=("--placement", cut), job_options={"placement": cut}, why=why)


# The steps between a tail board's state uploads the planner assumes (``train``'s default --checkpoint-every: with
# ``--stage-sync checkpoint`` the tail's board sends its parameters and optimizer state then, nothing between)
TAIL_STATE_EVERY = 50
TAIL_STATE_COPIES = 4  # gradient, parameters and Adam's two moments: the most a state step carries per parameter


def placed_on_board(cut: str, board: Any, *, grad_bytes: int, head_bytes: int, per_sample_bytes: float,
                    head_share: float, max_memory_fraction: float = 0.9) -> TrainingMode:
    """Layer placement after ``cut`` with the tail on ``board`` (a ``BoardProfile``): ``train --placement CUT@BOARD
    --stage-sync checkpoint``, a two-stage pipeline. The head boards send the board their activations (their
    links: as :func:`placed`); the board's step is the tail's share of its profiled compute over the whole batch
    plus every sample's activations in and gradients out over its own link, and its tail state at each checkpoint,
    amortised (:data:`TAIL_STATE_EVERY`)."""
    base = placed(cut, grad_bytes=grad_bytes, head_bytes=head_bytes, per_sample_bytes=per_sample_bytes,
                  sample_scale=head_share, host_a_s=0.0, host_c_s=0.0)
    tail_bytes = max(grad_bytes - head_bytes, 0)
    link_s = board.up_s_per_byte + board.down_s_per_byte
    host_a = board.time_fit.intercept + TAIL_STATE_COPIES * tail_bytes / TAIL_STATE_EVERY * board.up_s_per_byte
    host_c = board.time_fit.slope * (1.0 - head_share) + per_sample_bytes * link_s
    why = (f"{base.why}; {board.board_id} trains the tail over the whole batch and sends its state only at "
           "checkpoints")
    return dataclasses.replace(base, name=f"placed-{cut}@{board.board_id}",
                               description=f"layer placement after {cut}, the tail on {board.board_id}",
                               host_a_s=max(host_a, 0.0), host_c_s=max(host_c, 0.0),
                               train_flags=("--placement", f"{cut}@{board.board_id}", "--stage-sync", "checkpoint"),
                               why=why, tail_board=board.board_id, host_idle_w=board.idle_power_w,
                               host_active_w=board.active_power_w,
                               host_max_batch=max(int(board.max_batch(max_memory_fraction)), 1))


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 100 * 1024 else f"{n / 1024:,.0f} KiB"


def candidate_modes(*, allow_inexact: bool, placements: tuple[TrainingMode, ...] = (),
                    outer_optimizer: str = AVERAGE) -> tuple[TrainingMode, ...]:
    """The modes a plan tries: exact (and ``placements``: layer placement at the model's cuts), with
    ``allow_inexact`` local SGD every 2, 4 and 8 steps too, and with ``outer_optimizer`` ``diloco`` DiLoCo
    every 8 and 16 steps as well (module doc)."""
    if not allow_inexact:
        return (EXACT, *placements)
    weighed = tuple(diloco(h) for h in DILOCO_EVERY) if outer_optimizer == DILOCO else ()
    return (EXACT, *placements, *(local_sgd(h) for h in LOCAL_SGD_EVERY), *weighed)


__all__ = ["DILOCO_EVERY", "EXACT", "EXACT_JOB_OPTIONS", "INEXACT_MARGIN", "LOCAL_SGD_EVERY", "ROUND_BYTES",
           "TAIL_STATE_COPIES", "TAIL_STATE_EVERY", "TrainingMode", "candidate_modes", "diloco", "local_sgd", "placed",
           "placed_on_board"]
