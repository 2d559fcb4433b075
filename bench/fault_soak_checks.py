"""The fault soak's verdicts, from what the runs left behind (pure: records, numbers and arrays in, findings out).

Why a module of its own: each verdict is a few lines of arithmetic that decides whether a ten-minute
run passed, so it is tested on its own (tests/planning/test_fault_soak_parts.py) rather than trusted.

Records are ``metrics.jsonl`` lines as the coordinator writes them: ``step``, ``n`` (samples in the
average), ``boards`` (the contributors, in board order), ``late`` and ``refused``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Record = Mapping[str, Any]


@dataclass(frozen=True)
class StepCount:
    """Whether steps 0..total-1 each appear exactly once."""

    total: int
    missing: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    unexpected: list[int] = field(default_factory=list)  # outside 0..total-1

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)

    def describe(self) -> str:
        if self.ok:
            return f"steps 0..{self.total - 1}, each once"
        parts = [f"{name} {_ranges(values)}" for name, values in
                 (("missing", self.missing), ("duplicated", self.duplicated), ("unexpected", self.unexpected)) if values]
        return "; ".join(parts)


def count_steps(records: Sequence[Record], total: int) -> StepCount:
    """Every step of a ``total``-step run once in ``records``: the gaps, duplicates and strays if not."""
    seen = Counter(int(r["step"]) for r in records)
    return StepCount(total=total, missing=[s for s in range(total) if s not in seen],
                     duplicated=sorted(s for s, k in seen.items() if k > 1 and 0 <= s < total),
                     unexpected=sorted(s for s in seen if not 0 <= s < total))


def _ranges(values: Sequence[int], limit: int = 6) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7`` (at most ``limit`` runs, then how many more)."""
    runs: list[tuple[int, int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (f" (+{len(runs) - limit} more)" if len(runs) > limit else "")


def incomplete_steps(records: Sequence[Record], boards: Sequence[str], *, before: int | None = None) -> list[int]:
    """Steps (below ``before``) that some board of ``boards`` missed, or that left a board out or refused one."""
    out = []
    for r in records:
        step = int(r["step"])
        if before is not None and step >= before:
            continue
        if list(r["boards"]) != list(boards) or r.get("late") or r.get("refused"):
            out.append(step)
    return sorted(out)


def first_step_without(records: Sequence[Record], board: str) -> int | None:
    """The first step ``board`` did not contribute to (None: it took part in every step)."""
    return next((int(r["step"]) for r in sorted(records, key=lambda r: int(r["step"])) if board not in r["boards"]), None)


def rejoin_step(records: Sequence[Record], boards: Sequence[str], from_step: int) -> int | None:
    """The first step from ``from_step`` on in which every board contributed again (the dead board rejoined), or None."""
    for r in sorted(records, key=lambda r: int(r["step"])):
        if int(r["step"]) >= from_step and list(r["boards"]) == list(boards):
            return int(r["step"])
    return None


def documented_drop_problems(records: Sequence[Record], boards: Sequence[str], batch_sizes: Sequence[int], dropped: str,
                             from_step: int) -> list[str]:
    """What contradicts docs/training.md's rule for a board that dies, from ``from_step`` on.

    The rule: the dead board is dropped and the job goes on with the others; each step averages
    over the boards that answered, weighted by their batch sizes, so its share of the global batch
    is not redone (n = the others' batch sizes). Once its agent is back online the coordinator asks
    it to rejoin: from the first step it is back in, every board is in every step (n = the global batch).
    """
    others = [b for b in boards if b != dropped]
    others_n = sum(b for board, b in zip(boards, batch_sizes) if board != dropped)
    back = rejoin_step(records, boards, from_step)
    problems = []
    for r in sorted(records, key=lambda r: int(r["step"])):
        step = int(r["step"])
        if step < from_step:
            continue
        expected, expected_n = (list(boards), sum(batch_sizes)) if back is not None and step >= back else (others, others_n)
        if list(r["boards"]) != expected:
            problems.append(f"step {step}: contributors {','.join(r['boards'])}, expected {','.join(expected)}")
        elif int(r["n"]) != expected_n:
            problems.append(f"step {step}: n={r['n']}, expected {expected_n} "
                            f"({'the global batch' if expected_n == sum(batch_sizes) else 'the others' + chr(39) + ' batch sizes'})")
        if len(problems) >= 5:
            break
    return problems


@dataclass(frozen=True)
class LossMatch:
    """Per-step losses of two runs over the steps both should share exactly."""

    compared: int
    identical: int
    first_difference: int | None
    max_abs_diff: float

    @property
    def ok(self) -> bool:
        return self.compared > 0 and self.identical == self.compared


def compare_losses(reference: Sequence[Record], other: Sequence[Record], *, before: int) -> LossMatch:
    """Steps below ``before``: the same loss (bit for bit) in both runs?"""
    ref = {int(r["step"]): r.get("loss") for r in reference}
    got = {int(r["step"]): r.get("loss") for r in other}
    steps = sorted(s for s in ref if s < before and s in got)
    same, first, worst = 0, None, 0.0
    for s in steps:
        a, b = ref[s], got[s]
        if a == b:
            same += 1
            continue
        first = s if first is None else first
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            worst = max(worst, abs(float(a) - float(b)))
        else:
            worst = math.inf
    return LossMatch(len(steps), same, first, worst)


def flat_arrays(obj: Any, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor, array or number in a nested state (dicts, lists) as ``(path, array)``."""
    if isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from flat_arrays(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from flat_arrays(item, f"{prefix}/{i}")
    elif isinstance(obj, (bool, int, float)) or hasattr(obj, "__array__"):
        yield prefix, np.asarray(obj, dtype=np.float64)


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two states of the same layout; inf if the layouts differ."""
    left, right = dict(flat_arrays(a)), dict(flat_arrays(b))
    if left.keys() != right.keys() or any(left[k].shape != right[k].shape for k in left):
        return math.inf
    return max((float(np.max(np.abs(left[k] - right[k]))) if left[k].size else 0.0 for k in left), default=0.0)


@dataclass(frozen=True)
class RssBound:
    """The coordinator's resident memory over a run, sampled every second (bytes)."""

    start: int       # the first sample
    warm: int        # the highest sample during warm-up
    peak: int        # the highest sample after warm-up
    end: int         # the last sample
    limit: float     # peak may be at most this multiple of warm

    @property
    def ratio(self) -> float:
        return self.peak / self.warm if self.warm else math.inf

    @property
    def ok(self) -> bool:
        return self.ratio <= self.limit


def rss_bound(samples: Sequence[tuple[float, int]], *, warm_until: float, limit: float = 1.5) -> RssBound | None:
    """``samples`` of ``(progress, rss_bytes)``: the warm-up's peak (progress below ``warm_until``) against the rest's.

    Progress is whatever orders the run (the step, say). None without samples on both sides.
    """
    warm = [rss for progress, rss in samples if progress < warm_until]
    after = [rss for progress, rss in samples if progress >= warm_until]
    if not warm or not after:
        return None
    return RssBound(start=samples[0][1], warm=max(warm), peak=max(after), end=samples[-1][1], limit=limit)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def max_relative_l2(a: Any, b: Any) -> float:
    """The largest relative L2 difference, tensor by tensor, of two states of the same layout (``b`` the reference);
    inf if the layouts differ. Two runs whose global batches are summed in another order (a re-split) differ by
    rounding only: about 1e-7 relative per step, far below 1e-5 over a run."""
    left, right = dict(flat_arrays(a)), dict(flat_arrays(b))
    if left.keys() != right.keys() or any(left[k].shape != right[k].shape for k in left):
        return math.inf
    out = 0.0
    for k in left:
        norm = float(np.linalg.norm(right[k]))
        out = max(out, float(np.linalg.norm(left[k] - right[k])) / max(norm, 1e-12))
    return out


@dataclass(frozen=True)
class StepGaps:
    """The time between consecutive steps over a stretch of a run."""

    steps: int           # records in the stretch
    longest_s: float     # the longest gap between two of them (0: fewer than two)
    at_step: int | None  # the step that ended the longest gap


def step_gaps(records: Sequence[Record], first: int, last: int) -> StepGaps:
    """The gaps between consecutive records of steps ``first``..``last`` (by their ``elapsed_s``)."""
    stretch = sorted((r for r in records if first <= int(r["step"]) <= last), key=lambda r: int(r["step"]))
    gaps = [(float(b["elapsed_s"]) - float(a["elapsed_s"]), int(b["step"])) for a, b in itertools.pairwise(stretch)]
    longest = max(gaps, default=(0.0, None))
    return StepGaps(len(stretch), longest[0], longest[1])


def late_steps(records: Sequence[Record], board: str) -> list[int]:
    """The steps whose record names ``board`` as late (it missed the step's deadline)."""
    return sorted(int(r["step"]) for r in records if board in (r.get("late") or []))
