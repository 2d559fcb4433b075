from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgefleet.coordinator.planning import search
from edgefleet.coordinator.planning.cost_model import (
    OK,
    Candidate,
    FleetArrays,
    SubsetStats,
    allocate_batches,
    estimate,
)
from edgefleet.coordinator.planning.search import Limits
from edgefleet.protocol.errors import PlanError
from tests.planning import GB, MB, board, fleet, random_fleet


def _two_boards(coordinator_link: float = 100 * MB):
    # A: 0.1 + 0.01 b s, link 10 MB/s both ways; B: 0.1 + 0.02 b s, 5 MB/s up, 10 MB/s down.
    a = board("a", a=0.1, c=0.01, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=5.0, idle_w=2.0, link=10 * MB)
    b = board("b", a=0.1, c=0.02, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=7.0, idle_w=2.5,
              link=5 * MB, link_down=10 * MB)
    c = board("c", active_w=9.0, idle_w=3.0)
    return fleet(a, b, c, grad_bytes=1 * MB, coordinator_link=coordinator_link, dataset_len=6000)


def test_estimate_by_hand() -> None:
    est = estimate(Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={}), _two_boards())
    # compute: a 0.1 + 0.4 = 0.5 s, b 0.1 + 0.4 = 0.5 s
    assert est.compute_s == pytest.approx((0.5, 0.5))
    # gradient at the coordinator: a 0.5 + 1 MB / 10 MB/s = 0.6 s, b 0.5 + 1 MB / 5 MB/s = 0.7 s;
    # then the average back: 1 MB / 10 MB/s = 0.1 s for both (coordinator 1 MB * 2 / 100 MB/s = 0.02 s)
    assert est.exchange_s == pytest.approx(0.3)                  # 0.8 s step - 0.5 s compute
    assert est.step_time_s == pytest.approx(0.8)
    assert est.samples_per_s == pytest.approx(60 / 0.8)          # 75 samples/s
    assert est.epoch_time_s == pytest.approx(6000 / 75)          # 80 s
    assert est.power_w == pytest.approx(12.0)                    # 5 + 7, c idle not counted
    # energy per step: idle 4.5 W * 0.8 s, plus (active - idle) while computing 0.5 s: 3.6 + 3 * 0.5 + 4.5 * 0.5 J
    assert est.energy_per_epoch_j == pytest.approx(7.35 * 100)   # 100 steps per epoch: 735 J
    assert est.edp_j_s == pytest.approx(735.0 * 80)
    assert est.peak_memory_bytes == (140 * MB, 120 * MB)
    assert est.memory_headroom == pytest.approx((0.86, 0.88))
    assert est.feasible and est.power_estimated


def test_moving_the_gradients_is_charged_at_the_link_power() -> None:
    profile = _two_boards()
    a, b = profile.boards["a"], profile.boards["b"]
    measured = fleet(board("a", a=0.1, c=0.01, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=5.0, idle_w=2.0,
                           link=10 * MB, link_w=3.0),
                     board("b", a=0.1, c=0.02, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=7.0, idle_w=2.5,
                           link=5 * MB, link_down=10 * MB, link_w=4.5),
                     grad_bytes=1 * MB, coordinator_link=100 * MB, dataset_len=6000)
    assert (a.link_power_w, b.link_power_w) == (None, None)
    est = estimate(Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={}), measured)
    assert est.step_time_s == pytest.approx(0.8) and est.power_w == pytest.approx(12.0)  # time and peak unchanged
    # test_estimate_by_hand's 7.35 J a step, plus a (3 - 2) W x (0.1 s up + 0.1 s down) and b (4.5 - 2.5) W x (0.2 + 0.1 s)
    assert est.energy_per_epoch_j == pytest.approx((7.35 + 0.2 + 0.6) * 100)
    result = search.plan({"default": measured}, objective="energy", global_batches=(60,))
    row = next(e for e in result.ranked if e.candidate.boards == ("a", "b"))  # the search's arrays agree
    assert row.energy_per_epoch_j == pytest.approx(estimate(row.candidate, measured).energy_per_epoch_j)


