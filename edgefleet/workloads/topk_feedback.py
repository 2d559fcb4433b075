"""Top-k gradient compression with error feedback: what a board sends instead of its whole gradient.

Every step the board adds its gradient to a residual it keeps, sends the k entries of the residual
largest in magnitude (k = ceil(ratio x length)) and subtracts what it sent from the residual
(Seide et al. 2014, 1-bit SGD; Stich et al. 2018, sparsified SGD with memory; Lin et al. 2018,
Deep Gradient Compression, without its momentum correction: ``bench/inexact_accuracy.py`` measures
whether the built-in models need it). Nothing of a gradient is lost, only delayed: after any number
of steps, the sum of everything sent plus the residual equals the sum of the gradients fed in (exactly
with a float32 wire; the tests check it). On a float16 or bfloat16 wire the rounding error of a sent
value stays in the residual too, so it is sent later instead of lost.

Which k: the k largest ``|residual|``; among equal magnitudes the lower index wins, so the choice is
a pure function of the residual (every run, every machine). The indices come out sorted, as
``protocol.sparse_vector`` requires, with no sort: a threshold is found, then one pass picks the
entries at or above it in index order.

Speed (a board may have a tenth of a core): the threshold comes from a strided sample of the
magnitudes, set to over-select about twice k; one comparison pass gathers those candidates, and an
exact partition of the candidates alone finds the true k-th largest (every entry of the top k is at
or above the sampled threshold whenever at least k candidates are, which the code checks; otherwise
it partitions the whole vector). All full-length buffers are allocated once. On this project's
shared 2-core machine one call for LeNet-5's 61,706 values takes 0.09-0.19 ms at ratio 0.01 and
0.2-0.36 ms at 0.1 (a partition of the whole vector: 0.8-0.9 ms); ``bench/inexact_accuracy.py``
prints it first. A board at a tenth of a core so spends 1-4 ms a step on it.

A gradient holding NaN or Inf is not added to the residual (one broken step must not poison every
later one): its non-finite entries are sent instead, so that the coordinator's reduce refuses the
board for that step, as it refuses a dense gradient with NaN or Inf.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from edgefleet.protocol.sparse_vector import VALUE_DTYPES, SparseVector, to_wire_values, widen_values

log = logging.getLogger(__name__)

SAMPLE_SIZE = 2048   # magnitudes sampled (every stride-th) to set the candidates' threshold
OVERSELECT = 2.0     # the sampled threshold aims at this many times k candidates


def top_k_count(length: int, ratio: float) -> int:
    """k = ceil(ratio x length), at least 1 and at most ``length``.

    Raises:
        ValueError: ``length`` below 1, or ``ratio`` not in (0, 1].
    """
    if length < 1:
        raise ValueError(f"top-k needs a vector of at least 1 element, got length {length}")
    if not 0 < ratio <= 1:
        raise ValueError(f"top-k ratio {ratio!r} must be in (0, 1], e.g. 0.01 to send 1% of the entries")
    return min(length, max(1, math.ceil(ratio * length)))


class TopKFeedback:
    """One board's compressor: a residual of ``length`` float32 values and buffers reused every step.

    Args:
        length: elements of the flat gradient.
        ratio: share of the entries sent each step (0.01 to 0.1 is the usual range).
        wire_dtype: the values' wire dtype: float32, float16 or bfloat16.

    Raises:
        ValueError: a length, ratio or wire dtype out of range.
    """

    def __init__(self, length: int, ratio: float, *, wire_dtype: str = "float32") -> None:
        if wire_dtype not in VALUE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} is not one of {', '.join(VALUE_DTYPES)}")
        self.length, self.ratio, self.wire_dtype = int(length), float(ratio), wire_dtype
        self.k = top_k_count(self.length, self.ratio)
        self.residual = np.zeros(self.length, dtype=np.float32)
        self._magnitude = np.empty(self.length, dtype=np.float32)
        self._mask = np.empty(self.length, dtype=bool)
        self._stride = max(1, self.length // SAMPLE_SIZE)
        sample_len = len(range(0, self.length, self._stride))
        wanted = math.ceil(OVERSELECT * self.k * sample_len / self.length)
        # Position of the sampled threshold in the ascending sample; None: sampling would not save anything.
        worth_it = self._stride > 1 and 2 * OVERSELECT * self.k < self.length
        self._sample_kth: int | None = sample_len - wanted if worth_it and wanted < sample_len else None

    def reset(self) -> None:
        """Forget the residual (a new run, or parameters replaced from a checkpoint)."""
        self.residual.fill(0.0)

    def compress(self, gradient: np.ndarray) -> SparseVector:
        """Add ``gradient`` to the residual; return the k largest entries and take them out of the residual.

        Args:
            gradient: the step's flat float32 gradient, ``length`` elements (not modified).

        Raises:
            ValueError: the gradient's shape or dtype is not the compressor's.
        """
        if gradient.shape != (self.length,) or gradient.dtype != np.float32:
            raise ValueError(f"top-k compressor of {self.length} float32 values got shape {gradient.shape} {gradient.dtype}")
        if not np.isfinite(gradient, out=self._mask).all():
            return self._non_finite(gradient)
        np.add(self.residual, gradient, out=self.residual)
        indices = self.top_indices()
        values = to_wire_values(self.residual[indices], self.wire_dtype)
        if self.wire_dtype == "float32":
            self.residual[indices] = 0.0
        else:  # keep the rounding error: exact, a value and its rounding being within a factor of 2
            self.residual[indices] -= widen_values(values)
        return SparseVector(length=self.length, indices=indices.astype(np.uint32), values=values)

    def top_indices(self) -> np.ndarray:
        """Positions of the k largest ``|residual|``, ascending; on a tie the lower index wins."""
        magnitude, k = self._magnitude, self.k
        np.abs(self.residual, out=magnitude)
        if self._sample_kth is not None:
            sample = np.partition(magnitude[::self._stride], self._sample_kth)
            np.greater_equal(magnitude, sample[self._sample_kth], out=self._mask)
            candidates = np.flatnonzero(self._mask)
            if candidates.size >= k:
                chosen: np.ndarray = candidates[_top_of(magnitude[candidates], k)]
                return chosen
        return _top_of(magnitude, k)

    def _non_finite(self, gradient: np.ndarray) -> SparseVector:
        bad = np.flatnonzero(~self._mask)[:self.k]
        log.warning("top-k: the gradient holds %d NaN or Inf values; sent so the step refuses this board, "
                    "residual kept as it was", int((~self._mask).sum()))
        # float16 without to_wire_values' clipping: an Inf must arrive as Inf
        values = gradient[bad].astype(np.float16) if self.wire_dtype == "float16" else to_wire_values(gradient[bad], self.wire_dtype)
        return SparseVector(length=self.length, indices=bad.astype(np.uint32), values=values)


def _top_of(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest of ``magnitude``; the lower position wins a tie."""
    n = magnitude.size
    if k >= n:
        return np.arange(n)
    kth = np.partition(magnitude, n - k)[n - k]  # the k-th largest value
    chosen = np.flatnonzero(magnitude >= kth)
    extra = chosen.size - k
    if extra > 0:  # ties at the threshold: drop the highest-indexed of them
        tied = np.flatnonzero(magnitude[chosen] == kth)
        chosen = np.delete(chosen, tied[tied.size - extra:])
    return chosen


__all__ = ["OVERSELECT", "SAMPLE_SIZE", "TopKFeedback", "top_k_count"]
