"""The exchange's reduce: the sample-weighted average of the boards' flat vectors, its norm check and
the float buffers' sync. numpy arrays in and out; no sockets, no boards, no clocks.

Every vector is a board's mean gradient g_i over n_i samples (wire dtype: float32, float16 or
bfloat16 bits), optionally followed by the model's float buffers (BatchNorm's running
statistics). The result is g = Σ (n_i / Σ n) g_i in float32, each weight rounded to float32 once,
added in the order given (board order, so the bits do not depend on arrival order). It equals
Σ n_i g_i / Σ n_i to float32 rounding. A vector whose gradient part has a squared norm that is not
finite or above ``max_grad_norm²`` is refused and the rest summed again without it.

Buffers are not gradients: they are left out of the norm check (NaN or Inf in them still refuses
the vector), and with ``broadcast`` the result carries the first kept vector's buffers exactly
(DDP's rule: rank 0's buffers), with ``average`` their weighted average like the rest.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from edgefleet.protocol.half_cast import cast_into

log = logging.getLogger(__name__)

REDUCE_BLOCK = 1 << 16  # float32 elements: a block of the sum and of the scratch stay in the CPU cache
FOLD_MAX_ELEMENTS = 1 << 19  # vectors up to this size (2 MB of float32) may be summed as they arrive
WIRE_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
BUFFER_SYNCS = ("broadcast", "average")


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


class Reduced(NamedTuple):
    """Which vectors are in the average (positions in the order given) and which were refused, and why."""

    kept: list[int]
    refused: list[tuple[int, str]]


class GradientReducer:
    """Reduces vectors of ``param_count`` elements into :attr:`sum`, a float32 buffer it owns and reuses.

    Args:
        param_count: the vectors' length (gradient and buffers).
        wire_dtype: float32, float16 or bfloat16: the vectors' dtype, and the result's on the wire.
        max_grad_norm: a vector whose gradient's norm exceeds it is refused.
        buffer_elements: the last ``buffer_elements`` of every vector are float buffers, not gradient.
        buffer_sync: ``broadcast`` or ``average`` (see the module's docstring).

    Raises:
        ValueError: ``buffer_elements`` or ``buffer_sync`` out of range, or an unknown wire dtype.
    """

    def __init__(self, param_count: int, *, wire_dtype: str = "float32", max_grad_norm: float = 1e6,
                 buffer_elements: int = 0, buffer_sync: str = "broadcast") -> None:
        if not 0 <= buffer_elements <= param_count or buffer_sync not in BUFFER_SYNCS:
            raise ValueError(f"buffer_elements {buffer_elements} / buffer_sync {buffer_sync!r} out of range")
        if wire_dtype not in WIRE_NUMPY:
            raise ValueError(f"wire dtype {wire_dtype!r} is not one of {', '.join(WIRE_NUMPY)}")
        self.param_count, self.wire_dtype, self.max_grad_norm = param_count, wire_dtype, max_grad_norm
        self.buffer_elements = buffer_elements
        self._buffers_from = param_count - buffer_elements if buffer_elements and buffer_sync == "broadcast" else None
        self.sum = np.zeros(param_count, dtype=np.float32)
        self._scratch = np.zeros(param_count, dtype=np.float32)
        self.wire_out = np.zeros(param_count, dtype=WIRE_NUMPY[wire_dtype])  # the result in the wire dtype
        self._applied: np.ndarray | None = None  # fp16/bf16: the result widened back, as every replica applies it

    def weighted_sum(self, grads: Sequence[tuple[np.ndarray, int]], total: int) -> list[float]:
        """``sum = Σ (n_i / total) g_i`` in the order given, in one cache-blocked pass over memory.

        Returns each vector's squared norm (NaN or Inf anywhere makes it non-finite). Widening
        fp16/bf16 and weighting happen block by block in the scratch buffer: no large temporary.
        Each vector is scaled by its weight as it is added (no separate division pass).
        """
        squares = [0.0] * len(grads)
        weights = [np.float32(n / total) for _, n in grads]
        for start in range(0, self.param_count, REDUCE_BLOCK):
            end = min(start + REDUCE_BLOCK, self.param_count)
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
        square = scale_into(self.sum if first else self._scratch, grad, weight)
        if not first:
            self.sum += self._scratch
        return square

    def reduce(self, grads: Sequence[tuple[np.ndarray, int]], squares: list[float] | None = None) -> Reduced:
        """Average ``grads`` ((vector, sample count) pairs, in board order) into :attr:`sum`, refusing implausible ones.

        ``squares``: the vectors' squared norms when :meth:`add_weighted` already summed all of
        them, in order, with these very weights; None sums them here.
        """
        kept = list(range(len(grads)))
        refused: list[tuple[int, str]] = []
        limit = min(self.max_grad_norm ** 2, sys.float_info.max)  # so that an Inf square is never within it
        while kept:
            if squares is None:
                total = sum(grads[i][1] for i in kept)
                squares = self.weighted_sum([grads[i] for i in kept], total)
            if self.buffer_elements:  # the norm check is the gradient's; buffers count only for NaN or Inf
                squares = [square - self.buffer_square(grads[i][0]) for i, square in zip(kept, squares)]
            bad = [(i, square) for i, square in zip(kept, squares) if not square <= limit]  # NaN, Inf or too large
            if not bad:
                break
            for i, square in bad:  # rare: refuse it and sum again without it
                refused.append((i, refusal_reason(square, limit) or ""))
                kept.remove(i)
            squares = None
        if kept and self._buffers_from is not None:  # the buffers of the first kept vector, exactly
            start, first = self._buffers_from, grads[kept[0]][0]
            scale_into(self.sum[start:], first[start:], np.float32(1.0))
        return Reduced(kept, refused)

    def buffer_square(self, vector: np.ndarray) -> float:
        """The squared norm of a vector's float buffers (its tail), widened from the wire dtype if need be.

        Uses the scratch buffer: call it only after the weighted sum.
        """
        tail = vector[self.param_count - self.buffer_elements:]
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
    "REDUCE_BLOCK",
    "WIRE_NUMPY",
    "GradientReducer",
    "Reduced",
    "refusal_reason",
    "sample_weights",
    "scale_into",
]