def test_a_board_whose_gradient_rounds_were_slow_is_charged_their_time_and_draw() -> None:
    # b's 1 MB gradient went up and back in 0.6 s, twice what its bulk rates say (0.2 s up + 0.1 s down)
    def two(link_round: tuple[int, float] | None) -> Any:
        return fleet(board("a", a=0.1, c=0.01, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=5.0, idle_w=2.0,
                           link=10 * MB, link_w=3.0),
                     board("b", a=0.1, c=0.02, m0=100 * MB, m1=1 * MB, memory=1 * GB, active_w=7.0, idle_w=2.5,
                           link=5 * MB, link_down=10 * MB, link_w=4.5, link_round=link_round),
                     grad_bytes=1 * MB, coordinator_link=100 * MB, dataset_len=6000)
    candidate = Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={})
    bulk, slow = estimate(candidate, two(None)), estimate(candidate, two((1 * MB, 0.6)))
    # b's gradient is ready at 0.1 + 0.4 + 0.4 s (not 0.1 + 0.4 + 0.2) and its average comes down in 0.2 s (not 0.1)
    assert bulk.step_time_s == pytest.approx(0.8) and slow.step_time_s == pytest.approx(0.9 + 0.2)
    # a step: idle 4.5 W x 1.1 s, computing 3 x 0.5 + 4.5 x 0.5, moving bytes a (3 - 2) W x 0.2 s, b (4.5 - 2.5) W x 0.6 s
    assert bulk.energy_per_epoch_j == pytest.approx((7.35 + 0.2 + 0.6) * 100)
    assert slow.energy_per_epoch_j == pytest.approx((4.5 * 1.1 + 3.75 + 0.2 + 1.2) * 100)
    result = search.plan({"default": two((1 * MB, 0.6))}, objective="energy", global_batches=(60,))
    row = next(e for e in result.ranked if e.candidate.boards == ("a", "b"))  # the search's arrays agree
    assert row.energy_per_epoch_j == pytest.approx(estimate(row.candidate, two((1 * MB, 0.6))).energy_per_epoch_j)


def test_idle_boards_are_charged_when_counted_and_the_coordinator_link_can_dominate() -> None:
    est = estimate(Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={}), _two_boards(10 * MB), count_idle=True)
    assert est.exchange_s == pytest.approx(0.4)                  # 0.2 s up (in ready) + 1 MB * 2 boards / 10 MB/s
    assert est.power_w == pytest.approx(15.0)                    # + c's 3 W idle
    assert est.epoch_time_s == pytest.approx(6000 / (60 / 0.9))
    assert est.energy_per_epoch_j == pytest.approx((4.5 * 0.9 + 3 * 0.5 + 4.5 * 0.5 + 3.0 * 0.9) * 100)


def test_constraints_flag_the_estimate_and_name_the_memory_board() -> None:
    profile = _two_boards()
    too_big = estimate(Candidate(boards=("a", "b"), batch_sizes=(900, 20), variant={}), profile)
    # a at 900: 100 + 900 = 1000 MB > 0.9 * 1 GB
    assert too_big.constraint == "memory" and too_big.ruled_out_board == "a"
    assert "a needs ~1.00 GB for batch 900" in too_big.ruled_out
    hot = estimate(Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={}), profile, max_power_w=10)
    assert hot.constraint == "power" and "12.0 W" in hot.ruled_out
    late = estimate(Candidate(boards=("a", "b"), batch_sizes=(40, 20), variant={}), profile, deadline_s=60)
    assert late.constraint == "deadline" and "80.0 s per epoch" in late.ruled_out


def test_allocation_is_proportional_to_throughput_without_intercepts() -> None:
    boards = [board("x", a=0, c=0.01), board("y", a=0, c=0.02), board("z", a=0, c=0.04)]
    assert allocate_batches(boards, global_batch=70) == (40, 20, 10)
    sizes = allocate_batches(boards, global_batch=71)
    assert sum(sizes) == 71 and sizes in {(41, 20, 10), (40, 21, 10), (40, 20, 11)}


