"""``edge-coordinator plan`` through the real CLI: profile files built here, a real broker and real agents.

Profiles are built from the planner's lines (tests/planning builders), so the expected choice and
the figures in the messages can be worked out by hand; the boards' agent versions and online
state come from real agent processes.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from edgefleet import __version__
from edgefleet.coordinator.planning import save_profiles
from edgefleet.coordinator.planning.profiles import ProfileMeta
from tests.conftest import Fleet
from tests.helpers import coordinator, status_json, wait_until
from tests.planning import MB, board
from tests.planning import fleet as fleet_profile

LENET = "lenet5{}[1,32,32]"
DIGITS_TRAIN = 1438  # samples in the digits training split


def _profile(tmp_path: Path, ids: tuple[str, ...] = ("a", "b", "c"), *, version: str = __version__,
             key: str = LENET, model: str = "lenet5", variant: dict | None = None) -> Path:
    """Three unequal boards: ``b`` fast and hungry, ``c`` slow, frugal and short of memory."""
    shapes = [{"a": 0.02, "c": 0.002, "active_w": 6.4, "idle_w": 2.7}, {"a": 0.03, "c": 0.001, "active_w": 10.0, "idle_w": 3.0},
              {"a": 0.02, "c": 0.004, "active_w": 5.0, "idle_w": 2.5, "memory": 300 * MB}]
    boards = [board(i, key=key, version=version, **shape) for i, shape in zip(ids, shapes)]
    profile = fleet_profile(*boards, key=key, dataset_len=DIGITS_TRAIN, grad_bytes=250_000, variant=variant or {})
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": profile}, meta=ProfileMeta(model=model, dataset="digits", batch_sizes=[8, 32]))
    return path


def _plan(profile: Path, *args: str, broker: str | None = None, timeout_s: float = 60):
    head = ("--broker", broker) if broker else ()
    tail = () if broker else ("--no-fleet-check",)
    return coordinator(*head, "plan", "--profile", str(profile), *tail, *args, timeout_s=timeout_s)


# Estimated power between 2 and 6 W, telemetry every 0.2 s; the worker stays between jobs (short jobs follow).
PLANNED_BOARDS = {"idle_w": 2.0, "max_w": 6.0, "keep_worker": True, "agent_args": ("--interval", "0.2")}

# Two boards, trusting the fleet key, for the tests that leave them running (they plan over their own profiles).
pytestmark = pytest.mark.fleet(boards=("pl-a", "pl-b"), **PLANNED_BOARDS)


def _planned_boards(make_fleet: Callable[..., Fleet], ids: Sequence[str], **options: object) -> Fleet:
    """A fleet of this test's own as ``PLANNED_BOARDS``, every board online with samples."""
    fleet = make_fleet(ids, **{**PLANNED_BOARDS, **options})
    _online(fleet.broker.address, tuple(ids))
    return fleet


def _online(broker: str, ids: tuple[str, ...]) -> None:
    wait_until(lambda: all(status_json(broker).get(i, {}).get("health") == "ok" for i in ids),
               timeout_s=30, what=f"agents {', '.join(ids)} online with samples")


