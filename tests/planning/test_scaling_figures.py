"""The scaling benchmark's arithmetic (bench/scaling_figures.py): board choice, batch split, ratios, and the
figures it reads from a run's metrics.jsonl."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.planning import BENCH, load_bench

sf = load_bench("scaling_figures.py", "scaling_figures")

FLEET8 = [sf.BoardQuota("pi4-1", 0.12, 20_000_000), sf.BoardQuota("pi4-2", 0.12, 20_000_000),
          sf.BoardQuota("pi4-3", 0.12, 100_000_000), sf.BoardQuota("pi5-1", 0.27, 60_000_000),
          sf.BoardQuota("pi5-2", 0.27, 100_000_000), sf.BoardQuota("nano-1", 0.09, 100_000_000),
          sf.BoardQuota("nano-2", 0.09, 100_000_000), sf.BoardQuota("x86-1", 0.36, 100_000_000)]


def _run(steps: int, steps_per_epoch: int, *, n: int = 64, step_s: float = 0.1, validation_s: float = 0.5,
         overlap_s: float = 0.02, accuracies: dict[int, float] | None = None, compute: dict[str, float] | None = None,
         wall_s: float = 0.1) -> list[dict[str, Any]]:
    """Records as the coordinator writes them (measured on the lab): the replica validates inside the apply of an
    epoch's last step, so that step's elapsed_s holds the validation, and the next step, which the boards computed
    meanwhile, follows ``overlap_s`` later."""
    records, elapsed = [], 0.0
    for step in range(steps):
        elapsed += overlap_s if step and step % steps_per_epoch == 0 else step_s
        record: dict[str, Any] = {"step": step, "n": n, "wall_s": wall_s, "compute_s": dict(compute or {"a": 0.06})}
        if (step + 1) % steps_per_epoch == 0:
            epoch = (step + 1) // steps_per_epoch
            record["val_accuracy"] = (accuracies or {}).get(epoch, 0.5)
            elapsed += validation_s
        record["elapsed_s"] = round(elapsed, 3)
        records.append(record)
    return records


def test_fastest_boards_by_quota_then_link_then_id() -> None:
    assert sf.fastest_boards(FLEET8, 1) == ["x86-1"]
    assert sf.fastest_boards(FLEET8, 2) == ["x86-1", "pi5-2"]  # pi5-2's 100 Mbit/s before pi5-1's 60
    assert sf.fastest_boards(FLEET8, 4) == ["x86-1", "pi5-2", "pi5-1", "pi4-3"]
    assert sorted(sf.fastest_boards(FLEET8, 8)) == sorted(b.id for b in FLEET8)
    with pytest.raises(ValueError):
        sf.fastest_boards(FLEET8, 9)


def test_split_batch_in_proportion_and_exact_sum() -> None:
    assert sf.split_batch([0.36], 128) == [128]
    assert sf.split_batch([0.6, 0.45], 128) == [73, 55]            # 73.1, 54.9
    assert sf.split_batch([0.36, 0.27, 0.27, 0.12], 128) == [45, 34, 34, 15]
    quotas = [0.36, 0.27, 0.27, 0.12, 0.12, 0.12, 0.09, 0.09]
    assert sf.split_batch(quotas, 128) == [32, 24, 24, 11, 11, 10, 8, 8]  # 10.67 each: the earlier boards round up
    assert sum(sf.split_batch(quotas, 64)) == 64
    assert sf.split_batch([1.0, 0.01, 0.01], 3) == [1, 1, 1]        # every board at least one sample
    assert sf.split_batch([10.0, 0.1, 0.1], 4) == [2, 1, 1]
    with pytest.raises(ValueError):
        sf.split_batch([0.5, 0.5, 0.5], 2)
    with pytest.raises(ValueError):
        sf.split_batch([0.5, 0.0], 8)


def test_speed_up_and_efficiency_against_the_summed_quota() -> None:
    assert sf.speed_up_time(60.0, 20.0) == pytest.approx(3.0)
    assert sf.speed_up_rate(100.0, 250.0) == pytest.approx(2.5)
    assert sf.speed_up_time(None, 20.0) is None and sf.speed_up_time(60.0, None) is None
    assert sf.speed_up_rate(None, 1.0) is None and sf.speed_up_rate(0.0, 1.0) is None
    fleet8 = [0.36, 0.27, 0.27, 0.12, 0.12, 0.12, 0.09, 0.09]
    assert sf.quota_ratio(fleet8, 0.36) == pytest.approx(4.0)
    assert sf.efficiency(3.0, fleet8, 0.36) == pytest.approx(0.75)
    assert sf.efficiency(1.0, [0.36], 0.36) == pytest.approx(1.0)
    assert sf.efficiency(None, fleet8, 0.36) is None


def test_time_to_target_is_the_first_epoch_that_reaches_it() -> None:
    records = _run(30, 10, accuracies={1: 0.90, 2: 0.96, 3: 0.94})
    hit = sf.time_to_target(records, 0.95, 10)
    assert hit is not None
    assert (hit.epoch, hit.step, hit.accuracy) == (2, 19, 0.96)
    # 19 steps of 0.1 s, one overlapped step (0.02 s) and both epochs' validations (0.5 s each)
    assert hit.elapsed_s == pytest.approx(2.92)
    assert sf.time_to_target(records, 0.96, 10).epoch == 2  # "at least" the target
    assert sf.time_to_target(records, 0.97, 10) is None
    records[19]["validated_s"] = records[19]["elapsed_s"] + 0.4  # validated while the boards went on
    assert sf.time_to_target(records, 0.95, 10).elapsed_s == pytest.approx(3.32)  # when the figures were in


def test_time_to_target_ignores_records_without_validation() -> None:
    records = _run(20, 10, accuracies={1: 0.99})
    del records[9]["val_accuracy"]  # a module that logs no accuracy
    assert sf.time_to_target(records, 0.95, 10) is None
    records[19]["val_accuracy"] = 0.95
    assert sf.time_to_target(records, 0.95, 10).epoch == 2


def test_time_per_epoch_includes_one_validation_per_epoch() -> None:
    records = _run(40, 10, step_s=0.2, validation_s=0.5)
    assert sf.time_per_epoch(records, 10) == pytest.approx(2.32)    # 9 x 0.2 s + 0.02 s (overlapped) + 0.5 s
    assert sf.time_per_epoch(records[:15], 10) is None              # one epoch end only


def test_samples_per_s_leaves_out_warm_up_and_validation() -> None:
    records = _run(30, 10, n=64, step_s=0.1, validation_s=2.0)
    records[0]["elapsed_s"] = 5.0  # a slow first step moves every later one
    for r in records[1:]:
        r["elapsed_s"] = round(r["elapsed_s"] + 4.9, 3)
    assert sf.samples_per_s(records, 3, 10) == pytest.approx(640.0)
    assert sf.samples_per_s(records[:3], 3, 10) is None


def test_exchange_share_of_the_step_period() -> None:
    records = _run(30, 10, step_s=0.1, validation_s=3.0, compute={"a": 0.06, "b": 0.08})
    assert sf.exchange_share(records, 3, 10) == pytest.approx(0.2)   # 0.02 of each 0.1 s period outside b's compute
    records[0]["elapsed_s"] = 0.0  # the warm-up's steps do not count
    assert sf.exchange_share(records, 3, 10) == pytest.approx(0.2)
    records[5]["compute_s"] = {"a": 0.1}  # a step computing all along: nothing outside it
    steps = [r for r in records[3:] if r["step"] not in (9, 10, 19, 20, 29)]  # the steps at an epoch's end are left out
    assert sf.exchange_share(records, 3, 10) == pytest.approx(1 - (0.08 * (len(steps) - 1) + 0.1) / (0.1 * len(steps)))
    for r in records:
        r["compute_s"] = {}
    assert sf.exchange_share(records, 3, 10) is None


def test_exchange_share_of_wall_floors_each_step() -> None:
    records = _run(20, 10, wall_s=0.10, compute={"a": 0.06, "b": 0.08})
    assert sf.exchange_share_of_wall(records, 3, 10) == pytest.approx(0.2)   # 0.02 of 0.10 outside b's compute
    # a step whose gradients were in before the exchange opened it (compute over wall) counts as no exchange
    records[5]["wall_s"], records[5]["compute_s"] = 0.05, {"a": 0.07}
    steps = [r for r in records[3:] if r["step"] not in (9, 10, 19)]  # an epoch's end: left out
    expected = sum(max(0.0, r["wall_s"] - max(r["compute_s"].values())) for r in steps) / sum(r["wall_s"] for r in steps)
    assert sf.exchange_share_of_wall(records, 3, 10) == pytest.approx(expected)
    for r in records:
        r["compute_s"] = {}
    assert sf.exchange_share_of_wall(records, 3, 10) is None


def test_median_compute_per_board_after_warm_up() -> None:
    records = _run(6, 10, compute={"a": 0.05, "b": 0.2})
    records[0]["compute_s"] = {"a": 9.0, "b": 9.0}
    records[4]["compute_s"] = {"a": 0.07, "b": 0.2}
    assert sf.median_compute(records, 1) == {"a": pytest.approx(0.05), "b": pytest.approx(0.2)}


def test_park_relative_elapsed() -> None:
    first, second = sf.park_relative(1)
    assert first == pytest.approx(1.0) and second == pytest.approx(1.0)
    first, second = sf.park_relative(8)
    assert first == pytest.approx(453 / 105) and second == pytest.approx(2436 / 1079)
    assert sf.park_relative(12) == (None, None)


def _profile(lines: dict[str, tuple[float, float]], *, link_bytes_per_s: float = 12.5e6, grad_bytes: int = 39_080) -> Any:
    """A fleet profile whose boards' step times lie exactly on ``a + c * b`` (s), measured at 8 and 128 samples."""
    from edgefleet.coordinator.planning import BatchPoint, BoardProfile, FleetProfile

    key = "resnet_small{}[1,32,32]"
    boards = {b: BoardProfile(board_id=b, agent_version="test", model_key=key,
                              points=tuple(BatchPoint(n, a + c * n, 200_000_000 + 100_000 * n) for n in (8, 128)),
                              active_power_w=5.0, idle_power_w=2.0, power_source="estimated",
                              memory_total_bytes=2 * 1024**3, link_bytes_per_s=link_bytes_per_s)
              for b, (a, c) in lines.items()}
    return FleetProfile(model_key=key, grad_bytes=grad_bytes, coordinator_link_bytes_per_s=125e6, dataset_len=1438,
                        boards=boards)


