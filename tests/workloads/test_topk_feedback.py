"""Top-k with error feedback: nothing lost (sent + residual = gradients fed in), k entries, the largest, deterministically."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgefleet.protocol.sparse_vector import to_dense
from edgefleet.workloads.topk_feedback import TopKFeedback, top_k_count

LENET5_LENGTH = 61_706


def _integer_gradients(length: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Small integer-valued float32 gradients: every sum of them is exact in float32, so "equal" can mean bit for bit."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1001, length).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_sent_plus_residual_equals_the_gradients_fed_in_exactly(wire: str) -> None:
    length = 5000
    compressor = TopKFeedback(length, 0.03, wire_dtype=wire)
    fed, sent = np.zeros(length, np.float64), np.zeros(length, np.float64)
    for gradient in _integer_gradients(length, 12):
        fed += gradient
        sent += to_dense(compressor.compress(gradient))
        assert np.array_equal(sent + compressor.residual, fed)
    assert np.count_nonzero(compressor.residual) > 0  # something is still waiting: the test saw delayed entries


def test_residual_of_sent_entries_is_zero_on_a_float32_wire() -> None:
    compressor = TopKFeedback(1000, 0.1)
    gradient = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    sparse = compressor.compress(gradient)
    assert np.all(compressor.residual[sparse.indices] == 0)
    assert np.array_equal(sparse.values, gradient[sparse.indices])


@pytest.mark.parametrize(("length", "ratio", "k"), [(LENET5_LENGTH, 0.01, 618), (LENET5_LENGTH, 0.1, 6171), (10, 0.01, 1),
                                                    (10, 1.0, 10), (7, 0.5, 4)])
def test_k_is_the_ceiling_of_ratio_times_length(length: int, ratio: float, k: int) -> None:
    assert top_k_count(length, ratio) == k
    gradient = np.random.default_rng(0).standard_normal(length).astype(np.float32)
    assert TopKFeedback(length, ratio).compress(gradient).nnz == k


@pytest.mark.parametrize("length", [LENET5_LENGTH, 3000, 50])
@pytest.mark.parametrize("ratio", [0.1, 0.01])
def test_the_k_largest_magnitudes_are_sent_in_index_order(length: int, ratio: float) -> None:
    """The sampled threshold and the full partition both give exactly the stable sort's top k, over several steps."""
    compressor = TopKFeedback(length, ratio)
    rng = np.random.default_rng(1)
    for _ in range(3):
        gradient = (rng.standard_normal(length) * rng.uniform(0.1, 5, length)).astype(np.float32)
        residual = compressor.residual + gradient
        expected = np.sort(np.argsort(-np.abs(residual), kind="stable")[:compressor.k])
        got = compressor.compress(gradient)
        assert got.indices.dtype == np.uint32 and np.array_equal(got.indices, expected)


def test_ties_go_to_the_lower_index_whichever_path_finds_them() -> None:
    length = 10_000
    gradient = np.zeros(length, np.float32)
    gradient[::7] = 1.0            # 1,429 equal magnitudes, more than k = 100
    gradient[[5, 9000]] = -3.0     # two larger ones always go
    sampled = TopKFeedback(length, 0.01)
    full = TopKFeedback(length, 0.01)
    full._sample_kth = None
    expected = sorted([5, 9000, *range(0, 7 * 98, 7)])
    assert sampled.compress(gradient).indices.tolist() == expected
    assert full.compress(gradient).indices.tolist() == expected


def test_two_compressors_fed_the_same_gradients_send_the_same_bits() -> None:
    first, second = TopKFeedback(20_000, 0.05, wire_dtype="float16"), TopKFeedback(20_000, 0.05, wire_dtype="float16")
    for gradient in _integer_gradients(20_000, 5, seed=4):
        a, b = first.compress(gradient * np.float32(1e-3)), second.compress(gradient * np.float32(1e-3))
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values.view(np.uint16), b.values.view(np.uint16))


def test_a_non_finite_gradient_is_sent_as_is_and_leaves_the_residual_alone(caplog: pytest.LogCaptureFixture) -> None:
    compressor = TopKFeedback(100, 0.1)
    compressor.compress(np.arange(100, dtype=np.float32))
    before = compressor.residual.copy()
    broken = np.ones(100, np.float32)
    broken[[4, 60]] = [np.nan, np.inf]
    with caplog.at_level(logging.WARNING):
        sent = compressor.compress(broken)
    assert sent.indices.tolist() == [4, 60] and np.isnan(sent.values[0]) and np.isinf(sent.values[1])
    assert np.array_equal(compressor.residual, before)
    assert "2 NaN or Inf values" in caplog.text


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"ratio 0.0 must be in \(0, 1\]"):
        TopKFeedback(100, 0)
    with pytest.raises(ValueError, match="wire dtype 'int8'"):
        TopKFeedback(100, 0.1, wire_dtype="int8")
    with pytest.raises(ValueError, match="got shape \\(99,\\) float32"):
        TopKFeedback(100, 0.1).compress(np.zeros(99, np.float32))
