"""The coordinator's reduce for the top-k exchange: the sample-weighted average of the boards' sparse vectors.

Each board sends its top-k entries (``workloads.topk_feedback``) as a
:class:`~edgefleet.protocol.sparse_vector.SparseVector` over ``n_i`` samples. The average is
g = Σ (n_i / Σ n) s_i into a dense float32 vector, each weight rounded to float32 once and the
vectors added in the order given (board order), with the same operations as the dense reduce
(``coordinator.exchange.gradient_reduce``): the same vectors sent densely give the same bits. What goes back
down is that average over the union of the boards' indices (:meth:`SparseAverage.down`), or the
dense vector when that is fewer bytes (:meth:`SparseAverage.down_is_dense`): with eight boards at
a ratio of 0.1 the union covers about half of the entries, and an index costs as much as a float32.

A vector is refused, as the dense reduce refuses one, when its squared norm is not finite or above
``max_grad_norm²``, or when its norm (times the square root of its sample count) is more than
``outlier_ratio`` times the median of the other boards' (``gradient_reduce.outliers``); the rest
are averaged without it, weighted over their own samples.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgefleet.coordinator.exchange.gradient_reduce import OUTLIER_RATIO, outliers, refusal_reason, sample_weights
from edgefleet.protocol.sparse_vector import SparseVector, add_weighted_into, dense_to_sparse, widen_values

log = logging.getLogger(__name__)

INDEX_BYTES = 4  # a uint32 index on the wire
WIRE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class SparseAverage:
    """One step's average; ``dense`` is the reducer's buffer, overwritten by its next reduce.

    Attributes:
        dense: float32, the whole vector (zero outside ``indices``).
        indices: uint32, ascending: the union of the kept vectors' indices.
        kept: positions (in the order given) of the vectors in the average.
        refused: positions of the vectors left out, and why.
    """

    dense: np.ndarray
    indices: np.ndarray
    kept: list[int]
    refused: list[tuple[int, str]]

    def down(self, dtype: str = "float32") -> SparseVector:
        """The average over the union of indices, values in wire dtype ``dtype``."""
        return dense_to_sparse(self.dense, self.indices, dtype=dtype)

    def down_bytes(self, dtype: str = "float32") -> int:
        """Bytes of :meth:`down` on the wire (indices and values)."""
        return int(self.indices.size) * (INDEX_BYTES + WIRE_ITEMSIZE[dtype])

    def down_is_dense(self, dtype: str = "float32") -> bool:
        """Whether the dense vector in ``dtype`` is no more bytes than :meth:`down`: then send that."""
        return self.dense.size * WIRE_ITEMSIZE[dtype] <= self.down_bytes(dtype)


class SparseReducer:
    """Averages sparse vectors over ``length`` elements into a float32 buffer it owns and reuses.

    Args:
        length: the dense length (the job's parameter count).
        max_grad_norm: a vector whose norm exceeds it is refused.
        outlier_ratio: a vector whose norm x sqrt(samples) exceeds this many times the median of
            the others' is refused; ``inf`` turns the check off.

    Raises:
        ValueError: a length below 1 or an outlier ratio below 1.
    """

    def __init__(self, length: int, *, max_grad_norm: float = 1e6, outlier_ratio: float = OUTLIER_RATIO) -> None:
        if length < 1:
            raise ValueError(f"a sparse reduce needs a length of at least 1, got {length}")
        if not outlier_ratio >= 1:
            raise ValueError(f"outlier_ratio {outlier_ratio!r} must be at least 1")
        self.length, self.max_grad_norm, self.outlier_ratio = int(length), max_grad_norm, outlier_ratio
        self.sum = np.zeros(self.length, dtype=np.float32)
        self._touched = np.zeros(self.length, dtype=bool)

    def reduce(self, vectors: Sequence[tuple[SparseVector, int]]) -> SparseAverage:
        """Average ``vectors`` ((sparse vector, sample count) pairs, in board order), refusing implausible ones.

        Raises:
            ValueError: a vector over another length, or a sample count below 1.
        """
        for i, (vector, count) in enumerate(vectors):
            if vector.length != self.length or count < 1:
                raise ValueError(f"vector {i}: length {vector.length} over {count} samples; "
                                 f"this reduce takes length {self.length} over at least 1 sample")
        squares = [_square(vector) for vector, _ in vectors]
        refused = self._refusals(vectors, squares)
        bad = {i for i, _ in refused}
        kept = [i for i in range(len(vectors)) if i not in bad]
        self.sum.fill(0.0)
        self._touched.fill(False)
        for i, weight in zip(kept, sample_weights([vectors[i][1] for i in kept]) if kept else []):
            vector = vectors[i][0]
            add_weighted_into(self.sum, vector, weight)
            self._touched[vector.indices] = True
        if refused:
            log.debug("sparse reduce: refused %s", refused)
        return SparseAverage(dense=self.sum, indices=np.flatnonzero(self._touched).astype(np.uint32),
                             kept=kept, refused=refused)

    def _refusals(self, vectors: Sequence[tuple[SparseVector, int]], squares: list[float]) -> list[tuple[int, str]]:
        limit = min(self.max_grad_norm ** 2, sys.float_info.max)  # so that an Inf square is never within it
        refused = [(i, refusal_reason(square, limit) or "") for i, square in enumerate(squares) if not square <= limit]
        plausible = [(i, square * vectors[i][1]) for i, square in enumerate(squares) if square <= limit]
        refused += [(plausible[j][0], f"sparse vector over {vectors[plausible[j][0]][1]} samples: {why}")
                    for j, why in outliers([scaled for _, scaled in plausible], self.outlier_ratio)]
        return sorted(refused)


def _square(vector: SparseVector) -> float:
    """The squared norm of the vector's values (float64 sum of float32 squares: Inf only for NaN or Inf values)."""
    values = widen_values(vector.values).astype(np.float64)
    return float(np.dot(values, values))


__all__ = ["INDEX_BYTES", "WIRE_ITEMSIZE", "SparseAverage", "SparseReducer"]