# fleet8's boards as the lead's arithmetic has them: 8 ms of CPU a step and 1.4 ms a sample, at each board's quota
FLEET8_QUOTAS = {"x86-1": 0.36, "pi5-2": 0.27, "pi5-1": 0.27, "pi4-3": 0.12, "pi4-1": 0.12, "pi4-2": 0.12,
                 "nano-1": 0.09, "nano-2": 0.09}


def test_planned_split_gives_boards_with_a_large_fixed_cost_fewer_samples_than_their_quota() -> None:
    fleet = _profile({b: (0.008 / q, 0.0014 / q) for b, q in FLEET8_QUOTAS.items()})
    boards = list(FLEET8_QUOTAS)
    planned = sf.planned_split(fleet, boards, 256)
    by_quota = sf.split_batch(list(FLEET8_QUOTAS.values()), 256)
    assert sum(planned) == 256 and all(b >= 1 for b in planned)
    assert planned[boards.index("x86-1")] > by_quota[boards.index("x86-1")]     # the large boards take more ...
    assert planned[boards.index("nano-1")] < by_quota[boards.index("nano-1")]   # ... the 0.09-core boards less
    # every board ready at about the same time: within one sample of the slowest board's per-sample cost
    lines = sf.fitted_costs(fleet)
    ready = [lines[b][0] + lines[b][1] * n for b, n in zip(boards, planned)]
    assert max(ready) - min(ready) <= max(c for _, c in lines.values()) + 1e-9
    quota_ready = [lines[b][0] + lines[b][1] * n for b, n in zip(boards, by_quota)]
    assert max(ready) < max(quota_ready)  # the step the planned split predicts is shorter
    assert lines["x86-1"] == pytest.approx((0.008 / 0.36, 0.0014 / 0.36))


