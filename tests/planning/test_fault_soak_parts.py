"""The fault soak's verdicts (bench/fault_soak_checks.py): each step once, the runs' exact prefix, the documented
difference after a board dies, and the coordinator's memory bound, on records shaped like metrics.jsonl's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.planning import load_bench

fc = load_bench("fault_soak_checks.py", "fault_soak_checks")

BOARDS = ["pi4-1", "pi5-1", "x86-1"]
BATCHES = [10, 23, 31]


def _records(steps: int, *, drop: str | None = None, drop_from: int = 0, loss: float = 1.0) -> list[dict[str, Any]]:
    """A run's records: every board in every step, or ``drop`` gone from ``drop_from`` on."""
    out = []
    for step in range(steps):
        boards = [b for b in BOARDS if not (b == drop and step >= drop_from)]
        n = sum(size for b, size in zip(BOARDS, BATCHES) if b in boards)
        out.append({"step": step, "n": n, "boards": boards, "late": [], "refused": {}, "loss": loss / (step + 1)})
    return out


def test_every_step_once_is_told_from_gaps_duplicates_and_strays() -> None:
    assert fc.count_steps(_records(5), 5).ok
    assert fc.count_steps(_records(5), 5).describe() == "steps 0..4, each once"
    records = _records(8)
    del records[2:5]
    records.append(dict(records[-1]))  # step 7 twice
    records.append({**records[0], "step": 9})
    result = fc.count_steps(records, 8)
    assert not result.ok
    assert (result.missing, result.duplicated, result.unexpected) == ([2, 3, 4], [7], [9])
    assert result.describe() == "missing 2-4; duplicated 7; unexpected 9"
    assert not fc.count_steps([], 3).ok


def test_the_first_step_without_a_board_and_the_steps_before_it() -> None:
    records = _records(10, drop="pi4-1", drop_from=6)
    assert fc.first_step_without(records, "pi4-1") == 6
    assert fc.first_step_without(records, "pi5-1") is None
    assert fc.incomplete_steps(records, BOARDS, before=6) == []
    assert fc.incomplete_steps(records, BOARDS) == [6, 7, 8, 9]
    records[2]["late"] = ["x86-1"]  # a board left out of a step counts, even if listed
    assert fc.incomplete_steps(records, BOARDS, before=6) == [2]


def test_after_a_board_dies_the_documented_rule_holds_or_the_breach_is_named() -> None:
    records = _records(10, drop="pi4-1", drop_from=6)
    assert fc.documented_drop_problems(records, BOARDS, BATCHES, "pi4-1", 6) == []
    back = [dict(r) for r in records]
    for r in back[8:]:
        r["boards"], r["n"] = BOARDS, 64  # restarted and asked back: in every step from its first one back
    assert fc.rejoin_step(back, BOARDS, 6) == 8 and fc.documented_drop_problems(back, BOARDS, BATCHES, "pi4-1", 6) == []
    back[9]["boards"], back[9]["n"] = BOARDS[1:], 54  # back, then gone again without a kill: not what the docs say
    assert fc.documented_drop_problems(back, BOARDS, BATCHES, "pi4-1", 6) == [
        "step 9: contributors pi5-1,x86-1, expected pi4-1,pi5-1,x86-1"]
    redone = [dict(r) for r in records]
    redone[7]["n"] = 64  # its share redone by the others: the docs say it is not
    assert fc.documented_drop_problems(redone, BOARDS, BATCHES, "pi4-1", 6) == [
        "step 7: n=64, expected 54 (the others' batch sizes)"]


def test_losses_compare_bit_for_bit_before_the_kill_only() -> None:
    quiet, faulted = _records(10), _records(10, drop="pi4-1", drop_from=6)
    for r in faulted[6:]:
        r["loss"] += 0.5  # after the kill the runs part
    same = fc.compare_losses(quiet, faulted, before=6)
    assert same.ok and (same.compared, same.identical) == (6, 6)
    off = fc.compare_losses(quiet, faulted, before=8)
    assert not off.ok and off.first_difference == 6 and math.isclose(off.max_abs_diff, 0.5)
    faulted[3]["loss"] = float(np.nextafter(faulted[3]["loss"], 2.0))  # one ulp is a difference
    assert not fc.compare_losses(quiet, faulted, before=6).ok
    assert not fc.compare_losses(quiet, [], before=6).ok  # nothing compared proves nothing


def test_max_abs_diff_walks_nested_states_and_refuses_other_layouts() -> None:
    state: dict[str, Any] = {"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.float32)},
             "optimizer": {"state": {0: {"momentum_buffer": np.ones(3)}}, "param_groups": [{"lr": 0.01, "params": [0, 1]}]},
             "step": 300}
    copy: dict[str, Any] = {"model": {k: v.copy() for k, v in state["model"].items()}, "optimizer": state["optimizer"], "step": 300}
    assert fc.max_abs_diff(state, copy) == 0.0
    copy["model"]["b"][1] = -0.25
    assert fc.max_abs_diff(state, copy) == 0.25
    assert fc.max_abs_diff(state, {**copy, "step": 310}) == 10.0
    assert fc.max_abs_diff(state, {"model": state["model"]}) == math.inf
    assert fc.max_abs_diff(state, {**state, "model": {**state["model"], "b": np.zeros(4)}}) == math.inf


def test_memory_is_bounded_against_its_warm_up_peak() -> None:
    flat = [(float(s), 500 * 2**20 + (s % 7) * 2**20) for s in range(0, 1000, 5)]
    bound = fc.rss_bound(flat, warm_until=100.0)
    assert bound is not None and bound.ok and bound.warm == 506 * 2**20 and bound.start == 500 * 2**20
    growing = [(float(s), 400 * 2**20 + s * 2**19) for s in range(0, 1000, 5)]  # +0.5 MiB a step
    leak = fc.rss_bound(growing, warm_until=100.0)
    assert leak is not None and not leak.ok and leak.ratio > 1.5 and leak.end == leak.peak
    assert fc.rss_bound(flat[:3], warm_until=100.0) is None  # no sample after warm-up: no verdict
    assert fc.mib(3 * 2**20) == "3 MiB"
