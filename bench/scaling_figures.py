"""The scaling benchmark's arithmetic (``bench/scaling.py``), kept free of the lab so that tests can check it.

A run's figures come from its run directory's ``metrics.jsonl``: one record per applied step with
``step``, ``n`` (samples in the step's average), ``elapsed_s`` (seconds since the coordinator's
first step began, taken once the step is applied: the replica validates inside the apply of an
epoch's last step, ``coordinator.run.replica``, so that step's interval holds the validation),
``wall_s`` (the step as the exchange saw it: from opening the step to the last gradient in),
``compute_s`` (each board's own forward and backward) and, at the end of every epoch,
``val_accuracy``. Measured on the lab (resnet_small, fleet8): an epoch-end step's interval is
1.1-1.9 s longer than the others, and the next one lasts a few ms (the boards computed it during
the validation, its gradients were in when the exchange opened it).

* samples/s: samples over the steps after the first ``warmup``, divided by the time those steps
  took; the two intervals at an epoch's end (the one that holds the validation and the one that
  overlapped it) are left out, so this is the training rate.
* time per epoch: the mean span between the ends of two consecutive epochs, from the first epoch's
  end on (the first epoch also pays the start-up steps); each span holds one epoch's training and
  one validation, as an epoch of a real run does.
* time to target: ``elapsed_s`` of the first epoch whose validation accuracy is at least the
  target (it counts every validation up to that epoch's own).
* the exchange's share of the step: over the steps samples/s counts, the part of the step's period (consecutive ``elapsed_s``)
  outside the slowest board's ``compute_s``: sending, waiting, reducing, applying and a board's
  per-step fixed costs (data, hooks, the optimizer step); summed over the steps, as a share of
  their summed period. ``wall_s`` alone misses part of a step: the exchange opens step t once the
  coordinator's replica has applied step t-1, while the boards have been computing step t since
  the average of t-1 reached them, so a board's compute can begin before ``wall_s`` does. The
  same share of the summed ``wall_s`` (each step's part outside compute floored at 0) is
  :func:`exchange_share_of_wall`.
* speed-up over the best single board: its time to target over the configuration's (or the
  configuration's samples/s over its); scaling efficiency: the speed-up over the ratio of the
  configuration's summed CPU quota to the best board's quota (1.0: every quota fully turned into speed).
* where a step goes: each board's median ``compute_s`` against the median step period (consecutive
  ``elapsed_s``, the same steps as samples/s), and its CPU per sample (compute x quota / batch).

Two splits of the global batch among a configuration's boards: ``quota`` (:func:`split_batch`,
in proportion to the CPU quotas) and ``planned`` (:func:`planned_split`: the planner's allocation
from a profile of the boards, which knows each board's fixed cost per step ``a_i`` and its link,
as ``plan --objective time`` splits the global batch for these boards).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgefleet.coordinator.planning import FleetProfile

# Park, Lee, Kim (Electronics 2020, 9(1):28), LeNet on MNIST, elapsed seconds against the number of
# Raspberry Pi 3 boards (MXNet, parameter server); ../shared/PAPERS.md section 2. Two configurations.
PARK_LENET_S: dict[int, int] = {1: 105, 2: 168, 3: 228, 4: 286, 5: 342, 6: 287, 7: 442, 8: 453, 9: 510, 10: 566}
PARK_LENET_LONG_S: dict[int, int] = {1: 1079, 2: 1177, 3: 1338, 4: 1484, 5: 1778, 6: 2009, 7: 1970, 8: 2436, 9: 2665,
                                     10: 2625}

Record = Mapping[str, Any]  # one line of metrics.jsonl


@dataclass(frozen=True)
class BoardQuota:
    """What picks a board for a configuration: its CPU quota (cores) and its slower link direction (bit/s)."""

    id: str
    cpu: float
    link_bps: int


@dataclass(frozen=True)
class TargetHit:
    """The first epoch whose validation accuracy reached the target."""

    elapsed_s: float
    epoch: int
    step: int
    accuracy: float


def fastest_boards(boards: Sequence[BoardQuota], k: int) -> list[str]:
    """The ``k`` boards with the largest CPU quotas, fastest first; among equal quotas the faster link, then the id.

    Raises:
        ValueError: ``k`` is not between 1 and the number of boards.
    """
    if not 1 <= k <= len(boards):
        raise ValueError(f"{k} boards asked of a fleet of {len(boards)}")
    ordered = sorted(boards, key=lambda b: (-b.cpu, -b.link_bps, b.id))
    return [b.id for b in ordered[:k]]


def split_batch(quotas: Sequence[float], global_batch: int) -> list[int]:
    """``global_batch`` split in proportion to ``quotas``, every board at least 1, summing exactly.

    Largest remainders: each board gets the floor of its share, and the samples left go to the
    largest fractional parts (the earlier board on a tie).

    Raises:
        ValueError: no boards, a quota that is not positive, or fewer samples than boards.
    """
    if not quotas or any(not q > 0 for q in quotas):
        raise ValueError(f"quotas must be positive, got {list(quotas)}")
    if global_batch < len(quotas):
        raise ValueError(f"a global batch of {global_batch} cannot give each of {len(quotas)} boards a sample")
    total = sum(quotas)
    exact = [global_batch * q / total for q in quotas]
    sizes = [max(1, math.floor(e)) for e in exact]
    while sum(sizes) > global_batch:  # only when the minimum of 1 lifted a board: take from the one it costs least
        cut = max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: (sizes[i] - exact[i], -i))
        sizes[cut] -= 1
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:global_batch - sum(sizes)]:
        sizes[i] += 1
    return sizes


def planned_split(fleet: FleetProfile, board_ids: Sequence[str], global_batch: int, placement: str = "") -> list[int]:
    """The batches ``plan --objective time`` gives ``board_ids`` for ``global_batch``: the planner's allocation.

    Every board's predicted ready time (its profiled ``a_i + c_i * b_i``, then its gradient's upload)
    is made as equal as integers allow, so a board with a large fixed cost per step gets fewer
    samples than its quota's share (``coordinator.planning.allocate_batches``, memory-capped).

    ``placement``: a cut: the split of layer placement at that cut (its per-sample bytes and the head's
    share of the compute, from the profile's cuts: ``planning.layer_profile``).

    Raises:
        ValueError: a board the profile lacks, or a split the planner refuses (its message).
    """
    from edgefleet.coordinator.planning import EXACT, allocate_batches
    from edgefleet.coordinator.planning.layer_profile import cut_modes
    from edgefleet.protocol.errors import PlanError

    missing = [b for b in board_ids if b not in fleet.boards]
    if missing:
        raise ValueError(f"the profile has no board {', '.join(missing)} (profiled: {', '.join(fleet.boards)})")
    try:
        mode = cut_modes(fleet, only=placement)[0][0] if placement else EXACT
        return list(allocate_batches([fleet.boards[b] for b in board_ids], global_batch=global_batch,
                                     grad_bytes=fleet.grad_bytes, mode=mode))
    except PlanError as exc:
        raise ValueError(str(exc)) from None


def fitted_costs(fleet: FleetProfile) -> dict[str, tuple[float, float]]:
    """Each profiled board's step time line: (fixed cost per step a_i, cost per sample c_i), seconds."""
    return {b: (p.time_fit.intercept, p.time_fit.slope) for b, p in fleet.boards.items()}


def quota_ratio(quotas: Sequence[float], best_quota: float) -> float:
    """The configuration's summed CPU quota over the best single board's: the speed-up perfect scaling would give."""
    return sum(quotas) / best_quota


def speed_up_time(baseline_s: float | None, config_s: float | None) -> float | None:
    """How many times sooner the configuration got there: the baseline's time over the configuration's."""
    if baseline_s is None or config_s is None or not config_s > 0:
        return None
    return baseline_s / config_s


def speed_up_rate(baseline_rate: float | None, config_rate: float | None) -> float | None:
    """How many times faster the configuration went: its rate over the baseline's."""
    if baseline_rate is None or config_rate is None or not baseline_rate > 0:
        return None
    return config_rate / baseline_rate


def efficiency(speed_up: float | None, quotas: Sequence[float], best_quota: float) -> float | None:
    """The speed-up over :func:`quota_ratio`: 1.0 when every core of quota added gave its share of speed."""
    if speed_up is None:
        return None
    return speed_up / quota_ratio(quotas, best_quota)


def epoch_ends(records: Sequence[Record], steps_per_epoch: int) -> list[Record]:
    """The records of the steps that ended an epoch (those carry the epoch's validation), in order."""
    return [r for r in records if (int(r["step"]) + 1) % steps_per_epoch == 0]


def time_to_target(records: Sequence[Record], target: float, steps_per_epoch: int) -> TargetHit | None:
    """The first epoch end whose ``val_accuracy`` is at least ``target``; None if none reached it.

    Its time is when the figures were in: ``validated_s`` where the replica validated while the boards went on (the
    record's ``elapsed_s`` is then when the step's result was in), else ``elapsed_s`` (the step waited for them)."""
    for r in epoch_ends(records, steps_per_epoch):
        accuracy = r.get("val_accuracy")
        if accuracy is not None and accuracy >= target:
            step = int(r["step"])
            return TargetHit(float(r.get("validated_s", r["elapsed_s"])), (step + 1) // steps_per_epoch, step,
                             float(accuracy))
    return None


def time_per_epoch(records: Sequence[Record], steps_per_epoch: int) -> float | None:
    """The mean span between consecutive epoch ends, from the first one on; None before two epochs ended."""
    ends = [float(r["elapsed_s"]) for r in epoch_ends(records, steps_per_epoch)]
    if len(ends) < 2:
        return None
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _timed(records: Sequence[Record], warmup: int, steps_per_epoch: int) -> list[tuple[Record, Record]]:
    """(previous, this) pairs of the steps after the warm-up whose interval neither holds nor overlaps a validation."""
    pairs = []
    for prev, this in itertools.pairwise(records):
        if int(this["step"]) < warmup or int(this["step"]) != int(prev["step"]) + 1:
            continue
        if (int(this["step"]) + 1) % steps_per_epoch == 0:  # the replica validated inside this step's apply
            continue
        if (int(prev["step"]) + 1) % steps_per_epoch == 0:  # the boards computed this step during that validation
            continue
        pairs.append((prev, this))
    return pairs


def samples_per_s(records: Sequence[Record], warmup: int, steps_per_epoch: int) -> float | None:
    """Samples over training time, from step ``warmup`` on, validation left out; None without such steps."""
    pairs = _timed(records, warmup, steps_per_epoch)
    seconds = sum(float(this["elapsed_s"]) - float(prev["elapsed_s"]) for prev, this in pairs)
    if not pairs or not seconds > 0:
        return None
    return sum(int(this["n"]) for _, this in pairs) / seconds


def _slowest_compute(record: Record) -> float | None:
    compute = [float(c) for c in (record.get("compute_s") or {}).values() if c is not None]
    return max(compute) if compute else None


def exchange_share(records: Sequence[Record], warmup: int, steps_per_epoch: int) -> float | None:
    """The share of the steps' period outside the slowest board's ``compute_s`` (see the module doc).

    None when no step after the warm-up has a compute time and a period.
    """
    period = compute = 0.0
    for prev, this in _timed(records, warmup, steps_per_epoch):
        slowest = _slowest_compute(this)
        if slowest is None:
            continue
        period += float(this["elapsed_s"]) - float(prev["elapsed_s"])
        compute += slowest
    return max(0.0, 1 - compute / period) if period > 0 else None


def exchange_share_of_wall(records: Sequence[Record], warmup: int, steps_per_epoch: int) -> float | None:
    """The share of the steps' ``wall_s`` outside the slowest board's ``compute_s``, each step's floored at 0.

    None when no step after the warm-up has both figures.
    """
    outside = total = 0.0
    for _, this in _timed(records, warmup, steps_per_epoch):
        slowest, wall = _slowest_compute(this), float(this.get("wall_s") or 0.0)
        if slowest is None or not wall > 0:
            continue
        outside += max(0.0, wall - slowest)
        total += wall
    return outside / total if total > 0 else None


def median_compute(records: Sequence[Record], warmup: int) -> dict[str, float]:
    """Each board's median ``compute_s`` over the steps from ``warmup`` on."""
    times: dict[str, list[float]] = {}
    for r in records:
        if int(r["step"]) < warmup:
            continue
        for board, seconds in (r.get("compute_s") or {}).items():
            if seconds is not None:
                times.setdefault(board, []).append(float(seconds))
    return {board: statistics.median(values) for board, values in times.items()}


def median_period(records: Sequence[Record], warmup: int, steps_per_epoch: int) -> float | None:
    """The median step period (consecutive ``elapsed_s``) over the steps samples/s counts; None without any."""
    periods = [float(this["elapsed_s"]) - float(prev["elapsed_s"]) for prev, this in _timed(records, warmup, steps_per_epoch)]
    return statistics.median(periods) if periods else None


def cpu_per_sample(compute_s: float, quota: float, batch: int) -> float:
    """A board's CPU seconds per sample of its forward and backward: its compute time x its quota / its batch."""
    return compute_s * quota / batch


def park_relative(devices: int) -> tuple[float | None, float | None]:
    """Park et al.'s LeNet elapsed time on ``devices`` boards relative to one, both configurations (None: not run)."""
    first = PARK_LENET_S.get(devices)
    second = PARK_LENET_LONG_S.get(devices)
    return (first / PARK_LENET_S[1] if first is not None else None,
            second / PARK_LENET_LONG_S[1] if second is not None else None)


__all__ = [
    "PARK_LENET_LONG_S",
    "PARK_LENET_S",
    "BoardQuota",
    "Record",
    "TargetHit",
    "cpu_per_sample",
    "efficiency",
    "epoch_ends",
    "exchange_share",
    "exchange_share_of_wall",
    "fastest_boards",
    "fitted_costs",
    "median_compute",
    "median_period",
    "park_relative",
    "planned_split",
    "quota_ratio",
    "samples_per_s",
    "speed_up_rate",
    "speed_up_time",
    "split_batch",
    "time_per_epoch",
    "time_to_target",
]
