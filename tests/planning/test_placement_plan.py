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
    assert why_not == "" and [m.name for m in modes] == ["placed-net.6", *(f"placed-net.6@w{i}" for i in range(4))]
    result = plan({"default": _fleet(link=2.5 * MB)}, objective="time", modes=(EXACT, *modes))

    assert result.chosen.mode.placement == "net.6" and result.chosen.mode.exact
    assert not result.chosen.mode.tail_board  # the coordinator's wide link and fast tail beat any board's
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
    assert line.startswith("layer placement weighed at 1 cut(s) with the tail on 5 host(s): the best, layer placement "
                           "after net.6") and \
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
    assert out["modes"] == ["exact", "placed-net.6", *(f"placed-net.6@w{i}" for i in range(4))]
    assert out["chosen"]["mode"]["train_flags"] == ["--placement", "net.6"]
    assert out["chosen"]["mode"]["job_options"] == {"placement": "net.6"}


def test_a_board_is_weighed_as_the_tail_host_and_chosen_where_the_coordinator_is_slower() -> None:
    """A model with a large dense head (conv_mlp's shape: 2.1 MB of gradient, 522 values a sample at the cut), a
    coordinator whose tail is slow (a Pi-class machine) and one strong board: the tail goes to that board, whose link
    carries every sample's activations, while the other boards train the head."""
    grad = (5056 + 535_562) * 4
    cut = CutProfile(name="net.6", boundary_elements=512, output_elements=10, head_params=5056, tail_params=535_562,
                     head_share=0.9, host_a_s=0.2, host_c_s=1e-4)
    strong = board("big", a=0.002, c=0.0002, link=12.5 * MB, key=LENET)
    small = [board(f"w{i}", a=0.01, c=0.001, link=12.5 * MB, key=LENET) for i in range(3)]
    profile = dataclasses.replace(fleet(strong, *small, grad_bytes=grad, dataset_len=D, key=LENET), cuts=(cut,))
    modes, _ = cut_modes(profile)
    assert "placed-net.6@big" in [m.name for m in modes]
    result = plan({"default": profile}, objective="time", modes=(EXACT, *modes))
    chosen = result.chosen
    tail = chosen.mode.tail_board  # a small board: the head is 90% of the compute, so big trains the head
    assert tail in ("w0", "w1", "w2") and tail not in chosen.candidate.boards and "big" in chosen.candidate.boards
    assert chosen.mode.train_flags == ("--placement", f"net.6@{tail}", "--stage-sync", "checkpoint")
    # the host's serial part by hand: the board's fixed cost, its tail state amortised over 50 steps, and per sample
    # the tail's share of its compute and 522 values each way over its link
    host = 0.01 + 4 * 535_562 * 4 / 50 / (12.5 * MB) + B * (0.001 * 0.1 + 522 * 4 * 2 / (12.5 * MB))
    assert chosen.exchange_s >= host
    line, better = placement_lines(result)[:2]
    assert f"the tail on {tail}" in line and f"{tail}'s link carries the whole batch's" in line
    assert "better by estimate" in better
    # train --auto runs it as the two-stage pipeline it is, the tail's state at checkpoints only
    from edgefleet.coordinator.run.auto_train import job_for  # the coordinator's run stack: only here
    from edgefleet.coordinator.run.job_spec import JobSpec

    job = job_for(JobSpec(model="conv_mlp", dataset="digits", epochs=1.0), chosen, D)
    heads = chosen.candidate.boards
    assert job.pipeline == f"{'+'.join(heads)},net.6@{tail}" and job.stage_sync == "checkpoint" and not job.placement
    assert job.boards == (*heads, tail) and job.batch_sizes == (*chosen.candidate.batch_sizes, 0)
    # --placement CUT@BOARD weighs that host alone; an unknown board is refused naming the profiled ones
    assert [m.name for m in cut_modes(profile, only="net.6@big")[0]] == ["placed-net.6@big"]
    with pytest.raises(PlanError, match="no profile of board nowhere; the profiled boards: big, w0, w1, w2"):
        cut_modes(profile, only="net.6@nowhere")


def test_train_auto_weighs_a_board_as_the_tail_host_only_where_every_board_has_its_own_key() -> None:
    from edgefleet.coordinator.planning.plan_job import placement_modes  # the plan service: only here

    profile = _fleet(link=2.5 * MB)
    notes: list[str] = []
    assert any(m.tail_board for m in placement_modes("auto", {"default": profile}, notes))  # plan: keys not known
    modes = placement_modes("auto", {"default": profile}, notes, keyed={"w0", "w1"})
    assert [m.name for m in modes] == ["placed-net.6"]
    assert notes[-1] == ("a board as the tail host not weighed: its stage links need each board's own key, and w2, w3 "
                         "have none here (--board-keys)")
    assert len(placement_modes("auto", {"default": profile}, [], keyed={f"w{i}" for i in range(4)})) == 5
