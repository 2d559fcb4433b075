"""The exchange's reduce: the sample-weighted average of the boards' flat vectors, its norm check and
the float buffers' sync. numpy arrays in and out; no sockets, no boards, no clocks.

Every vector is a board's mean gradient g_i over n_i samples (wire dtype: float32, float16 or
bfloat16 bits), optionally followed by the model's float buffers (BatchNorm's running
statistics). The result is g = Σ (n_i / Σ n) g_i in float32, each weight rounded to float32 once,
added in the order given (board order, so the bits do not depend on arrival order). It equals
Σ n_i g_i / Σ n_i to float32 rounding. A vector whose gradient part has a squared norm that is not
finite or above ``max_grad_norm²`` is refused and the rest summed again without it.

A vector whose gradient norm lies far above the other boards' is refused too (a compromised or
broken board must not steer the model): with at least :data:`OUTLIER_MIN_OTHERS` others, a norm
above ``outlier_ratio`` (default 10,000) times the median of the others' norms, each norm scaled
by the square root of its board's sample count first (sampling noise makes a mean over n samples
about sqrt(n) times smaller). The median ignores a minority of wild values, so one board cannot
widen the band for itself. The band is wide because honest gradients are heavy-tailed: once a
model fits most of its data, a batch that holds one misclassified sample has a norm hundreds of
times its neighbours' (the demo's three equal boards, 16 samples each, measured up to 731x); a
poisoning gradient large enough to steer the model (the issue's 5e5 among 0.2-11) is 10^5 times
and more. Any refusal changes that step's average, so it is flagged in the step's record. The check
sorts the step's norms once (boards, not elements) and usually stops at the largest; when nothing
is refused the sum is the one above, bit for bit.

Periodic averaging (``protocol.sync_schedule``) reduces parameter deltas at its sync steps: each
board's distance moved since the last average, weighted by the samples it trained on since then,
with the same arithmetic. A delta is not a mean gradient over n samples: it sums the board's
learning-rate-scaled steps since the last average, so it does not shrink like 1/sqrt(n) with the
samples; there the band judges the plain norms (``scale_by_samples=False``). Honest boards step with
the same learning rate for the same number of steps (fewer for one that joined since), so their
deltas lie within a small factor of each other, far inside the band; a delta large enough to throw
the model off is far outside it. The max-norm and NaN/Inf checks apply as to gradients.

Buffers are not gradients: they are left out of the norm check (NaN or Inf in them still refuses
the vector), and with ``broadcast`` the result carries the first kept vector's buffers exactly
(DDP's rule: rank 0's buffers), with ``average`` their weighted average like the rest.

Integer buffers (``num_batches_tracked``, a user's counters) end every vector as their bytes, one
value 0..255 per element (``workloads.params.int_buffers``): never summed, never judged by a norm,
the result always carries the first kept vector's, also with ``average`` (an average of counters
counts nothing). A vector whose bytes are not whole numbers 0..255 is refused (a broken board).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from edgefleet.protocol.half_cast import cast_into
from edgefleet.protocol.wire_dtype import WIRE_DTYPES, numpy_dtype

log = logging.getLogger(__name__)

REDUCE_BLOCK = 1 << 16  # float32 elements: a block of the sum and of the scratch stay in the CPU cache
FOLD_MAX_ELEMENTS = 1 << 19  # vectors up to this size (2 MB of float32) may be summed as they arrive
BUFFER_SYNCS = ("broadcast", "average")
OUTLIER_RATIO = 10_000.0  # a gradient norm above this many times the median of the other boards' is refused
OUTLIER_MIN_OTHERS = 2    # ... judged only with at least this many other boards' norms


def scale_into(target: np.ndarray, grad: np.ndarray, weight: np.float32) -> float:
    """``target = weight * grad`` in float32 (a wire dtype widened first); the gradient's squared norm.

    float32 is read in place, with no widening copy. NaN or Inf anywhere makes the norm non-finite.
    """
    if grad.dtype == np.float32:
        square = float(np.dot(grad, grad))
        np.multiply(grad, weight, out=target)
        return square
    cast_into(target, grad)
    square = float(np.dot(target, target))
    target *= weight
    return square


def sample_weights(counts: Sequence[int]) -> list[np.float32]:
    """Each count's weight n_i / Σ n, rounded to float32 once."""
    total = sum(counts)
    return [np.float32(n / total) for n in counts]