def test_planned_split_without_fixed_costs_is_the_quota_split_and_refusals_are_value_errors() -> None:
    fleet = _profile({"big": (0.0, 0.001), "small": (0.0, 0.003)}, grad_bytes=1)
    assert sf.planned_split(fleet, ["big", "small"], 256) == [192, 64]
    assert sf.planned_split(fleet, ["small"], 64) == [64]
    with pytest.raises(ValueError, match="no board nano-9"):
        sf.planned_split(fleet, ["big", "nano-9"], 256)
    with pytest.raises(ValueError, match="global batch 1"):
        sf.planned_split(fleet, ["big", "small"], 1)


def test_median_period_and_cpu_per_sample() -> None:
    records = _run(30, 10, step_s=0.1, validation_s=3.0)
    records[12]["elapsed_s"] += 0.5  # one slow step (and the next one's period shorter) does not move the median
    assert sf.median_period(records, 3, 10) == pytest.approx(0.1)
    assert sf.median_period(records[:3], 3, 10) is None
    assert sf.cpu_per_sample(0.2, 0.09, 12) == pytest.approx(0.0015)


def _load_scaling() -> ModuleType:
    # bench/scaling.py imports its neighbours (_harness, _table, scaling_figures) as a script does.
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_scaling", BENCH / "scaling.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_configurations_of_each_split_and_their_planned_batches() -> None:
    scaling = _load_scaling()
    configs = scaling.plan_configs("fleet8", FLEET8, ["resnet_small"], ["exact"], [1, 2, 8], ["planned", "quota"])
    assert [(len(c.boards), c.split) for c in configs] == [(1, "whole"), (2, "planned"), (2, "quota"), (8, "planned"),
                                                             (8, "quota")]
    batch = scaling.WORKLOADS["resnet_small"].global_batch
    assert configs[0].batch_sizes == (batch,) and sum(configs[2].batch_sizes) == batch
    assert configs[1].batch_sizes == ()  # until the profile is in
    assert len({c.label for c in configs}) == len(configs)
    fleet = _profile({b.id: (0.008 / b.cpu, 0.0014 / b.cpu) for b in FLEET8})
    filled = scaling.with_planned_batches(configs, {"resnet_small": fleet})
    # the other splits keep their batches and gain the planner's step time
    assert [replace(c, predicted_step_s=None) for c in (filled[2], filled[0])] == [configs[2], configs[0]]
    assert all(c.predicted_step_s and c.predicted_step_s > 0 for c in filled)
    assert filled[3].batch_sizes == tuple(sf.planned_split(fleet, configs[3].boards, batch))
    with pytest.raises(ValueError, match="no profile of resnet_small"):
        scaling.with_planned_batches(configs, {})


