"""The sparse reduce against the dense one: the same weighted average bit for bit, the union going down, the same refusals."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.coordinator.exchange.gradient_reduce import GradientReducer
from edgefleet.coordinator.exchange.sparse_reduce import SparseReducer
from edgefleet.protocol.sparse_vector import SparseVector, to_dense, to_wire_values, widen_values
from edgefleet.workloads.topk_feedback import TopKFeedback

LENGTH = 4000
COUNTS = [32, 24, 24, 11, 11, 11, 8, 7]  # fleet8's split of 128


def _board_vectors(dtype: str = "float32", seed: int = 0) -> list[SparseVector]:
    rng = np.random.default_rng(seed)
    compressors = [TopKFeedback(LENGTH, 0.05, wire_dtype=dtype) for _ in COUNTS]
    return [c.compress(rng.standard_normal(LENGTH).astype(np.float32)) for c in compressors]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_average_equals_the_dense_reduce_of_the_same_vectors(dtype: str) -> None:
    vectors = _board_vectors(dtype)
    dense = GradientReducer(LENGTH)
    dense.reduce([(to_dense(v), n) for v, n in zip(vectors, COUNTS)])
    average = SparseReducer(LENGTH).reduce(list(zip(vectors, COUNTS)))
    assert average.kept == list(range(len(COUNTS))) and average.refused == []
    assert np.array_equal(average.dense, dense.sum)
    # and against the plain formula in float64, to float32 rounding
    reference = sum(n / sum(COUNTS) * to_dense(v).astype(np.float64) for v, n in zip(vectors, COUNTS))
    np.testing.assert_allclose(average.dense, reference, rtol=1e-5, atol=1e-7)


def test_down_is_the_average_over_the_union_of_indices() -> None:
    vectors = _board_vectors()
    average = SparseReducer(LENGTH).reduce(list(zip(vectors, COUNTS)))
    union = np.unique(np.concatenate([v.indices for v in vectors]))
    assert np.array_equal(average.indices, union)
    down = average.down("float16")
    assert np.array_equal(down.indices, union)
    assert np.array_equal(widen_values(down.values), average.dense[union].astype(np.float16).astype(np.float32))
    assert np.count_nonzero(average.dense) <= union.size  # nothing outside the union
    assert average.down_bytes("float32") == union.size * 8
    assert average.down_is_dense("float32") == (LENGTH * 4 <= union.size * 8)


def test_a_vector_with_nan_is_refused_and_the_rest_reweighted() -> None:
    vectors = _board_vectors()
    poisoned = SparseVector(length=LENGTH, indices=vectors[2].indices,
                            values=np.where(np.arange(vectors[2].nnz) == 3, np.nan, vectors[2].values).astype(np.float32))
    given = list(zip(vectors, COUNTS))
    given[2] = (poisoned, COUNTS[2])
    average = SparseReducer(LENGTH).reduce(given)
    assert [i for i, _ in average.refused] == [2] and "NaN or Inf" in average.refused[0][1]
    rest = [pair for i, pair in enumerate(zip(vectors, COUNTS)) if i != 2]
    expected = SparseReducer(LENGTH).reduce(rest)
    assert np.array_equal(average.dense, expected.dense)
    assert np.array_equal(average.indices, expected.indices)  # the refused board's indices are not sent down


def test_a_vector_far_above_the_others_is_refused_as_an_outlier() -> None:
    vectors = _board_vectors()
    huge = SparseVector(length=LENGTH, indices=vectors[0].indices,
                        values=to_wire_values(widen_values(vectors[0].values) * np.float32(1e6), "float32"))
    average = SparseReducer(LENGTH, max_grad_norm=1e12).reduce([(huge, COUNTS[0]), *zip(vectors[1:], COUNTS[1:])])
    assert [i for i, _ in average.refused] == [0] and "outlier" in average.refused[0][1]


def test_vectors_of_another_length_are_a_programming_error() -> None:
    other = SparseVector(length=LENGTH + 1, indices=np.zeros(0, np.uint32), values=np.zeros(0, np.float32))
    with pytest.raises(ValueError, match=f"this reduce takes length {LENGTH}"):
        SparseReducer(LENGTH).reduce([(other, 3)])
