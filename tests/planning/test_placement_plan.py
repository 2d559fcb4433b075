"""The planner weighs layer placement (planning.modes.placed, cost_model's per-sample bytes and host time):
on links too slow for the whole gradient it places LeNet-5's dense layers on the coordinator, on fast
links it keeps data-parallel, and it says which and why. Fleets are four equal boards from the planner's
lines (tests/planning builders), so each figure follows from the cost model's formulas by hand."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from edgefleet.coordinator.cli.plan import add_plan_parser, cmd_plan
from edgefleet.coordinator.planning import EXACT, FleetProfile, plan, save_profiles
from edgefleet.coordinator.planning.cut_profile import CutProfile
from edgefleet.coordinator.planning.layer_profile import cut_modes
from edgefleet.coordinator.planning.plan_summary import placement_lines
from edgefleet.coordinator.planning.profiles import ProfileMeta, load_profiles
from edgefleet.protocol.errors import PlanError
from tests.planning import MB, board, fleet

G = 246_824          # LeNet-5's gradient in fp32, bytes
D = 6000
B = 128
LENET = "lenet5{}[1,32,32]"
# LeNet-5 cut after its flatten: 2,572 head parameters, 400 values a sample, 10 outputs; the convolutions
# are 90% of a sample's compute; the dense tail takes 0.3 ms + 3 us a sample on the coordinator.
NET6 = CutProfile(name="net.6", boundary_elements=400, output_elements=10, head_params=2572, tail_params=59134,
                  head_share=0.9, host_a_s=0.0003, host_c_s=3e-6)


def _fleet(*, link: float, cuts: tuple[CutProfile, ...] = (NET6,)) -> FleetProfile:
    base = fleet(*(board(f"w{i}", a=0.01, c=0.001, link=link, key=LENET) for i in range(4)), grad_bytes=G,
                 dataset_len=D, key=LENET)
    return dataclasses.replace(base, cuts=cuts)


def _placed_epoch_by_hand(link: float) -> float:
    """Four boards at 32 samples: a + c s b + H / up + b p (1/up + 1/down) (ready), then H / down (the head's
    average) or the coordinator's broadcast, then the host's tail and the activations over its link."""
    head, per_sample, b = 2572 * 4, 410 * 4, B // 4
    ready = 0.01 + 0.001 * 0.9 * b + head / link + b * per_sample * 2 / link
    back = max(head / link, 4 * head / (125 * MB))
    host = 0.0003 + 3e-6 * B + 2 * per_sample * B / (125 * MB)
    return D / B * (ready + back + host)


def test_on_slow_links_the_plan_places_the_dense_layers_on_the_coordinator_and_says_why() -> None:
    modes, why_not = cut_modes(_fleet(link=2.5 * MB))
    assert why_not == "" and [m.name for m in modes] == ["placed-net.6"]
    result = plan({"default": _fleet(link=2.5 * MB)}, objective="time", modes=(EXACT, *modes))

    assert result.chosen.mode.placement == "net.6" and result.chosen.mode.exact
    assert result.chosen.epoch_time_s == pytest.approx(_placed_epoch_by_hand(2.5 * MB), rel=1e-9)
    chosen, better = placement_lines(result)
    assert chosen.startswith("mode: layer placement after net.6 (train --placement net.6; the same mathematics)")
    assert "10.0 KiB gradient and 1.6 KiB a sample each way instead of the whole 241 KiB gradient" in chosen
    assert "better by estimate" in better and "data-parallel" in better


def test_on_fast_links_data_parallel_stays_and_the_plan_says_how_far_placement_was() -> None:
    slow_host = dataclasses.replace(NET6, host_a_s=0.05)  # a coordinator far slower than the boards' links
    modes, _ = cut_modes(_fleet(link=125 * MB, cuts=(slow_host,)))
    result = plan({"default": _fleet(link=125 * MB, cuts=(slow_host,))}, objective="time", modes=(EXACT, *modes))

    assert result.chosen.mode == EXACT
    [line] = placement_lines(result)
    assert line.startswith("layer placement weighed at 1 cut(s): the best, layer placement after net.6") and \
        line.endswith("worse by estimate (time per epoch): data-parallel chosen")


def test_cuts_travel_in_the_profile_file_and_a_missing_or_unknown_one_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": _fleet(link=2.5 * MB)}, meta=ProfileMeta(model="lenet5", dataset="digits",
                                                                           batch_sizes=[8, 32]))
    profiles = load_profiles(path)
    assert profiles["default"].cuts == (NET6,)
    with pytest.raises(PlanError, match=r"--placement net\.3: no such cut in the profile; the cuts the model admits: net\.6"):
        cut_modes(profiles["default"], only="net.3")
    assert "profile again" in cut_modes(_fleet(link=2.5 * MB, cuts=()))[1]

    parser = argparse.ArgumentParser(prog="edge-coordinator")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--profile", str(path), "--no-fleet-check", "--json", "--png", str(tmp_path / "f.png")])
    assert cmd_plan(args) == 0
    args = parser.parse_args(["plan", "--profile", str(path), "--no-fleet-check", "--json", "--placement", "none",
                              "--png", str(tmp_path / "f.png")])
    assert cmd_plan(args) == 0


def test_plan_json_names_the_placed_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": _fleet(link=2.5 * MB)}, meta=ProfileMeta(model="lenet5", dataset="digits",
                                                                           batch_sizes=[8, 32]))
    parser = argparse.ArgumentParser(prog="edge-coordinator")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--profile", str(path), "--no-fleet-check", "--json", "--png", str(tmp_path / "f.png")])
    assert cmd_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["modes"] == ["exact", "placed-net.6"]
    assert out["chosen"]["mode"]["train_flags"] == ["--placement", "net.6"]
    assert out["chosen"]["mode"]["job_options"] == {"placement": "net.6"}