@pytest.mark.parametrize("seed", range(20))
def test_allocation_sums_and_all_boards_finish_together(seed: int) -> None:
    rng = np.random.default_rng(seed)
    boards = list(random_fleet(rng, int(rng.integers(1, 9))).boards.values())
    total = int(rng.integers(len(boards), 300))
    sizes = allocate_batches(boards, global_batch=total)
    assert sum(sizes) == total and min(sizes) >= 1
    slowest = max(p.step_time(b) for p, b in zip(boards, sizes))
    # Optimal: finishing strictly before `slowest` the boards could not take all the samples.
    within = [sum(1 for k in range(1, min(p.max_batch(0.9), total) + 1) if p.step_time(k) < slowest - 1e-12)
              for p in boards]
    assert min(within) == 0 or sum(within) < total
    for p, b in zip(boards, sizes):
        assert p.peak_memory(b) <= p.memory_total_bytes * 0.9


def test_memory_caps_move_samples_to_boards_with_room() -> None:
    small = board("small", a=0, c=0.001, m0=200 * MB, m1=10 * MB, memory=1 * GB)   # fits (900-200)/10 = 70
    big = board("big", a=0, c=0.01, memory=8 * GB)
    assert allocate_batches([small, big], global_batch=200) == (70, 130)
    assert allocate_batches([small, big], global_batch=200, max_memory_fraction=0.5) == (30, 170)


def test_memory_that_rules_a_request_out_is_named() -> None:
    tiny = board("pi4-1", m0=950 * MB, memory=1 * GB)
    with pytest.raises(PlanError, match=r"pi4-1 cannot fit even one sample.*--exclude pi4-1"):
        allocate_batches([tiny, board("x86-1")], global_batch=32)
    small = board("pi4-2", m0=200 * MB, m1=10 * MB, memory=1 * GB)                # caps at 70
    with pytest.raises(PlanError, match=r"global batch 100 does not fit.*at most 70 samples.*pi4-2 <= 70.*30 short"):
        allocate_batches([small], global_batch=100)
    with pytest.raises(PlanError, match="smaller than the 2 boards"):
        allocate_batches([small, board("x86-1")], global_batch=1)


def test_per_board_mode_gives_the_fastest_board_the_batch() -> None:
    boards = [board("fast", a=0, c=0.01), board("slow", a=0, c=0.04), board("mid", a=0, c=0.02)]
    assert allocate_batches(boards, per_board_batch=32) == (32, 8, 16)


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_rows_match_the_scalar_estimate(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    profile = random_fleet(rng, 7)
    limits = Limits(max_power_w=None, deadline_s=None, count_idle=bool(seed % 2), max_memory_fraction=0.9)
    fa = FleetArrays.from_fleet(profile, 0.9)
    block = search._evaluate("default", profile, fa, SubsetStats.all_subsets(fa), 48, limits)
    low, high = dict(block.lb), dict(block.ub)
    low = {k: v.copy() for k, v in low.items()}
    high = {k: v.copy() for k, v in high.items()}
    rows = np.nonzero(block.code == OK)[0]
    search._refine_rows(block, rows, limits)
    for row in rows:
        ids = tuple(fa.board_ids[i] for i in np.nonzero(block.masks[row])[0])
        sizes = allocate_batches([profile.boards[b] for b in ids], global_batch=48, grad_bytes=profile.grad_bytes)
        est = estimate(Candidate(boards=ids, batch_sizes=sizes, variant={}), profile, count_idle=limits.count_idle)
        for name in ("step_time_s", "epoch_time_s", "power_w", "energy_per_epoch_j", "edp_j_s"):
            exact = block.lb[name][row]
            assert exact == pytest.approx(getattr(est, name), rel=1e-12)
            assert low[name][row] <= exact * (1 + 1e-12) and exact <= high[name][row] * (1 + 1e-12)
