from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from edgefleet.coordinator.planning.profiles import (
    PROFILE_SCHEMA_VERSION,
    BatchPoint,
    BoardProfile,
    check_compatible,
    fit_line,
    load_profiles,
    model_key,
    save_profiles,
    variant_label,
)
from edgefleet.protocol.errors import PlanError
from tests.planning import GB, KEY, MB, board, fleet


def test_lines_through_two_points_are_exact() -> None:
    p = board("pi4-1", a=0.05, c=0.01, m0=200 * MB, m1=1 * MB)
    assert p.step_time(8) == pytest.approx(0.13)
    assert p.step_time(100) == pytest.approx(1.05)
    assert p.peak_memory(100) == pytest.approx(300 * MB)


def test_three_points_are_a_least_squares_fit() -> None:
    xs, ys = [8, 16, 64], [0.14, 0.20, 0.70]
    fit = fit_line(xs, ys, min_slope=0.0)
    slope, intercept = np.polyfit(xs, ys, 1)
    assert (fit.slope, fit.intercept) == pytest.approx((slope, intercept))


def test_weights_are_inverse_variance_weights() -> None:
    xs, ys, w = [8, 16, 64], [0.14, 0.20, 0.70], [4.0, 1.0, 0.25]
    fit = fit_line(xs, ys, min_slope=0.0, weights=w)
    slope, intercept = np.polyfit(xs, ys, 1, w=np.sqrt(w))  # numpy weighs the residuals, not their squares
    assert (fit.slope, fit.intercept) == pytest.approx((slope, intercept))
    same, plain = fit_line(xs, ys, min_slope=0.0, weights=[3.0] * 3), fit_line(xs, ys, min_slope=0.0)
    assert (same.slope, same.intercept) == pytest.approx((plain.slope, plain.intercept))


def test_a_noisy_point_bends_the_time_line_less() -> None:
    # A Pi 4 of the emulated lab on resnet_small (profile of 11-25): its steps at batch 64 spread
    # 219 ms, at 8 and 32 25-28 ms. The planner gave it 6 samples; run at 6, a step took ~234 ms.
    def profile(spreads: tuple[float, float, float]) -> BoardProfile:
        points = tuple(BatchPoint(b, t, 300 * MB, s) for b, t, s in zip((8, 32, 64), (0.284, 0.878, 1.839), spreads))
        return BoardProfile(board_id="pi4-3", agent_version="0.1.0", model_key=KEY, points=points, active_power_w=6.4,
                            idle_power_w=2.7, power_source="estimated", memory_total_bytes=2 * GB, link_bytes_per_s=12 * MB)
    weighted = profile((0.025, 0.028, 0.219))
    assert weighted.step_time(6) == pytest.approx(0.234, abs=0.004)       # the precise points' line: 0.2345
    equal = profile((0.05, 0.05, 0.05))                                   # all three alike (above the floor) ...
    assert equal.step_time(6) == pytest.approx(0.200, abs=0.004)          # ... the plain fit, 34 ms short
    # A profile saved without spreads weighs each point by its relative precision (the floor).
    old = profile((0.0, 0.0, 0.0))
    rel = fit_line([8, 32, 64], [0.284, 0.878, 1.839], min_slope=0.0, weights=[1 / t**2 for t in (0.284, 0.878, 1.839)])
    assert (old.time_fit.slope, old.time_fit.intercept) == pytest.approx((rel.slope, rel.intercept))


def test_fits_are_clamped_so_predictions_stay_positive_and_rising() -> None:
    # Noise gave a falling time: the slope is held at a small positive value.
    falling = fit_line([8, 32], [0.30, 0.29], min_slope=1e-4)
    assert falling.slope == pytest.approx(1e-4) and falling(1) > 0
    # A negative intercept (superlinear points) is refitted through the origin.
    steep = fit_line([10, 20], [0.1, 0.3], min_slope=0.0)
    assert steep.intercept == 0.0 and steep.slope == pytest.approx((10 * 0.1 + 20 * 0.3) / (100 + 400))
    assert steep(1) > 0


