"""A pipeline revised around a board that slowed for good (issue 35, CEFT): which board drifted (``StageWatch``), and
the plan at the measured speeds (``revise``): cuts moved, a slowed later stage left out, stage 0's slices shared out
by speed, memory kept within each board's limit, and no revision that does not pay."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from edgefleet.coordinator.pipeline import revision as revision_module
from edgefleet.coordinator.pipeline.replan import replan
from edgefleet.coordinator.pipeline.revision import OPTIMIZER_COPIES, unit_ends
from edgefleet.coordinator.pipeline.stage_plan import parse_stage_plan
from edgefleet.coordinator.pipeline.stage_watch import StageWatch
from edgefleet.protocol.profile_report import UnitReport

MS = 1e-3
revise = functools.partial(revision_module.revise, fixed_s=0.0)  # the figures below count the units' work only
RAM = {b: 4 * 2**30 for b in ("a", "a1", "a2", "b", "c")}  # 4 GiB boards: memory binds only where a test says so


def _units(*per_sample_ms: float, params: int = 1000, everywhere: bool = False) -> list[UnitReport]:
    """Units u0, u1, ... each ``per_sample_ms`` of forward and backward a sample, no fixed cost; ``params`` bytes in
    u0 (or in every unit): free to move into stage 0, whose exchange a revision may grow by a tenth of the model's."""
    return [UnitReport(name=f"u{i}", forward_intercept_s=0.0, forward_s_per_sample=t * MS / 2, backward_intercept_s=0.0,
                       backward_s_per_sample=t * MS / 2, param_bytes=params if everywhere or i == 0 else 0,
                       activation_bytes_per_sample=0, held_bytes_per_sample=0) for i, t in enumerate(per_sample_ms)]


def _busy(units: list[UnitReport], plan_text: str, sizes: list[int], speed: dict[str, float],
          micro_batches: int = 1) -> dict[str, float]:
    """Each board's busy time at ``speed`` (1: the units' own) under the plan: stage 0's on its slice, a later board's
    on the samples train routes it (a stage of one board: the global batch; a group's: its micro-batches')."""
    from edgefleet.protocol.stage_routes import stage_routes

    plan = parse_stage_plan(plan_text)
    ends = unit_ends(units, plan.cuts)
    assert ends is not None
    starts = [0, *(e + 1 for e in ends[:-1])]
    work = [sum(u.forward_s_per_sample + u.backward_s_per_sample for u in units[lo:hi + 1])
            for lo, hi in zip(starts, ends)]
    routes = stage_routes(plan.sizes, sizes, micro_batches)
    busy = {b: speed.get(b, 1.0) * work[0] * n for b, n in zip(plan.boards[:plan.group], sizes)}
    for k in range(1, len(plan.sizes)):
        busy |= {b: speed.get(b, 1.0) * work[k] * routes.rows_of(k, i) for i, b in enumerate(plan.stage_boards(k))}
    return busy


