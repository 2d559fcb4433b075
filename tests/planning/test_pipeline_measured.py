"""Per-layer figures measured on the boards (issue 35): kept in the board's profile and its JSON file (an older file
without them still loads), carried over from a board's report, and used by the pipeline planner's inputs in place of
the stand-ins, naming the boards that fell back to them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from edgefleet.coordinator.planning.cut_profile import CutProfile
from edgefleet.coordinator.planning.pipeline_model import problem_from_fleet
from edgefleet.coordinator.planning.pipeline_planner import plan_pipeline
from edgefleet.coordinator.planning.profiles import BoardProfile, FleetProfile, load_profiles, save_profiles
from edgefleet.coordinator.planning.profiling import _board_profile, _Variant
from edgefleet.coordinator.planning.unit_profile import UnitProfile
from edgefleet.protocol.errors import PlanError
from edgefleet.protocol.profile_report import LinkReport, MeasuredPoint, ProfileReport, UnitReport
from tests.planning import GB, KEY, board, fleet

CUTS = (CutProfile(name="net.3", boundary_elements=1000, output_elements=10, head_params=1000, tail_params=9000,
                   head_share=0.6, host_a_s=0.0, host_c_s=0.0),
        CutProfile(name="net.6", boundary_elements=400, output_elements=10, head_params=3000, tail_params=7000,
                   head_share=0.9, host_a_s=0.0, host_c_s=0.0))
NAMES = ("net.3", "net.6", "net.11")
# per unit: forward and backward seconds per sample on a board of scale 1, and its bytes
TIMES = ((2e-4, 4e-4), (1e-4, 1e-4), (0.5e-4, 1.5e-4))            # shares 0.2/0.4, 0.1/0.1, 0.05/0.15
BYTES = ((4000, 4000, 5000), (8000, 1600, 300), (28000, 40, 700))  # parameters, output a sample, held a sample


def _units(scale: float = 1.0, *, names: tuple[str, ...] = NAMES, times: tuple[tuple[float, float], ...] = TIMES,
           held: tuple[int, ...] | None = None) -> tuple[UnitProfile, ...]:
    return tuple(UnitProfile(name=name, forward_intercept_s=1e-5, forward_s_per_sample=fwd * scale,
                             backward_intercept_s=2e-5, backward_s_per_sample=bwd * scale, param_bytes=params,
                             activation_bytes_per_sample=act, held_bytes_per_sample=held[i] if held else h)
                 for i, (name, (fwd, bwd), (params, act, h)) in enumerate(zip(names, times, BYTES)))


def _fleet(*boards: BoardProfile) -> FleetProfile:
    return dataclasses.replace(fleet(*boards), cuts=CUTS)


def test_the_planner_uses_the_boards_measured_shares_and_bytes() -> None:
    profile = _fleet(dataclasses.replace(board("pi-1", c=0.01, memory=1 * GB), units=_units()),
                     dataclasses.replace(board("pi-2", c=0.02, memory=2 * GB),
                                         units=_units(2.0, held=(6000, 300, 700))))

    problem, notes = problem_from_fleet(profile, global_batch=32)

    assert [layer.name for layer in problem.layers] == ["net.3", "net.6", "output"]
    assert [layer.forward_s_per_sample for layer in problem.layers] == pytest.approx([0.2, 0.1, 0.05])
    assert [layer.backward_s_per_sample for layer in problem.layers] == pytest.approx([0.4, 0.1, 0.15])
    assert [layer.param_bytes for layer in problem.layers] == [4000, 8000, 28000]
    assert [layer.activation_bytes_per_sample for layer in problem.layers] == [4000, 1600, 0]  # nothing after the last
    assert [layer.held_bytes_per_sample for layer in problem.layers] == [6000, 300, 700]      # the most a board held
    assert [b.speed for b in problem.boards] == pytest.approx([100.0, 50.0])  # each board's own step line
    assert len(notes) == 3 and "measured on 2 board(s)" in notes[0] and "differ" not in notes[0]
    assert not any("operations" in note or "fell back" in note or "hold no per-layer" in note for note in notes)
    assert plan_pipeline(problem, "edp").require().feasible


def test_boards_without_matching_units_fall_back_and_are_named() -> None:
    profile = _fleet(dataclasses.replace(board("pi-1", c=0.01), units=_units()),
                     dataclasses.replace(board("pi-2", c=0.01), units=_units(3.0)),
                     dataclasses.replace(board("pi-3", c=0.01), units=_units(times=((9e-4, 9e-4), (1e-5, 1e-5), (0, 0)))),
                     board("old-1", c=0.02),                                                    # an older agent
                     dataclasses.replace(board("other-1", c=0.02), units=_units(names=("a", "b", "c"))))  # other cuts

    problem, notes = problem_from_fleet(profile, global_batch=32)

    assert [layer.work_s_per_sample for layer in problem.layers] == pytest.approx([0.6, 0.2, 0.2])  # the median board's
    assert "measured on 3 board(s)" in notes[0] and "(pi-3)" in notes[0] and "by up to 39%" in notes[0]
    assert notes[1].startswith("boards old-1, other-1 hold no per-layer figures for these cuts")
    assert len(problem.boards) == 5 and len(notes) == 4


def test_without_any_measured_board_the_stand_ins_stay_and_name_the_boards() -> None:
    problem, notes = problem_from_fleet(_fleet(board("pi-1", c=0.01), board("pi-2", c=0.02)), global_batch=32)
    assert [layer.work_s_per_sample for layer in problem.layers] == pytest.approx([0.6, 0.3, 0.1])  # operation shares
    assert len(notes) == 5 and notes[0].startswith("per-layer times on each board (pi-1, pi-2: no per-layer figures")


def test_units_are_kept_in_the_profile_file_and_an_older_file_without_them_loads(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    measured = dataclasses.replace(board("pi-1"), units=_units())
    save_profiles(path, {"default": fleet(measured, board("pi-2"))})

    loaded = load_profiles(path)["default"]
    assert loaded.boards["pi-1"] == measured and loaded.boards["pi-1"].units == _units()
    assert loaded.boards["pi-2"].units == ()
    doc = json.loads(path.read_text())
    boards = doc["variants"]["default"]["boards"]
    assert "units" in boards[0] and "units" not in boards[1]  # a board without them is written as before

    del boards[0]["units"]  # as an edgefleet from before per-layer timing wrote it
    path.write_text(json.dumps(doc))
    assert load_profiles(path)["default"].boards["pi-1"].units == ()


@pytest.mark.parametrize("over, message", [
    ({"held_bytes_per_sample": -1}, "pipeline unit 'net.3': a figure is not a finite number >= 0"),
    ({"forward_s_per_sample": "fast"}, "pipeline unit 'net.3' in the profile file: forward_s_per_sample is not a number"),
    ({"param_bytes": 1.5}, "param_bytes is not a number of the right kind"),
    ({"extra": 1}, "a pipeline unit in the profile file has the keys"),
])
def test_a_malformed_unit_in_the_file_is_refused_naming_it(tmp_path: Path, over: dict[str, Any], message: str) -> None:
    path = tmp_path / "profile.json"
    save_profiles(path, {"default": fleet(dataclasses.replace(board("pi-1"), units=_units()))})
    doc = json.loads(path.read_text())
    doc["variants"]["default"]["boards"][0]["units"][0] |= over
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        load_profiles(path)


def test_a_boards_report_carries_its_units_into_its_profile() -> None:
    points = tuple(MeasuredPoint(batch_size=b, step_time_s=0.01 * b, step_time_min_s=0.01 * b, step_time_max_s=0.01 * b,
                                 step_time_spread_s=0.0, samples_per_s=100.0, peak_memory_bytes=10**8, power_w=5.0)
                   for b in (8, 16))
    units = tuple(UnitReport(**u.to_json()) for u in _units())
    report = ProfileReport(agent_version="0.1.0", worker_pid=1, torch_threads=1, param_count=10_000, points=points,
                           active_power_w=5.0, idle_power_w=2.0, power_source="estimated", memory_total_bytes=GB,
                           units=units)
    link = LinkReport(up_bytes_per_s=1e7, down_bytes_per_s=1e7, nbytes=10**6, power_w=None)

    profile = _board_profile("pi-1", _Variant("default", {}, KEY, 10_000), report, link)

    assert profile.units == _units()


def _plan_cli(path: Path, *flags: str) -> int:
    import argparse

    from edgefleet.coordinator.cli.plan import add_plan_parser, cmd_plan

    parser = argparse.ArgumentParser(prog="edge-coordinator")
    add_plan_parser(parser.add_subparsers(dest="command"))
    return cmd_plan(parser.parse_args(["plan", "--profile", str(path), "--no-fleet-check", "--pipeline", *flags]))


def test_plan_pipeline_prints_the_stages_and_says_what_would_fit(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --pipeline`` on a profile file: the chosen plan's stages, memory and link bytes as JSON; a fleet whose
    memory holds no plan exits 1 with the line that says what would."""
    from edgefleet.coordinator.planning.profiles import ProfileMeta

    path = tmp_path / "edgefleet-profile.json"
    meta = ProfileMeta(model="mlp", dataset="digits", batch_sizes=[8, 32])  # the test boards' model key
    boards = (dataclasses.replace(board("pi-1", c=0.01, memory=1 * GB), units=_units()),
              dataclasses.replace(board("pi-2", c=0.02, memory=2 * GB), units=_units(2.0)))
    save_profiles(path, {"default": _fleet(*boards)}, meta=meta)

    assert _plan_cli(path, "--json", "--batch", "32", "--objective", "time") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["global_batch"] == 32 and out["variant"] == "default"
    assert [name for stage in out["stages"] for name in stage["layers"]] == ["net.3", "net.6", "output"]
    assert {b for stage in out["stages"] for b in stage["boards"]} <= {"pi-1", "pi-2"}
    assert all(m["used_bytes"] <= m["limit_bytes"] for m in out["memory"].values())
    assert out["step_time_s"] > 0 and 0 <= out["bubble_fraction"] < 1
    assert out["schedule"] == "gpipe"  # what train runs
    flags = out["train_flags"]
    if len(out["stages"]) == 1:  # data parallelism: train's --boards and --batch, no --pipeline (it needs two stages)
        assert flags[:2] == ["--boards", ",".join(out["stages"][0]["boards"])] and flags[2] == "--batch"
        assert "--pipeline" not in flags
    else:  # stage 0's boards, then CUT@BOARDS: the layer ending the stage before, the stage's boards
        pipeline = flags[flags.index("--pipeline") + 1]
        assert pipeline.split(",")[0] == "+".join(out["stages"][0]["boards"])
        for before, stage, cut in zip(out["stages"], out["stages"][1:], pipeline.split(",")[1:]):
            assert cut == f"{before['layers'][-1]}@{'+'.join(stage['boards'])}"
        assert flags[-2:] == ["--stage-sync", "checkpoint"]

    tiny = tuple(dataclasses.replace(b, memory_total_bytes=1000) for b in boards)  # no layer fits anywhere
    save_profiles(path, {"default": _fleet(*tiny)}, meta=meta)
    assert _plan_cli(path, "--batch", "32") == 1
    text = capsys.readouterr().out
    assert "train it with" not in text and ("variant" in text or "boards" in text)