def test_max_batch_from_the_memory_line() -> None:
    p = board("pi4-1", m0=200 * MB, m1=2 * MB, memory=1 * GB)
    # 0.9 * 1e9 = 900 MB: (900 - 200) / 2 = 350 samples
    assert p.max_batch(0.9) == 350
    assert board("tiny", m0=950 * MB, memory=1 * GB).max_batch(0.9) == 0


def test_a_profile_needs_two_batch_sizes() -> None:
    with pytest.raises(PlanError, match="at least two distinct batch sizes"):
        BoardProfile(board_id="pi4-1", agent_version="0.1.0", model_key=KEY,
                     points=(BatchPoint(16, 0.2, 300 * MB), BatchPoint(16, 0.21, 300 * MB)),
                     active_power_w=6.0, idle_power_w=2.7, power_source="estimated",
                     memory_total_bytes=GB, link_bytes_per_s=MB)


@pytest.mark.parametrize("link_w", [-1.0, float("nan"), float("inf")])
def test_an_unusable_link_power_is_refused(link_w: float) -> None:
    with pytest.raises(PlanError, match=r"'pi4-1': link_power_w = .*run `edge-coordinator profile` again"):
        board("pi4-1", link_w=link_w)


def test_a_gradient_sized_round_scales_the_bulk_rates_and_keeps_their_split() -> None:
    bulk = board("pi4-1", link=10 * MB, link_down=20 * MB)
    assert bulk.exchange_link_s_per_byte == pytest.approx(1 / (10 * MB) + 1 / (20 * MB))
    # 0.25 MB went up and back in 60 ms, where the bulk rates say 25 + 12.5 = 37.5 ms: 1.6 times as long
    rounds = board("pi4-1", link=10 * MB, link_down=20 * MB, link_round=(250_000, 0.060))
    assert rounds.exchange_link_s_per_byte * 250_000 == pytest.approx(0.060)
    assert rounds.up_s_per_byte == pytest.approx(1.6 / (10 * MB)) and rounds.down_s_per_byte == pytest.approx(1.6 / (20 * MB))
    assert BoardProfile.from_json(json.loads(json.dumps(rounds.to_json()))) == rounds


@pytest.mark.parametrize("link_round", [(250_000, 0.0), (0, 0.06), (250_000, float("nan"))])
def test_an_unusable_round_is_refused(link_round: tuple[int, float]) -> None:
    with pytest.raises(PlanError, match=r"'pi4-1': link_round_bytes = .*both be positive"):
        board("pi4-1", link_round=link_round)
    with pytest.raises(PlanError, match="both be positive, or both absent"):
        dataclasses.replace(board("pi4-1"), link_round_s=0.06)


def test_boards_of_one_fleet_must_share_the_model_key() -> None:
    with pytest.raises(PlanError, match="'pi5-1' was profiled for lenet5"):
        fleet(board("pi4-1"), board("pi5-1", key="lenet5{}[1,32,32]"))


def test_model_key_ignores_cost_neutral_options() -> None:
    assert model_key("mlp", {"layers": 3, "lr": 0.01}, (1, 32, 32)) == 'mlp{"layers":3}[1,32,32]'
    assert model_key("mlp", {"layers": 3, "lr": 0.1}, (1, 32, 32)) == model_key("mlp", {"layers": 3}, [1, 32, 32])
    assert model_key("mlp", {"layers": 3}, (1, 32, 32)) != model_key("mlp", {"layers": 4}, (1, 32, 32))
    assert model_key("mlp", {}, (1, 32, 32)) != model_key("mlp", {}, (3, 32, 32))
    assert variant_label({"width": 64, "layers": 3}) == "layers=3,width=64" and variant_label({}) == "default"


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    original = {"layers=2": fleet(board("pi4-1"), board("x86-1", c=0.002, link_down=20 * MB, link_w=9.5),
                                  variant={"layers": 2})}
    path = tmp_path / "profile.json"
    save_profiles(path, original)
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == PROFILE_SCHEMA_VERSION
    assert doc["variants"]["layers=2"]["model_key"] == KEY
    assert doc["variants"]["layers=2"]["agent_versions"] == {"pi4-1": "0.1.0", "x86-1": "0.1.0"}
    loaded = load_profiles(path)
    assert loaded == original
    assert loaded["layers=2"].boards["x86-1"].step_time(50) == pytest.approx(original["layers=2"].boards["x86-1"].step_time(50))