def refusal_reason(square: float, limit: float) -> str | None:
    """Why a vector whose gradient has squared norm ``square`` is refused, or None if it is within ``limit``."""
    if square <= limit:
        return None
    return "NaN or Inf in the gradient" if not math.isfinite(square) else f"gradient norm {square ** 0.5:.3g} is implausible"


def outlier_reason(norm: float, others_median: float, ratio: float, what: str = "gradient norm x sqrt(samples)") -> str | None:
    """Why a gradient of norm ``norm`` is refused as an outlier among boards whose median norm is
    ``others_median``, or None if it is within ``ratio`` times that median (or there is no band: a median of 0)."""
    if others_median <= 0 or norm <= ratio * others_median:
        return None
    return (f"{what} {norm:.3g} is {norm / others_median:.3g}x the median of the other boards' "
            f"({others_median:.3g}); more than {ratio:g}x is refused as an outlier")


def outliers(squares: Sequence[float], ratio: float = OUTLIER_RATIO,
             min_others: int = OUTLIER_MIN_OTHERS, what: str = "gradient norm x sqrt(samples)") -> list[tuple[int, str]]:
    """The positions of squared norms whose norm is above ``ratio`` times the median of the others' norms, and why.

    Needs ``min_others`` other norms; every norm given counts among the others (one outlier does not
    shield another). Sorted once; checked from the largest down, stopping at the first within the
    band: a smaller norm has a median of others at least as large, so it is within the band too.
    """
    if len(squares) <= min_others:
        return []
    ascending = sorted(squares)  # the usual step: the largest is within the band of the others, and so is every one
    half, odd = divmod(len(ascending) - 1, 2)
    median = math.sqrt(ascending[half]) if odd else (math.sqrt(ascending[half - 1]) + math.sqrt(ascending[half])) / 2
    if math.sqrt(ascending[-1]) <= ratio * median:
        return []
    order = sorted(range(len(squares)), key=squares.__getitem__)
    norms = [math.sqrt(squares[i]) for i in order]
    found: list[tuple[int, str]] = []
    for j in range(len(norms) - 1, -1, -1):
        median = _median_without(norms, j)
        why = outlier_reason(norms[j], median, ratio, what)
        if why is None:
            if median > 0:
                break
            continue  # a median of 0 judges nothing: look at the next one
        found.append((order[j], why))
    return found