def test_a_later_stage_that_slowed_gives_its_layers_to_its_neighbour() -> None:
    units = _units(1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b")  # two units each: 128 ms a stage at batch 64
    busy = _busy(units, plan.text(), [64], {"b": 3.0})  # b now takes 3x as long
    revision = revise(plan, [64, 0], 4, units, busy, slowed=["b"], ram_bytes=RAM)
    assert revision is not None
    assert revision.pipeline == "a,u2@b"  # b keeps one unit: 64 x 3 = 192 ms against a's 192 ms
    assert revision.batch_sizes == (64, 0)
    assert revision.predicted_s == pytest.approx((0.192 + 0.192 + 3 * 0.192) / 4)  # GPipe: fill, drain, the pace
    assert revision.current_s == pytest.approx((0.128 + 0.384 + 3 * 0.384) / 4)
    assert "cuts u2" in revision.why


def test_a_later_stage_far_slower_than_the_work_it_could_keep_is_left_out() -> None:
    units = _units(1, 1, 1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b,u3@c")
    busy = _busy(units, plan.text(), [32], {"c": 20.0})
    revision = revise(plan, [32, 0, 0], 2, units, busy, slowed=["c"], ram_bytes=RAM)
    assert revision is not None and revision.boards == ("a", "b")
    assert revision.pipeline in ("a,u2@b", "a,u1@b")
    assert "c's layers to its neighbours" in revision.why
    assert revision.batch_sizes == (32, 0)


def test_stage_0s_slices_are_shared_out_by_its_boards_speeds() -> None:
    units = _units(2, 1, 1)
    plan = parse_stage_plan("a1+a2,u0@b")
    busy = _busy(units, plan.text(), [32, 32], {"a2": 3.0})
    revision = revise(plan, [32, 32, 0], 2, units, busy, slowed=["a2"], ram_bytes=RAM)
    assert revision is not None
    assert sum(revision.batch_sizes) == 64 and revision.batch_sizes[2] == 0  # the global batch is the run's
    assert revision.batch_sizes[0] == 48 and revision.batch_sizes[1] == 16  # a2 at a third of a1's pace
    assert "stage 0's slices 32,32 -> 48,16" in revision.why


def test_no_board_is_given_more_than_its_memory_allows() -> None:
    units = _units(1, 1, 1, 1, params=100_000_000, everywhere=True)
    plan = parse_stage_plan("a,u1@b")
    busy = _busy(units, plan.text(), [64], {"a": 3.0})  # stage 0 slowed: the best plan moves layers onto b
    present = 2 * 100_000_000 * OPTIMIZER_COPIES  # b's stage now: two units
    assert revise(plan, [64, 0], 4, units, busy, slowed=["a"], ram_bytes={"b": 4 * 10**9}) is not None
    assert revise(plan, [64, 0], 4, units, busy, slowed=["a"], ram_bytes={"b": present}) is None  # 0.5 x RAM < now


def test_a_revision_that_gains_little_or_does_not_pay_before_the_end_is_not_taken() -> None:
    units = _units(1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b")
    slight = _busy(units, plan.text(), [64], {"b": 1.1})
    assert revise(plan, [64, 0], 4, units, slight, slowed=["b"], ram_bytes=RAM) is None  # under 15% to gain
    busy = _busy(units, plan.text(), [64], {"b": 3.0})
    assert revise(plan, [64, 0], 4, units, busy, slowed=["b"], ram_bytes=RAM, steps_left=3, change_s=10.0) is None
    assert revise(plan, [64, 0], 4, units, busy, slowed=["b"], ram_bytes=RAM, steps_left=300, change_s=10.0) is not None


def test_a_lost_boards_stages_are_cut_again_at_the_measured_speeds_not_merged_into_a_neighbour() -> None:
    units = _units(1, 1, 1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b,u3@c")
    busy = _busy(units, plan.text(), [32], {})
    del busy["c"]  # lost: its agent went offline
    merged = replan(plan, [32, 0, 0], ["c"])
    assert merged is not None and merged.pipeline == "a,u1@b"  # c's units to b: 4 of 6 on one board
    measured = revision_module.replan_measured(plan, [32, 0, 0], 4, units, busy, lost=["c"], ram_bytes=RAM, fixed_s=0.0)
    assert measured is not None and measured.pipeline == "a,u2@b" and measured.batch_sizes == (32, 0)
    assert measured.why.startswith("without c, at the measured speeds: cuts u2")


def test_a_lost_stage_0_board_leaves_its_samples_to_the_others_and_nothing_is_left_without_stage_0() -> None:
    units = _units(2, 1, 1)
    plan = parse_stage_plan("a1+a2,u0@b")
    busy = _busy(units, plan.text(), [16, 16], {})
    kept = revision_module.replan_measured(plan, [16, 16, 0], 2, units, busy, lost=["a2"], ram_bytes=RAM, fixed_s=0.0)
    assert kept is not None and kept.boards == ("a1", "b") and kept.batch_sizes == (32, 0)
    assert revision_module.replan_measured(plan, [16, 16, 0], 2, units, busy, lost=["a1", "a2"], ram_bytes=RAM) is None
    assert revision_module.replan_measured(plan, [16, 16, 0], 2, units, {"a1": 0.1}, lost=["a2"]) is None  # b unmeasured


def test_a_later_groups_slowed_board_leaves_its_micro_batches_to_the_group() -> None:
    units = _units(1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b+c")  # a: 2 ms x 64 = 128 ms; b and c: 2 ms x 32 each, two micro-batches of 4
    busy = _busy(units, plan.text(), [64], {"c": 3.0}, micro_batches=4)  # c now takes 3x as long: 192 ms
    revision = revise(plan, [64, 0, 0], 4, units, busy, slowed=["c"], ram_bytes=RAM)
    assert revision is not None
    assert revision.current_s == pytest.approx((0.128 + 0.192 + 3 * 0.192) / 4)  # the group as slow as c
    assert revision.pipeline == "a,u1@b" and revision.batch_sizes == (64, 0)     # b alone: 128 ms
    assert revision.predicted_s == pytest.approx((0.128 + 0.128 + 3 * 0.128) / 4)
    assert revision.why.startswith("c's micro-batches to its group")


def test_a_later_group_is_cut_again_on_the_samples_each_board_runs() -> None:
    units = _units(1, 1, 1, 1, 1, 1)
    plan = parse_stage_plan("a,u1@b+c")  # a: 128 ms at 64; b and c: 4 units on 32 each, 128 ms
    busy = _busy(units, plan.text(), [64], {"a": 2.0}, micro_batches=2)  # a slowed 2x: 256 ms
    revision = revise(plan, [64, 0, 0], 2, units, busy, slowed=["a"], ram_bytes=RAM)
    assert revision is not None and revision.pipeline == "a,u0@b+c"  # a keeps one unit (128 ms), b and c 5 (160 ms)
    assert revision.predicted_s == pytest.approx((0.128 + 0.160 + 0.160) / 2)
    # one micro-batch a step leaves a board of the group none: a plan train refuses, so nothing to revise from
    assert revise(plan, [64, 0, 0], 1, units, busy, slowed=["a"], ram_bytes=RAM) is None
    lost = revision_module.replan_measured(plan, [64, 0, 0], 2, units, busy, lost=["c"], ram_bytes=RAM, fixed_s=0.0)
    assert lost is not None and lost.boards == ("a", "b") and lost.why.startswith("without c, at the measured speeds")


def test_a_revision_moves_no_parameter_heavy_layer_into_stage_0s_exchange() -> None:
    units = [*_units(1, 1), *_units(1, 1, params=400_000)][:2] + [
        dataclasses.replace(u, name=f"u{k + 2}") for k, u in enumerate(_units(1, 1, params=400_000))]
    plan = parse_stage_plan("a,u1@b")  # a: u0, u1 (1,000 bytes); b: u2 (400,000 bytes), u3
    busy = _busy(units, plan.text(), [64], {"b": 3.0})
    revision = revise(plan, [64, 0], 4, units, busy, slowed=["b"], ram_bytes=RAM)
    assert revision is None  # moving u2 would add 40x stage 0's bytes to every step's exchange
    light = [*units[:2], dataclasses.replace(units[2], param_bytes=0), units[3]]
    moved = revise(plan, [64, 0], 4, light, busy, slowed=["b"], ram_bytes=RAM)
    assert moved is not None and moved.pipeline == "a,u2@b"  # the same layer without parameters moves


def test_cuts_that_are_not_the_units_ends_give_no_revision() -> None:
    units = _units(1, 1, 1)
    assert unit_ends(units, ["net.2"]) is None
    plan = parse_stage_plan("a,net.2@b")
    assert revise(plan, [8, 0], 1, units, {"a": 1.0, "b": 1.0}, slowed=["b"], ram_bytes=RAM) is None


def test_the_watch_names_the_board_that_slowed_for_good_and_not_noise() -> None:
    rng = random.Random(7)
    watch = StageWatch(["a", "b", "c"], threshold=0.3, window=5, warmup=3)
    drifts = []
    for step in range(120):
        slow = 2.5 if step >= 60 else 1.0
        busy = {"a": 0.2 * rng.uniform(0.8, 1.2), "b": 0.2 * slow * rng.uniform(0.8, 1.2),
                "c": 0.2 * rng.uniform(0.6, 1.4)}  # c: noisy, +-40% a step, never slower for good
        drift = watch.observe(step, busy)
        if drift is not None:
            drifts.append(drift)
            watch.settle(drift.change)
    assert [sorted(d.change) for d in drifts] == [["b"]]
    assert 60 < drifts[0].step <= 60 + 2 * 5 + 5  # two windows past the bar
    assert drifts[0].change["b"] == pytest.approx(1.5, abs=0.6)
    assert drifts[0].recent_s["b"] == pytest.approx(0.5, rel=0.25)


def test_the_watch_leaves_the_plans_first_steps_out() -> None:
    watch = StageWatch(["a"], threshold=0.3, window=5, warmup=3)
    for step in range(3):  # a new plan's first steps are slow (its graphs): not the reference
        assert watch.observe(step, {"a": 5.0}) is None
    assert all(watch.observe(step, {"a": 0.2}) is None for step in range(3, 60))