def test_other_schema_versions_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    save_profiles(path, {"default": fleet(board("pi4-1"))})
    doc = json.loads(path.read_text())
    doc["schema_version"] = PROFILE_SCHEMA_VERSION + 1
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"schema_version 2.*run `edge-coordinator profile` again"):
        load_profiles(path)
    doc["schema_version"] = PROFILE_SCHEMA_VERSION
    doc["variants"]["default"]["boards"][0]["gpu_clock"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="unknown keys"):
        load_profiles(path)
    with pytest.raises(PlanError, match="run `edge-coordinator profile` first"):
        load_profiles(tmp_path / "missing.json")


def test_a_profile_of_another_model_is_refused() -> None:
    profile = fleet(board("pi4-1"), board("pi5-1"))
    other = 'mlp{"layers":4}[1,32,32]'
    with pytest.raises(PlanError) as err:
        check_compatible(profile, other, {"pi4-1": "0.1.0", "pi5-1": "0.1.0"})
    message = str(err.value)
    assert KEY in message and other in message and "run `edge-coordinator profile` again" in message.lower()


def test_a_profile_from_another_agent_version_is_refused() -> None:
    profile = fleet(board("pi4-1", version="0.0.9"), board("pi5-1"))
    with pytest.raises(PlanError, match=r"pi4-1 was profiled by agent 0\.0\.9, it now runs 0\.1\.0.*Run `edge-coordinator profile` again"):
        check_compatible(profile, KEY, {"pi4-1": "0.1.0", "pi5-1": "0.1.0"})
    with pytest.raises(PlanError, match="board nano-1 has no profile"):
        check_compatible(profile, KEY, {"pi5-1": "0.1.0", "nano-1": "0.1.0"})


def test_a_matching_profile_is_accepted_and_can_be_narrowed() -> None:
    profile = fleet(board("pi4-1"), board("pi5-1"), board("nano-1"))
    check_compatible(profile, KEY, {"pi4-1": "0.1.0", "nano-1": "0.1.0"})  # a board offline is fine
    assert list(profile.select(["nano-1", "pi4-1"]).boards) == ["nano-1", "pi4-1"]
    with pytest.raises(PlanError, match="no profile for board.*x86-9"):
        profile.select(["x86-9"])


def test_a_points_step_time_spread_is_kept_and_older_profiles_without_it_still_load(tmp_path: Path) -> None:
    # Arrange: a board whose points carry their spread, saved; then the same file without the field.
    spread = fleet(board("pi4-1"))
    pi4 = spread.boards["pi4-1"]
    points = tuple(BatchPoint(p.batch_size, p.step_time_s, p.peak_memory_bytes, p.step_time_s * 0.05) for p in pi4.points)
    spread = fleet(dataclasses.replace(pi4, points=points))
    path = tmp_path / "profile.json"
    save_profiles(path, {"default": spread})
    # Act / Assert: the spread comes back as saved ...
    assert load_profiles(path)["default"].boards["pi4-1"].points == points
    # ... and a profile saved before the spread was kept loads with none.
    doc = json.loads(path.read_text())
    for point in doc["variants"]["default"]["boards"][0]["points"]:
        del point["step_time_spread_s"]
    path.write_text(json.dumps(doc))
    assert all(p.step_time_spread_s == 0.0 for p in load_profiles(path)["default"].boards["pi4-1"].points)
    with pytest.raises(PlanError, match="step_time_spread_s >= 0"):
        BatchPoint(16, 0.2, 300 * MB, -0.01)