def _median_without(ascending: list[float], j: int) -> float:
    """The median of ``ascending`` (sorted) without its element at position ``j``."""
    count = len(ascending) - 1

    def kth(k: int) -> float:  # the k-th smallest of the others
        return ascending[k] if k < j else ascending[k + 1]

    return kth(count // 2) if count % 2 else (kth(count // 2 - 1) + kth(count // 2)) / 2


class Reduced(NamedTuple):
    """Which vectors are in the average (positions in the order given) and which were refused, and why.

    ``overflowed``: with a loss scale (16-mixed), the kept vectors whose gradient overflowed (Inf or
    NaN): the result's gradient is then all NaN, and every replica skips the step (DDP's rule).
    """

    kept: list[int]
    refused: list[tuple[int, str]]
    overflowed: tuple[int, ...] = ()


class GradientReducer:
    """Reduces vectors of ``param_count`` elements into :attr:`sum`, a float32 buffer it owns and reuses.

    Args:
        param_count: the vectors' length (gradient and buffers).
        wire_dtype: float32, float16 or bfloat16: the vectors' dtype, and the result's on the wire.
        max_grad_norm: a vector whose gradient's norm exceeds it is refused.
        outlier_ratio: a vector whose gradient's norm exceeds this many times the median of the
            others' (with at least :data:`OUTLIER_MIN_OTHERS` others) is refused; ``inf`` turns it off.
        buffer_elements: the last ``buffer_elements`` of every vector are buffers, not gradient.
        buffer_sync: ``broadcast`` or ``average`` (see the module's docstring).
        int_buffer_elements: the last ``int_buffer_elements`` of those are integer buffers' bytes,
            always the first kept vector's.
        loss_scaled: the boards scale their losses (16-mixed): a gradient that is not finite while its
            buffers are is an overflow, not a refusal; it stays in the step, and the result's gradient
            part is NaN so that every replica skips the step (``workloads.loss_scaling``).

    Raises:
        ValueError: ``buffer_elements``, ``int_buffer_elements`` or ``buffer_sync`` out of range, or an unknown wire dtype.
    """

    def __init__(self, param_count: int, *, wire_dtype: str = "float32", max_grad_norm: float = 1e6,
                 buffer_elements: int = 0, buffer_sync: str = "broadcast", outlier_ratio: float = OUTLIER_RATIO,
                 int_buffer_elements: int = 0, loss_scaled: bool = False) -> None:
        if not 0 <= int_buffer_elements <= buffer_elements <= param_count or buffer_sync not in BUFFER_SYNCS:
            raise ValueError(f"buffer_elements {buffer_elements} (integer bytes {int_buffer_elements}) / "
                             f"buffer_sync {buffer_sync!r} out of range")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        if not outlier_ratio >= 1:
            raise ValueError(f"outlier_ratio {outlier_ratio!r} must be at least 1")
        self.param_count, self.wire_dtype, self.max_grad_norm = param_count, wire_dtype, max_grad_norm
        self.outlier_ratio, self.loss_scaled = outlier_ratio, loss_scaled
        self.buffer_elements, self.int_buffer_elements = buffer_elements, int_buffer_elements
        self._summed = param_count - int_buffer_elements  # integer bytes are copied, never summed
        # the result's tail taken from the first kept vector exactly: the integer bytes, and with broadcast the float buffers
        self._copied_from = param_count - buffer_elements if buffer_sync == "broadcast" else self._summed
        self.sum = np.zeros(param_count, dtype=np.float32)
        self._scratch = np.zeros(param_count, dtype=np.float32)
        self._sum_summed, self._scratch_summed = self.sum[:self._summed], self._scratch[:self._summed]
        self.wire_out = np.zeros(param_count, dtype=numpy_dtype(wire_dtype))  # the result in the wire dtype
        self._applied: np.ndarray | None = None  # fp16/bf16: the result widened back, as every replica applies it

    def weighted_sum(self, grads: Sequence[tuple[np.ndarray, int]], total: int) -> list[float]:
        """``sum = Σ (n_i / total) g_i`` in the order given, in one cache-blocked pass over memory.

        Returns each vector's squared norm (NaN or Inf anywhere makes it non-finite). Widening
        fp16/bf16 and weighting happen block by block in the scratch buffer: no large temporary.
        Each vector is scaled by its weight as it is added (no separate division pass).
        """
        squares = [0.0] * len(grads)
        weights = [np.float32(n / total) for _, n in grads]
        for start in range(0, self._summed, REDUCE_BLOCK):
            end = min(start + REDUCE_BLOCK, self._summed)
            acc, tmp = self.sum[start:end], self._scratch[:end - start]
            for i, (grad, _) in enumerate(grads):
                squares[i] += scale_into(acc if i == 0 else tmp, grad[start:end], weights[i])
                if i:
                    acc += tmp
        return squares

    def add_weighted(self, grad: np.ndarray, weight: np.float32, *, first: bool) -> float:
        """``sum (+)= weight * grad``, the same operations as :meth:`weighted_sum` (for a small vector); its squared norm.

        Called in order for each vector of a step, ``first`` for the first one, it gives the same
        bits as :meth:`weighted_sum` with the same weights.
        """
        square = scale_into(self._sum_summed if first else self._scratch_summed, grad[:self._summed], weight)
        if not first:
            self._sum_summed += self._scratch_summed
        return square

    def reduce(self, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None = None, *,
               scale_by_samples: bool = True) -> Reduced:
        """Average ``grads`` ((vector, sample count) pairs, in board order) into :attr:`sum`, refusing implausible ones.

        ``squares``: the vectors' squared norms when :meth:`add_weighted` already summed all of
        them, in order, with these very weights; None sums them here. ``scale_by_samples``: the
        outlier band judges norm x sqrt(samples) (gradients); False: the plain norms (parameter deltas).

        Refused: NaN or Inf, a norm above ``max_grad_norm``, then (judged once, among the vectors
        that passed those) a norm far above the others' (:func:`outliers`).
        """
        refused = self._not_bytes(grads) if self.int_buffer_elements else []
        kept = list(range(len(grads)))
        if refused:
            kept = [i for i in kept if i not in {j for j, _ in refused}]
            squares = None  # summed with the refused ones: sum again without them
        limit = min(self.max_grad_norm ** 2, sys.float_info.max)  # so that an Inf square is never within it
        banded = False
        overflowed: tuple[int, ...] = ()
        while kept:
            if squares is None:
                total = sum(grads[i][1] for i in kept)
                squares = self.weighted_sum([grads[i] for i in kept], total)
            buffered = self.buffer_elements > self.int_buffer_elements
            if buffered:  # the norm check is the gradient's; buffers only for NaN or Inf
                squares = [square - self.buffer_square(grads[i][0]) for i, square in zip(kept, squares)]
            if self.loss_scaled:  # an overflow is not a refusal: the step is skipped everywhere
                overflowed = tuple(i for i, square in zip(kept, squares) if not math.isfinite(square)
                                   and (not buffered or math.isfinite(self.buffer_square(grads[i][0]))))
            bad = [(i, refusal_reason(square, limit) or "") for i, square in zip(kept, squares)
                   if not square <= limit and i not in overflowed]  # NaN, Inf or too large
            if overflowed:
                banded = True  # a skipped step: no gradient of it reaches the model, none to judge
            if not banded and len(kept) > OUTLIER_MIN_OTHERS:  # once per step: a norm far above the others'
                banded = True
                # Judged on norm x sqrt(samples): the square times the board's sample count.
                plausible = [(i, square * grads[i][1] if scale_by_samples else square)
                             for i, square in zip(kept, squares) if square <= limit]
                band = outliers([scaled for _, scaled in plausible], self.outlier_ratio,
                                what="gradient norm x sqrt(samples)" if scale_by_samples else "parameter delta norm")
                bad += [(plausible[k][0], self._outlier_text(plausible[k][1], grads[plausible[k][0]][1], why,
                                                             scale_by_samples)) for k, why in band]
            if not bad:
                break
            for i, why in bad:  # rare: refuse it and sum again without it
                refused.append((i, why))
                kept.remove(i)
            squares = None
        if kept and self._copied_from < self.param_count:  # the buffers of the first kept vector, exactly
            start, first = self._copied_from, grads[kept[0]][0]
            scale_into(self.sum[start:], first[start:], np.float32(1.0))
        if overflowed:
            self.sum[:self.param_count - self.buffer_elements] = np.nan
        return Reduced(kept, refused, overflowed)

    def _not_bytes(self, grads: Sequence[tuple[np.ndarray, int]]) -> list[tuple[int, str]]:
        """The vectors whose integer buffers' section holds anything but whole numbers 0..255, and why."""
        found = []
        for i, (vector, _) in enumerate(grads):
            tail = vector[self._summed:]
            if tail.dtype != np.float32:
                widened = self._scratch[:tail.size]
                cast_into(widened, tail)
                tail = widened
            if not np.all((tail >= 0) & (tail <= 255) & (np.floor(tail) == tail)):
                found.append((i, "the integer buffers' bytes are not whole numbers 0..255"))
        return found

    @staticmethod
    def _outlier_text(scaled: float, samples: int, why: str, scale_by_samples: bool) -> str:
        """Why a vector was refused by the band, its own norm first."""
        if scale_by_samples:
            return f"gradient norm {math.sqrt(scaled / samples):.3g} over {samples} samples: {why}"
        return f"over {samples} samples since the last average: {why}"

    def buffer_square(self, vector: np.ndarray) -> float:
        """The squared norm of a vector's float buffers (before the integer bytes), widened from the wire dtype if need be.

        Uses the scratch buffer: call it only after the weighted sum.
        """
        tail = vector[self.param_count - self.buffer_elements:self._summed]
        if tail.dtype != np.float32:
            widened = self._scratch[:tail.size]
            cast_into(widened, tail)
            tail = widened
        return float(np.dot(tail, tail))

    def to_wire(self, avg: np.ndarray) -> np.ndarray:
        """The average as it travels, and as every replica (the coordinator's too) applies it."""
        if self.wire_dtype == "float32":
            return avg
        cast_into(self.wire_out, avg)
        return self.wire_out

    def wire_to_float32(self, wire: np.ndarray) -> np.ndarray:
        """The average as it travelled, widened back to float32 (in a buffer reused every step)."""
        if self.wire_dtype == "float32":
            return wire
        if self._applied is None:
            self._applied = np.zeros(self.param_count, dtype=np.float32)
        cast_into(self._applied, wire)
        return self._applied


__all__ = [
    "FOLD_MAX_ELEMENTS",
    "OUTLIER_MIN_OTHERS",
    "OUTLIER_RATIO",
    "REDUCE_BLOCK",
    "GradientReducer",
    "Reduced",
    "outlier_reason",
    "outliers",
    "refusal_reason",
    "sample_weights",
    "scale_into",
]
