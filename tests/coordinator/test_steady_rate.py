"""The run's steady samples/s: warm-up steps and validation left out."""

from __future__ import annotations

import pytest

from edgefleet.coordinator.run.training import SteadyRate


def test_the_first_steps_and_validation_time_are_left_out() -> None:
    rate = SteadyRate(skip_steps=3)
    # Three slow warm-up steps (5 s each), then 4 steps of 64 samples, 1 s each, one with 2 s of validation.
    now = 0.0
    for index in range(3):
        now += 5.0
        rate.add(index, 64, now)
    for index, validating in zip(range(3, 7), (0.0, 2.0, 0.0, 0.0)):
        now += 1.0 + validating
        rate.add(index, 64, now)
        if validating:
            rate.exclude(validating)
    assert rate.samples_per_s() == pytest.approx(64.0)


def test_a_run_too_short_to_be_warm_has_no_steady_rate() -> None:
    rate = SteadyRate(skip_steps=3)
    for index in range(3):
        rate.add(index, 64, float(index + 1))
    assert rate.samples_per_s() is None
