"""A board's step fixed costs (issue 22, part 4): the benchmark's arithmetic (bench/step_fixed_costs.py), and the
one-call gradient copies (workloads.params.FlatGradients) giving exactly what the per-parameter loops give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefleet.workloads.params import FlatGradients, assign_grads, flatten_grads
from tests.planning import load_bench

sfc = load_bench("step_fixed_costs.py", "step_fixed_costs", helpers=True)


def test_fit_line_recovers_the_fixed_cost_and_the_cost_per_sample() -> None:
    a, b = sfc.fit_line([1, 4, 8, 16], [3.6 + 1.1 * n for n in (1, 4, 8, 16)])
    assert a == pytest.approx(3.6)
    assert b == pytest.approx(1.1)


def test_fit_line_is_least_squares_through_noisy_points() -> None:
    xs, ys = [1, 4, 8, 16], [5.0, 7.0, 12.0, 20.0]
    a, b = sfc.fit_line(xs, ys)
    assert (a, b) == pytest.approx(tuple(np.polynomial.polynomial.polyfit(xs, ys, 1)))


def test_fit_line_needs_two_distinct_batch_sizes() -> None:
    with pytest.raises(ValueError, match="two distinct"):
        sfc.fit_line([4, 4], [1.0, 2.0])


def test_step_cpu_skips_the_warmup_and_takes_differences() -> None:
    marks = [0, 5_000_000, 9_000_000, 12_000_000, 20_000_000]  # ns at each progress call
    assert sfc.step_cpu(marks, 2) == pytest.approx([0.003, 0.008])


def test_segment_medians_count_a_missing_segment_as_zero() -> None:
    steps = [{"bwd_out": 2_000_000, "data_out": 1_000}, {"bwd_out": 4_000_000}, {"bwd_out": 3_000_000}]
    medians = sfc.segment_medians(steps)  # segments are named by the mark that ends them: bwd_out is backward
    assert medians["bwd_out"] == pytest.approx(0.003)
    assert medians["data_out"] == 0.0
    assert set(medians) == set(sfc.SEGMENTS)


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))


def _backward(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 1, 6, 6)).square().sum().backward()


def test_flat_gradients_gather_and_scatter_as_the_loops_do() -> None:
    model = _model()
    params = list(model.parameters())
    size = sum(p.numel() for p in params)
    _backward(model)
    out = np.full(size + 3, -1.0, dtype=np.float32)  # the buffers' values travel after the gradient
    grads = FlatGradients(params, out[:size])
    grads.gather()
    assert np.array_equal(out[:size], flatten_grads(params, np.zeros(size, dtype=np.float32)))
    assert np.array_equal(out[size:], [-1.0, -1.0, -1.0])

    received = np.arange(size, dtype=np.float32)  # a result buffer, overwritten at every step
    received.flags.writeable = False
    for step in range(3):
        received.flags.writeable = True
        received[:] = np.arange(size) * (step + 1)
        received.flags.writeable = False
        grads.scatter(received, keep=True)
        expected = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        assign_grads(params, received)
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))


def test_flat_gradients_fall_back_for_a_missing_gradient() -> None:
    model = _model()
    params = list(model.parameters())
    size = sum(p.numel() for p in params)
    _backward(model)
    params[0].grad = None
    out = np.full(size, 7.0, dtype=np.float32)
    FlatGradients(params, out).gather()
    assert np.all(out[:params[0].numel()] == 0.0)  # zeros for the missing one, as flatten_grads gives
    FlatGradients(params, out).scatter(np.ones(size, dtype=np.float32))
    assert params[0].grad is not None and torch.equal(params[0].grad, torch.ones_like(params[0]))


def test_flat_gradients_of_no_parameters_copy_nothing() -> None:
    """A pipeline stage of pooling and activations only (one a revision may cut) has no parameters: torch's foreach
    copies refuse an empty list, so its vector of none is gathered and scattered without them."""
    out = np.zeros(0, dtype=np.float32)
    grads = FlatGradients([], out)
    assert grads.gather() is out and out.size == 0
    grads.scatter(np.zeros(0, dtype=np.float32), keep=True)