def test_step_cpu_per_step_from_the_first_mark_after_the_warm_up(tmp_path: Path) -> None:
    scaling = _load_scaling()
    files = {b: tmp_path / f"{b}.usage" for b in ("a", "b")}
    cpu = scaling.StepCpu(files)
    for path in files.values():
        path.write_text("5000000000\n")
    cpu.note(os.getpid(), scaling.WARMUP_STEPS - 1)  # still warming up: not a mark
    assert cpu.first is None and cpu.coordinator_per_step_s is None and cpu.boards_per_step_s() == {}
    cpu.note(os.getpid(), 10)
    files["a"].write_text(str(5_000_000_000 + 20 * 30_000_000))   # 30 ms of CPU a step over 20 steps
    files["b"].write_text(str(5_000_000_000 + 20 * 12_000_000))
    cpu.note(os.getpid(), 30)
    assert cpu.boards_per_step_s() == {"a": pytest.approx(0.030), "b": pytest.approx(0.012)}
    assert cpu.coordinator_per_step_s is not None and cpu.coordinator_per_step_s >= 0
    used = cpu.quota_used({"a": 0.36, "b": 0.09})
    assert used["a"] / used["b"] == pytest.approx((0.030 / 0.36) / (0.012 / 0.09))
    cpu.note(2**22 + 12345, 40)  # the coordinator gone (no /proc entry): no mark
    assert cpu.last is not None and cpu.last.steps == 30
