from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from edgefleet.coordinator.run.rebalance import Rebalancer

# Time per sample of three boards; with batches 16, 16, 48 all finish a step in 0.48 s.
PER_SAMPLE = {"pi4-1": 0.030, "pi5-1": 0.030, "x86-1": 0.010}
BATCHES = {"pi4-1": 16, "pi5-1": 16, "x86-1": 48}


def _times(batches: dict[str, int], per_sample: dict[str, float], rng: np.random.Generator | None = None,
           noise: float = 0.0) -> dict[str, float]:
    return {b: n * per_sample[b] * (1 + (rng.uniform(-noise, noise) if rng is not None else 0.0))
            for b, n in batches.items()}


def test_a_board_that_slows_40_percent_gets_a_smaller_batch_within_a_few_steps(caplog: pytest.LogCaptureFixture) -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5, explain=lambda board: f"hot: 84 °C on {board}")
    rng = np.random.default_rng(0)
    for step in range(10):
        assert rebalancer.observe(_times(rebalancer.batch_sizes, PER_SAMPLE, rng, 0.03), step=step) is None
    throttled = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.4})
    decision = None
    with caplog.at_level(logging.INFO, logger="edgefleet.coordinator.run.rebalance"):
        for step in range(10, 30):
            decision = rebalancer.observe(_times(rebalancer.batch_sizes, throttled, rng, 0.03), step=step)
            if decision:
                break
    assert decision is not None and decision.step is not None
    assert decision.step - 10 <= 10                                 # two windows of 5 slow steps: seen, then confirmed
    new = decision.new_batch_sizes
    assert new["pi4-1"] < 16 and sum(new.values()) == sum(BATCHES.values()) == rebalancer.global_batch
    assert new == {"pi4-1": 12, "pi5-1": 17, "x86-1": 51}         # 80 samples in proportion 1/0.042 : 1/0.03 : 1/0.01
    assert decision.predicted_step_s < decision.current_step_s
    assert re.fullmatch(r"pi4-1 slowed (3[5-9]|4[0-5])% \(hot: 84 °C on pi4-1\): batches 16,16,48 -> 12,17,51", decision.message)
    assert any(decision.message in r.getMessage() for r in caplog.records)


def test_noise_within_the_threshold_never_changes_the_batches() -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
    rng = np.random.default_rng(1)
    # +-6% per step: two medians can differ by at most 1.06 / 0.94 - 1 = 12.8% < 15%
    for step in range(3000):
        assert rebalancer.observe(_times(BATCHES, PER_SAMPLE, rng, 0.06), step=step) is None
    assert rebalancer.batch_sizes == BATCHES and not rebalancer.decisions


def test_no_oscillation_after_a_change() -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
    rng = np.random.default_rng(2)
    throttled = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.4})
    for step in range(2000):
        speeds = PER_SAMPLE if step < 20 else throttled
        rebalancer.observe(_times(rebalancer.batch_sizes, speeds, rng, 0.06), step=step)
    assert len(rebalancer.decisions) == 1
    assert sum(rebalancer.batch_sizes.values()) == 80


def test_a_board_that_recovers_gets_its_samples_back() -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
    throttled = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.4})
    for step in range(60):
        speeds = throttled if 10 <= step < 30 else PER_SAMPLE
        rebalancer.observe(_times(rebalancer.batch_sizes, speeds), step=step)
    assert [d.new_batch_sizes["pi4-1"] for d in rebalancer.decisions] == [12, 16]
    assert "pi4-1 sped up" in rebalancer.decisions[1].message
    assert rebalancer.batch_sizes == BATCHES


def test_every_board_slowing_alike_is_no_reason_to_move_samples() -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
    hot = {b: t * 1.3 for b, t in PER_SAMPLE.items()}
    for step in range(100):
        assert rebalancer.observe(_times(BATCHES, hot if step >= 10 else PER_SAMPLE), step=step) is None


def test_steps_run_with_old_sizes_and_missing_boards_are_handled() -> None:
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=3, max_batch={"x86-1": 50})
    throttled = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.5})
    decision = None
    for step in range(30):
        times = _times(rebalancer.batch_sizes, throttled if step >= 12 else PER_SAMPLE)
        if step == 5:
            times.pop("pi5-1")  # a late board: that step says nothing about it
        decision = decision or rebalancer.observe(times, step=step, batch_sizes=rebalancer.batch_sizes)
    assert decision is not None
    assert decision.new_batch_sizes["x86-1"] <= 50                 # the cap holds
    # A step still computed with the old sizes (the decision in flight) is ignored.
    assert rebalancer.observe(_times(BATCHES, PER_SAMPLE), batch_sizes=BATCHES) is None
    with pytest.raises(ValueError):
        Rebalancer({"pi4-1": 0})


def test_a_drift_first_seen_through_one_slow_outlier_is_split_by_the_steps_since_the_change() -> None:
    # Arrange: a spike (1.4x) two steps before pi4-1 drops to a third of its speed.
    rebalancer = Rebalancer(BATCHES, threshold=0.3, window=5)
    slow = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 3})
    spike = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.4})
    decision = None
    # Act
    for step in range(20):
        speeds = PER_SAMPLE if step < 7 or step == 8 else spike if step == 7 else slow
        decision = rebalancer.observe(_times(rebalancer.batch_sizes, speeds), step=step)
        if decision:
            break
    # Assert: split for the real speed (80 samples in proportion 1/0.09 : 1/0.03 : 1/0.01), not for
    # 1.4x (which would leave pi4-1 13 samples).
    assert decision is not None and decision.step == 19  # judged past the bar at step 14, confirmed at 19
    assert decision.new_batch_sizes == {"pi4-1": 6, "pi5-1": 18, "x86-1": 56}