def test_plan_marks_the_chosen_row_and_draws_the_pareto_front(tmp_path: Path) -> None:
    profile = _profile(tmp_path)

    shown = _plan(profile, "--objective", "edp")
    as_json = _plan(profile, "--objective", "edp", "--json", "--png", str(tmp_path / "front.png"))

    assert shown.returncode == 0, shown.stderr
    chosen_rows = [line for line in shown.stdout.splitlines() if line.lstrip().startswith("▶")]
    assert len(chosen_rows) == 1
    doc = json.loads(as_json.stdout)
    assert doc["chosen"] == doc["ranked"][0]
    expected = " ".join(f"{b}:{n}" for b, n in zip(doc["chosen"]["boards"], doc["chosen"]["batch_sizes"]))
    assert expected in chosen_rows[0]
    # The chosen one has the least EDP of every feasible candidate listed (no near tie here).
    assert doc["passed_over"] is None and doc["fewer_boards_within"] == 0.02
    assert doc["chosen"]["edp_j_s"] == min(r["edp_j_s"] for r in doc["ranked"])
    # c cannot hold a global batch of 128 alone: ruled out by memory, on c.
    assert any(x["constraint"] == "memory" for x in doc["ruled_out"])
    assert "ruled out by memory" in shown.stdout
    for png in (tmp_path / "edgefleet-profile-pareto.png", tmp_path / "front.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"Pareto front: {tmp_path / 'edgefleet-profile-pareto.png'}" in shown.stdout


def test_a_near_tie_goes_to_fewer_boards_and_says_so(tmp_path: Path) -> None:
    # c at 3 samples makes the step 0.4% shorter by estimate: not worth a third board by default.
    boards = [board(i, key=LENET, a=0.01, c=0.001, link=100 * MB) for i in ("a", "b")]
    profile = fleet_profile(*boards, board("c", key=LENET, a=0.005, c=0.01, link=100 * MB), key=LENET,
                            dataset_len=DIGITS_TRAIN, grad_bytes=100_000)
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": profile}, meta=ProfileMeta(model="lenet5", dataset="digits", batch_sizes=[8, 32]))

    shown = _plan(path, "--objective", "time", "--batch", "64")
    default = json.loads(_plan(path, "--objective", "time", "--batch", "64", "--json").stdout)
    best = json.loads(_plan(path, "--objective", "time", "--batch", "64", "--json", "--fewer-boards-within", "0").stdout)
    wrong = _plan(path, "--fewer-boards-within", "150")

    assert best["chosen"]["boards"] == ["a", "b", "c"] and best["passed_over"] is None
    assert default["chosen"]["boards"] == ["a", "b"]
    assert default["passed_over"] == best["chosen"] == default["ranked"][1]
    assert shown.returncode == 0, shown.stderr
    assert "fewer boards chosen: a:31 b:30 c:3 is 0.4% better by estimate (time per epoch) but takes 3 boards" in shown.stdout
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
    assert "--fewer-boards-within 150: give a percentage from 0" in wrong.stderr


def test_a_power_cap_no_configuration_meets_names_the_constraint_and_the_gap(tmp_path: Path) -> None:
    profile = _profile(tmp_path)

    capped = _plan(profile, "--max-power", "3")
    late = _plan(profile, "--deadline", "0.1", "--epochs", "10")

    # The most frugal configuration is c alone at 5.0 W: 2.0 W over the cap.
    assert capped.returncode == 1 and "Traceback" not in capped.stderr
    assert "--max-power 3 W is 2.0 W short" in capped.stderr
    assert late.returncode == 1 and "Traceback" not in late.stderr
    assert "--deadline" in late.stderr and "short" in late.stderr
    assert "--deadline 0.1 min over 10 epochs = 0.6 s per epoch" in late.stderr


def test_a_profile_of_another_model_or_dataset_or_without_a_variant_is_refused(tmp_path: Path) -> None:
    lenet = _profile(tmp_path)
    mlp_dir = tmp_path / "mlp"
    mlp_dir.mkdir()
    mlp = _profile(mlp_dir, key='mlp{"layers":2}[1,32,32]', model="mlp", variant={"layers": 2})

    other_model = _plan(lenet, "--model", "mlp")
    other_data = _plan(lenet, "--dataset", "synthetic")
    missing_variant = _plan(mlp, "--layers", "2,4")
    profiled_variant = _plan(mlp, "--layers", "2")

    assert other_model.returncode == 1 and "Traceback" not in other_model.stderr
    assert "measured for lenet5{}[1,32,32], this job is model mlp" in other_model.stderr
    assert "edge-coordinator profile --model mlp" in other_model.stderr
    assert other_data.returncode == 1 and "measured on dataset digits, this job uses synthetic" in other_data.stderr
    assert missing_variant.returncode == 1
    assert "layers=4 of mlp are not in the profile (it has layers=2)" in missing_variant.stderr
    assert "edge-coordinator profile --model mlp --layers 4" in missing_variant.stderr
    assert profiled_variant.returncode == 0, profiled_variant.stderr


def test_a_profile_from_another_agent_version_is_refused(tmp_path: Path, fleet: Fleet) -> None:
    _online(fleet.broker.address, fleet.boards)
    profile = _profile(tmp_path, ("pl-a", "pl-b", "pl-c"), version="0.0.9")

    result = _plan(profile, broker=fleet.broker.address)

    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"board pl-a was profiled by agent 0.0.9, it now runs {__version__}" in result.stderr
    assert "edge-coordinator profile" in result.stderr


def test_a_board_offline_at_plan_time_is_left_out_with_a_line(tmp_path: Path, make_fleet: Callable[..., Fleet]) -> None:
    ids = ("off-a", "off-b", "off-c")
    fleet = _planned_boards(make_fleet, ids, secure=False, keep_worker=None)  # its own: one of them stops
    broker = fleet.broker.address
    profile = _profile(tmp_path, ids)
    fleet.agent("off-b").proc.send_signal(signal.SIGTERM)  # b, the fastest, stops after it was profiled
    assert fleet.agent("off-b").proc.wait(timeout=10) == 0
    wait_until(lambda: status_json(broker).get("off-b", {}).get("state") == "offline", timeout_s=10, what="off-b offline")

    shown = _plan(profile, "--objective", "time", broker=broker)
    as_json = _plan(profile, "--objective", "time", "--json", broker=broker)

    assert shown.returncode == 0, shown.stderr
    assert "board off-b is left out of the plan: it is offline (stopped)" in shown.stdout
    assert "planning over 2 of 3 profiled boards: off-a, off-c" in shown.stdout
    doc = json.loads(as_json.stdout)
    assert doc["boards"] == ["off-a", "off-c"] and "off-b" in doc["left_out"]
    assert all("off-b" not in row["boards"] for row in doc["ranked"])
    assert "board off-b is left out of the plan: it is offline (stopped)" in as_json.stderr


def test_verify_pretrains_the_best_candidates_and_chooses_on_measurement(tmp_path: Path, fleet: Fleet) -> None:
    ids = fleet.boards
    _online(fleet.broker.address, ids)
    profile = _profile(tmp_path, ("pl-a", "pl-b", "pl-c"))  # pl-c has no agent: left out

    result = _plan(profile, "--objective", "time", "--batch", "32", "--verify", "2", "--verify-steps", "6",
                   "--fleet-key", str(fleet.key), "--json", broker=fleet.broker.address, timeout_s=240)

    assert result.returncode == 0, result.stderr + result.stdout
    doc = json.loads(result.stdout)
    trials = doc["verify"]["trials"]
    assert len(trials) == 2 and all(t["error"] == "" for t in trials), trials
    for t in trials:
        m = t["measured"]
        assert m["steps"] == 6 and m["step_time_s"] > 0
        assert m["samples_per_s"] == 32 / m["step_time_s"]
        assert m["power_w"] is not None and m["power_measured"] is False  # the agents estimate from CPU load
        assert 2.0 * len(t["estimate"]["boards"]) <= m["power_w"] <= 6.0 * len(t["estimate"]["boards"])
    best = min(trials, key=lambda t: t["measured"]["epoch_time_s"])
    assert trials[doc["verify"]["chosen"]] is best or trials[doc["verify"]["chosen"]] == best
    assert "pre-training candidate 1/2" in result.stderr
    # The boards are back to idle afterwards.
    rows = status_json(fleet.broker.address)
    assert all(rows[i]["state"] == "online" for i in ids)
