from __future__ import annotations

import heapq
import itertools
import re
from typing import Any

import numpy as np
import pytest

from edgefleet.coordinator.planning import search
from edgefleet.coordinator.planning.cost_model import (
    FleetArrays,
    fill_per_board,
    format_duration,
)
from edgefleet.coordinator.planning.objectives import OBJECTIVES
from edgefleet.coordinator.planning.profiles import BoardProfile, FleetProfile
from edgefleet.coordinator.planning.search import FEWER_BOARDS_WITHIN, heuristic_gap, plan
from edgefleet.protocol.errors import PlanError
from tests.planning import (
    GB,
    MB,
    board,
    fleet,
    random_fleet,
    random_variants,
    wild_variants,
)

Row = tuple[float, float, float, int, str, tuple[str, ...], int]


def _split(profiles: list[BoardProfile], caps: list[int], total: int, up: list[float]) -> list[int]:
    """The min-max split by the textbook greedy: one sample at a time to the board whose gradient
    would reach the coordinator first (its compute plus its upload)."""
    sizes = [1] * len(profiles)
    heap = [(p.step_time(2) + up[i], i) for i, p in enumerate(profiles) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(total - len(profiles)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < caps[i]:
            heapq.heappush(heap, (profiles[i].step_time(sizes[i] + 1) + up[i], i))
    return sizes


def _reference(fleets: dict[str, FleetProfile], *, objective: str, global_batches: tuple[int, ...],
               max_power_w: float | None = None, deadline_s: float | None = None, count_idle: bool = False,
               fraction: float = 0.9) -> list[Row]:
    """Every candidate listed explicitly and estimated with the formulas written out again; best first."""
    rows: list[Row] = []
    for label, f in fleets.items():
        for batch in global_batches:
            for size in range(1, len(f.boards) + 1):
                for subset in itertools.combinations(f.boards, size):
                    profiles = [f.boards[b] for b in subset]
                    caps = [min(p.max_batch(fraction), batch) for p in profiles]
                    if size > batch or min(caps) < 1 or sum(caps) < batch:
                        continue
                    up = [f.grad_bytes / p.link_bytes_per_s for p in profiles]
                    sizes = _split(profiles, caps, batch, up)
                    ready = max(p.step_time(b) + u for p, b, u in zip(profiles, sizes, up))
                    down = max(f.grad_bytes / (p.link_down_bytes_per_s or p.link_bytes_per_s) for p in profiles)
                    step = ready + max(down, f.grad_bytes * size / f.coordinator_link_bytes_per_s)
                    epoch = f.dataset_len / (batch / step)
                    power = sum(p.active_power_w for p in profiles)
                    if count_idle:
                        power += sum(q.idle_power_w for q in f.boards.values() if q.board_id not in subset)
                    if (max_power_w is not None and power > max_power_w) or (deadline_s is not None and epoch > deadline_s):
                        continue
                    idle = sum(p.idle_power_w for p in profiles)  # energy: active while computing, idle while exchanging
                    busy = sum((p.active_power_w - p.idle_power_w) * p.step_time(b) for p, b in zip(profiles, sizes))
                    mean_power = idle + busy / step + (power - sum(p.active_power_w for p in profiles))
                    energy = mean_power * epoch
                    value = {"time": epoch, "energy": energy, "edp": energy * epoch}[objective]
                    rows.append((value, epoch, energy, size, label, subset, batch))
    rows.sort(key=lambda r: r[:4])
    return rows


def _front(rows: list[Row]) -> list[tuple[float, float]]:
    out, least = [], np.inf
    for _, epoch, energy, *_ in sorted(rows, key=lambda r: (r[1], r[2])):
        if energy < least * (1 - 1e-9):
            out.append((epoch, energy))
            least = energy
    return out


def _constraints(fastest: float) -> list[dict[str, Any]]:
    """No constraint, each alone, both, idle power counted, and a deadline nothing meets."""
    return [{}, {"max_power_w": 25.0}, {"deadline_s": fastest * 1.3}, {"count_idle": True},
            {"max_power_w": 30.0, "deadline_s": fastest * 1.6}, {"deadline_s": fastest * 0.9}]


@pytest.mark.parametrize("seed", range(10))
def test_exhaustive_search_finds_the_true_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fleets = random_variants(rng, int(rng.integers(3, 7)))
    batches = (8, 24, 64)
    fastest = _reference(fleets, objective="time", global_batches=batches)[0][1]
    for objective in OBJECTIVES:
        for constraints in _constraints(fastest):
            ref = _reference(fleets, objective=objective, global_batches=batches, **constraints)
            if not ref:
                with pytest.raises(PlanError):
                    plan(fleets, objective=objective, global_batches=batches, method="exhaustive", **constraints)
                continue
            result = plan(fleets, objective=objective, global_batches=batches, method="exhaustive",
                          fewer_boards_within=0.0, **constraints)
            chosen = result.chosen
            assert chosen.objective_value(objective) == pytest.approx(ref[0][0], rel=1e-9)
            assert result.passed_over is None
            if len(ref) == 1 or ref[1][0] > ref[0][0] * (1 + 1e-9):  # a unique optimum: the same configuration
                assert (chosen.variant_label, set(chosen.candidate.boards), chosen.candidate.global_batch) == \
                       (ref[0][4], set(ref[0][5]), ref[0][6])
            assert [e.objective_value(objective) for e in result.ranked] == \
                   pytest.approx([r[0] for r in ref[:len(result.ranked)]], rel=1e-9)
            assert result.feasible == len(ref) and all(e.feasible for e in result.ranked)
            got = sorted((e.epoch_time_s, e.energy_per_epoch_j) for e in result.front)
            want = _front(ref)
            assert len(got) == len(want)
            assert np.allclose(np.array(got), np.array(want), rtol=1e-9, atol=0)
            _check_near_ties_go_to_fewer_boards(fleets, objective, batches, constraints, ref)


def _check_near_ties_go_to_fewer_boards(fleets: dict[str, FleetProfile], objective: str, batches: tuple[int, ...],
                                        constraints: dict[str, Any], ref: list[Row]) -> None:
    result = plan(fleets, objective=objective, global_batches=batches, method="exhaustive", **constraints)
    within = [r for r in ref if r[0] <= ref[0][0] * (1 + FEWER_BOARDS_WITHIN)]
    fewest = min(r[3] for r in within)
    chosen = result.chosen
    assert len(chosen.candidate.boards) == fewest
    assert chosen.objective_value(objective) == pytest.approx(min(r[0] for r in within if r[3] == fewest), rel=1e-9)
    if ref[0][3] == fewest:
        assert result.passed_over is None
    else:  # the best estimate is passed over, and listed right after the chosen one
        assert result.passed_over is result.ranked[1]
        assert result.passed_over.objective_value(objective) == pytest.approx(ref[0][0], rel=1e-9)
    assert [e.objective_value(objective) for e in result.ranked[1:]] == \
           sorted(e.objective_value(objective) for e in result.ranked[1:])


def test_identical_boards_tie_and_the_optimum_is_still_exact() -> None:
    fleets = {"default": fleet(*(board(f"pi4-{i}", a=0.03, c=0.004, link=12.5 * MB) for i in range(6)),
                               grad_bytes=250_000, dataset_len=60_000)}
    for objective in OBJECTIVES:
        result = plan(fleets, objective=objective, global_batches=(16, 48))
        ref = _reference(fleets, objective=objective, global_batches=(16, 48))
        assert result.chosen.objective_value(objective) == pytest.approx(ref[0][0], rel=1e-9)
        assert len(result.chosen.candidate.boards) == ref[0][3]   # ties go to the smaller set
        assert max(result.chosen.candidate.batch_sizes) - min(result.chosen.candidate.batch_sizes) <= 1


def test_the_planner_chooses_by_objective() -> None:
    fast_hungry = board("x86-1", a=0.01, c=0.001, active_w=25.0, idle_w=8.0, link=12.5 * MB)
    slow_lean = board("pi4-1", a=0.02, c=0.004, active_w=6.0, idle_w=2.7, link=12.5 * MB)
    fleets = {"default": fleet(fast_hungry, slow_lean, grad_bytes=250_000, dataset_len=60_000)}
    by_time = plan(fleets, objective="time", global_batches=(64,))
    by_energy = plan(fleets, objective="energy", global_batches=(64,))
    assert set(by_time.chosen.candidate.boards) == {"x86-1", "pi4-1"}
    assert by_energy.chosen.candidate.boards == ("pi4-1",)
    assert by_time.chosen.epoch_time_s < by_energy.chosen.epoch_time_s
    assert by_energy.chosen.energy_per_epoch_j < by_time.chosen.energy_per_epoch_j


def _three_boards() -> dict[str, FleetProfile]:
    return {"default": fleet(board("a", c=0.010, active_w=5.0, idle_w=2.0),
                             board("b", c=0.005, active_w=7.0, idle_w=2.0),
                             board("c", c=0.002, active_w=9.0, idle_w=3.0), dataset_len=6000)}


def test_an_impossible_power_cap_says_by_how_much() -> None:
    with pytest.raises(PlanError, match=r"^the lowest-power configuration draws 5\.0 W; --max-power 4 W is 1\.0 W short$"):
        plan(_three_boards(), objective="time", max_power_w=4, global_batches=(32,))
    with pytest.raises(PlanError, match=r"draws 10\.0 W; --max-power 8 W is 2\.0 W short \(idle boards are counted\)"):
        plan(_three_boards(), objective="time", max_power_w=8, count_idle=True, global_batches=(32,))


def test_an_impossible_deadline_says_by_how_much() -> None:
    fleets = _three_boards()
    fastest = _reference(fleets, objective="time", global_batches=(32,))[0][1]
    deadline = fastest * 0.8
    expected = (f"the fastest feasible configuration needs {format_duration(fastest)} per epoch; "
                f"--deadline {format_duration(deadline)} is {format_duration(fastest - deadline)} short")
    with pytest.raises(PlanError, match=f"^{re.escape(expected)}$"):
        plan(fleets, objective="energy", deadline_s=deadline, global_batches=(32,))


def test_power_cap_and_deadline_compose() -> None:
    fleets = _three_boards()
    within_cap = _reference(fleets, objective="time", global_batches=(32,), max_power_w=6)[0][1]  # board a alone
    unlimited = _reference(fleets, objective="time", global_batches=(32,))[0][1]
    deadline = (within_cap + unlimited) / 2   # met without the cap, not within it
    with pytest.raises(PlanError) as err:
        plan(fleets, objective="time", max_power_w=6, deadline_s=deadline, global_batches=(32,))
    message = str(err.value)
    assert message.startswith(f"the fastest feasible configuration needs {format_duration(within_cap)} per epoch")
    assert f"within --max-power 6 W; without it the fastest needs {format_duration(unlimited)}" in message
    # Both satisfiable: the choice meets both, and is the best that does.
    result = plan(fleets, objective="energy", max_power_w=13, deadline_s=unlimited * 1.5, global_batches=(32,))
    ref = _reference(fleets, objective="energy", global_batches=(32,), max_power_w=13, deadline_s=unlimited * 1.5)
    assert result.chosen.power_w <= 13 and result.chosen.epoch_time_s <= unlimited * 1.5
    assert result.chosen.energy_per_epoch_j == pytest.approx(ref[0][0], rel=1e-9)
    assert {x.constraint for x in result.ruled_out} == {"power", "deadline"}


def test_memory_rules_out_candidates_and_names_the_board() -> None:
    fleets = {"default": fleet(board("tiny", m0=950 * MB, memory=1 * GB), board("pi4-1", m0=200 * MB, m1=10 * MB,
                                                                          memory=1 * GB), board("x86-1", memory=8 * GB))}
    result = plan(fleets, objective="time", global_batches=(128,))
    assert "tiny" not in result.chosen.candidate.boards
    by_board = {(x.constraint, x.board_id): x for x in result.ruled_out}
    assert by_board[("memory", "tiny")].count == 4          # every subset with tiny in it
    assert "tiny cannot fit even one sample" in by_board[("memory", "tiny")].example
    together = by_board[("memory", None)]                    # pi4-1 alone holds (900-200)/10 = 70 < 128
    assert together.count == 1 and "pi4-1 <= 70" in together.example
    for e in result.ranked:
        assert min(e.memory_headroom) >= 0.1 - 1e-12


def test_memory_shortfall_message_gives_the_figures() -> None:
    only = {"default": fleet(board("pi4-1", m0=200 * MB, m1=10 * MB, memory=1 * GB))}
    with pytest.raises(PlanError, match=r"^no configuration fits in memory: .* hold at most 70 samples per step, "
                                        r"the smallest --batch is 128 \(58 short\)"):
        plan(only, objective="time", global_batches=(128, 256))


@pytest.mark.parametrize("seed", range(8))
def test_heuristic_gap_is_small_on_random_instances(seed: int) -> None:
    gaps = []
    for maker in (random_variants, wild_variants):
        fleets = maker(np.random.default_rng(1000 + seed), 12)
        for objective in OBJECTIVES:
            for constraints in ({}, {"max_power_w": 40.0}):
                try:
                    report = heuristic_gap(fleets, objective=objective, global_batches=(32, 128, 512), **constraints)
                except PlanError:
                    continue
                assert report.gap >= -1e-9  # exhaustive is exact: the heuristic can only match or lose
                gaps.append(report.gap)
    assert len(gaps) >= 8
    # Measured over 60 such instances per kind: no gap without constraints, one 13% outlier under
    # a tight power cap (a knapsack-like case). The bounds leave room for that, no more.
    assert float(np.mean(gaps)) <= 0.03
    assert max(gaps) <= 0.2


def test_large_fleets_use_the_heuristic_and_respect_constraints() -> None:
    fleets = {"default": random_fleet(np.random.default_rng(7), 60)}
    result = plan(fleets, objective="time", max_power_w=120, deadline_s=600, global_batches=(64, 256))
    assert result.method == "heuristic"
    assert result.chosen.power_w <= 120 and result.chosen.epoch_time_s <= 600
    assert 1 < len(result.chosen.candidate.boards) < 60
    assert sum(result.chosen.candidate.batch_sizes) == result.chosen.candidate.global_batch


def test_move_tables_match_sums_over_the_members() -> None:
    profile = random_fleet(np.random.default_rng(3), 30)
    fa = FleetArrays.from_fleet(profile, 0.9)
    per_board = fill_per_board(fa, 64)
    current = np.zeros(30, dtype=bool)
    current[[1, 4, 5, 9, 17, 22, 28]] = True
    moves, tables = search._single_moves(current, np.ones(30, dtype=bool), fa.link_s,
                                             per_board[current].sum(axis=0), per_board)
    assert len(moves) > 30  # flips and link drops
    assert np.allclose(tables, moves.astype(float) @ per_board)
    swaps = search._swaps(current, moves, np.arange(len(moves), dtype=float))
    assert np.allclose(search._move_tables(current, per_board[current].sum(axis=0), per_board, swaps),
                       swaps.astype(float) @ per_board)


def test_bad_requests_are_refused() -> None:
    fleets = _three_boards()
    with pytest.raises(PlanError, match="objective 'fast'"):
        plan(fleets, objective="fast")
    with pytest.raises(PlanError, match="--batch"):
        plan(fleets, objective="time", global_batches=(0,))
    with pytest.raises(PlanError, match="--max-power"):
        plan(fleets, objective="time", max_power_w=-1)
    big = {"default": random_fleet(np.random.default_rng(1), 19)}
    with pytest.raises(PlanError, match="2\\^19 subsets"):
        plan(big, objective="time", method="exhaustive")


def _two_fast_and_a_slow(slow_c: float) -> dict[str, FleetProfile]:
    fast = [board(f"x86-{i}", a=0.01, c=0.001, link=100 * MB) for i in (1, 2)]
    return {"default": fleet(*fast, board("nano-1", a=0.005, c=slow_c, link=100 * MB), grad_bytes=100_000)}


def test_a_slow_board_that_buys_less_than_the_margin_is_left_out() -> None:
    fleets = _two_fast_and_a_slow(0.01)  # nano-1 at 3 samples: 0.5% faster by estimate
    best = plan(fleets, objective="time", global_batches=(64,), fewer_boards_within=0.0).chosen
    assert best.candidate.boards == ("x86-1", "x86-2", "nano-1")
    result = plan(fleets, objective="time", global_batches=(64,))
    assert result.chosen.candidate.boards == ("x86-1", "x86-2")
    assert result.passed_over is not None and result.passed_over.candidate == best.candidate
    assert result.chosen.epoch_time_s <= best.epoch_time_s * (1 + FEWER_BOARDS_WITHIN)
    assert result.ranked[:2] == (result.chosen, result.passed_over)


def test_a_slow_board_that_buys_more_than_the_margin_takes_part() -> None:
    result = plan(_two_fast_and_a_slow(0.005), objective="time", global_batches=(64,))  # 5% faster with nano-1
    assert result.chosen.candidate.boards == ("x86-1", "x86-2", "nano-1")
    assert result.passed_over is None


def test_the_margin_must_be_a_fraction() -> None:
    with pytest.raises(PlanError, match="fewer_boards_within 2 must be a fraction"):
        plan(_two_fast_and_a_slow(0.01), objective="time", global_batches=(64,), fewer_boards_within=2)