def test_a_split_that_leaves_a_board_the_slowest_is_corrected_once_its_reference_is_measured() -> None:
    # Arrange: pi4-1 slows to 1.5x, is re-balanced for that, then slows on to 3x before the new
    # sizes run: the fresh reference at the new sizes already has it at 3x, so no drift shows.
    rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
    warm = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.5})
    hot = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 3})
    # Act
    for step in range(40):
        speeds = PER_SAMPLE if step < 10 else hot if rebalancer.decisions else warm
        rebalancer.observe(_times(rebalancer.batch_sizes, speeds), step=step)
    # Assert: the first decision was for 1.5x; the check of its reference moved the rest, once.
    first, second = rebalancer.decisions
    assert first.new_batch_sizes["pi4-1"] == 11 and first.drift
    assert second.drift == {} and second.step == first.step + rebalancer.reference_steps
    assert second.new_batch_sizes == {"pi4-1": 6, "pi5-1": 18, "x86-1": 56}
    assert second.message == ("pi4-1 still the slowest at the new sizes (0.990 s a step, the others 0.520 s): "
                              "batches 11,17,52 -> 6,18,56")


def _lognormal_times(batches: dict[str, int], per_sample: dict[str, float], rng: np.random.Generator,
                     sigma: float) -> dict[str, float]:
    return {b: n * per_sample[b] * float(rng.lognormal(0.0, sigma)) for b, n in batches.items()}


EQUAL = {"demo-pi4": 0.001, "demo-pi5": 0.001, "demo-nano": 0.001}


def test_equal_boards_on_a_busy_host_are_not_rebalanced() -> None:
    # Arrange: three equal boards whose step times swing by +-40% (lognormal sigma 0.4: three boards
    # and a coordinator sharing two busy cores in the demo measured 0.41-0.48), the demo's defaults,
    # 230 steps, 20 runs. Before noise counted, every run re-balanced several times.
    runs_with_changes = []
    for seed in range(20):
        rebalancer = Rebalancer(dict.fromkeys(EQUAL, 16), threshold=0.15, window=5)
        rng = np.random.default_rng(seed)
        # Act
        for step in range(230):
            rebalancer.observe(_lognormal_times(rebalancer.batch_sizes, EQUAL, rng, 0.4), step=step, steps_left=230 - step - 4)
        if rebalancer.decisions:
            runs_with_changes.append((seed, [d.message for d in rebalancer.decisions]))
    # Assert: a chance alarm is possible (about 1 run in 100 at this noise), a habit is not.
    assert len(runs_with_changes) <= 1, runs_with_changes


def test_a_board_cut_to_a_third_is_caught_through_noise() -> None:
    caught = []
    for seed in range(10):
        rebalancer = Rebalancer(dict.fromkeys(EQUAL, 16), threshold=0.15, window=5)
        rng = np.random.default_rng(seed)
        slow_steps = {b: 10 * t for b, t in EQUAL.items()}  # 0.16 s steps: windows of 5 span more than MIN_WINDOW_S
        cut = dict(slow_steps, **{"demo-nano": 0.03})
        decision = None
        for step in range(100):
            speeds = slow_steps if step < 20 else cut
            decision = rebalancer.observe(_lognormal_times(rebalancer.batch_sizes, speeds, rng, 0.3), step=step,
                                          steps_left=200) or decision
            if decision is not None:
                break
        assert decision is not None, f"seed {seed}: a 3x slow-down went unnoticed"
        assert decision.new_batch_sizes["demo-nano"] < 16 and decision.step is not None
        caught.append(decision.step - 20)
    # Two windows of 5 steps when the noise allows; the noisier a board, the longer its windows.
    assert min(caught) == 9 and max(caught) <= 30, caught


def test_no_split_is_proposed_that_cannot_pay_for_itself_before_the_end() -> None:
    throttled = dict(PER_SAMPLE, **{"pi4-1": PER_SAMPLE["pi4-1"] * 1.4})
    for steps_left, expected in ((0, 0), (1, 0), (50, 1)):
        rebalancer = Rebalancer(BATCHES, threshold=0.15, window=5)
        for step in range(30):
            speeds = PER_SAMPLE if step < 10 else throttled
            rebalancer.observe(_times(rebalancer.batch_sizes, speeds), step=step, steps_left=steps_left)
        assert len(rebalancer.decisions) == expected, steps_left


def test_a_burst_shorter_than_two_windows_of_half_a_second_is_no_drift() -> None:
    # Arrange: the demo's 16 ms steps; one board three times slower for a burst, then for good.
    def run(burst_steps: int) -> list[int]:
        rebalancer = Rebalancer(dict.fromkeys(EQUAL, 16), threshold=0.15, window=5)
        cut = dict(EQUAL, **{"demo-nano": 0.003})
        for step in range(200):
            speeds = cut if 30 <= step < 30 + burst_steps else EQUAL
            rebalancer.observe(_times(rebalancer.batch_sizes, speeds), step=step, steps_left=200 - step)
        return [d.step for d in rebalancer.decisions if d.step is not None]
    # Act, Assert: a burst of 15 steps (0.7 s of the slow board's compute) moves nothing; a lasting cut
    # is acted on once two windows of 0.5 s (11 steps of 48 ms) confirm it.
    assert run(15) == []
    decided = run(170)
    assert decided and decided[0] - 30 <= 3 * 11, decided
