"""``train --auto`` end to end: real agents, a real Mosquitto, profiling, planning, training, and the
predicted-vs-measured report.

``run_auto`` is called in-process with the ``train`` parser that ``edge-coordinator`` builds,
plus ``add_auto_args`` (the two lines that wire ``--auto`` into ``train``) when it is not wired yet.
"""

from __future__ import annotations

import argparse
import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from edgefleet import __version__
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.coordinator.cli.auto import add_auto_args, run_auto
from edgefleet.coordinator.cli.train import add_train_parser
from edgefleet.coordinator.planning import load_profiles
from edgefleet.coordinator.planning.profiles import load_profile_meta
from edgefleet.coordinator.run.auto_train import recheck_before_training
from tests.conftest import Fleet
from tests.coordinator.test_plan_cli import _planned_boards, _profile
from tests.helpers import coordinator, status_json, wait_until


def _args(broker: LocalBroker, *argv: str) -> argparse.Namespace:
    """``edge-coordinator --broker B train --auto …`` as the CLI parses it."""
    parser = argparse.ArgumentParser(prog="edge-coordinator")
    parser.add_argument("--broker")
    parser.add_argument("--config", type=Path)
    sub = parser.add_subparsers(dest="command")
    add_train_parser(sub)
    try:
        add_auto_args(sub.choices["train"])
    except argparse.ArgumentError:  # train_cli wires --auto itself
        pass
    return parser.parse_args(["--broker", broker.address, "train", "--auto", *argv])


def test_auto_reuses_a_fitting_profile_leaves_out_an_offline_board_and_reports_predicted_vs_measured(
        tmp_path: Path, make_fleet: Callable[..., Fleet], capsys: pytest.CaptureFixture[str]) -> None:
    ids = ("au-a", "au-b", "au-c")
    fleet = _planned_boards(make_fleet, ids)   # its own: one of them stops
    mosquitto, fleet_key = fleet.broker, fleet.key
    profile = _profile(tmp_path, ids)          # lenet5 on digits, measured by this agent version
    fleet.agent("au-b").proc.send_signal(signal.SIGTERM)   # the fastest board stops after profiling
    assert fleet.agent("au-b").proc.wait(timeout=10) == 0
    wait_until(lambda: status_json(mosquitto.address).get("au-b", {}).get("state") == "offline",
               timeout_s=10, what="au-b offline")
    run_dir = tmp_path / "run"

    code = run_auto(_args(mosquitto, "--fleet-key", str(fleet_key), "--profile", str(profile), "--model", "lenet5",
                          "--dataset", "digits", "--objective", "time", "--batch", "32,64", "--steps", "14",
                          "--threads", "1", "--run-dir", str(run_dir)))

    out = capsys.readouterr().out
    assert code == 0, out
    assert f"reusing the profile {profile}" in out
    assert "board au-b is left out of the plan: it is offline (stopped)" in out
    assert "the plan against the run: predicted vs measured" in out
    assert "overhead: profiling 0.0 s, pre-training 0.0 s" in out
    config = json.loads((run_dir / "config.json").read_text())
    assert set(config["boards"]) <= {"au-a", "au-c"} and sum(config["batch_sizes"]) in (32, 64)
    report = json.loads((run_dir / "plan.json").read_text())
    assert report["predicted"]["boards"] == config["boards"]
    assert report["predicted"]["batch_sizes"] == config["batch_sizes"]
    measured = report["measured"]
    assert measured["steps"] >= 8 and measured["step_time_s"] > 0
    assert measured["power_w"] is not None and measured["power_measured"] is False
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 14


def test_auto_profiles_when_the_saved_profile_is_for_another_model_then_trains(
        tmp_path: Path, make_fleet: Callable[..., Fleet], capsys: pytest.CaptureFixture[str]) -> None:
    ids = ("ap-a", "ap-b")
    fleet = _planned_boards(make_fleet, ids)
    mosquitto, fleet_key = fleet.broker, fleet.key
    profile = _profile(tmp_path, ids, key='mlp{"layers":2}[1,32,32]', model="mlp", variant={"layers": 2})
    run_dir = tmp_path / "run"

    code = run_auto(_args(mosquitto, "--fleet-key", str(fleet_key), "--profile", str(profile), "--model", "lenet5",
                          "--dataset", "digits", "--objective", "edp", "--batch", "32", "--steps", "10",
                          "--threads", "1", "--run-dir", str(run_dir)))

    out = capsys.readouterr().out
    assert code == 0, out
    assert "profiling ap-a, ap-b: the profile was measured for mlp" in out
    fresh = load_profiles(profile)
    assert [fp.model_key for fp in fresh.values()] == ["lenet5{}[1,32,32]"]
    assert {b.agent_version for fp in fresh.values() for b in fp.boards.values()} == {__version__}
    meta = load_profile_meta(profile)
    assert meta is not None and (meta.model, meta.dataset) == ("lenet5", "digits")
    report = json.loads((run_dir / "plan.json").read_text())
    assert report["profile_s"] > 0 and report["measured"]["step_time_s"] > 0
    assert "the plan against the run: predicted vs measured" in out
    # `plan` reads the profile the run wrote, and plans over the same boards.
    planned = coordinator("--broker", mosquitto.address, "plan", "--profile", str(profile), "--json")
    assert planned.returncode == 0, planned.stderr
    assert set(json.loads(planned.stdout)["chosen"]["boards"]) <= set(ids)


def test_a_board_gone_between_planning_and_training_is_left_out_and_the_plan_recomputed(
        tmp_path: Path, make_fleet: Callable[..., Fleet]) -> None:
    from edgefleet.coordinator.planning.plan_fleet import FleetCheck, load_profile_file
    from edgefleet.coordinator.planning.plan_job import PlanRequest
    from edgefleet.transport.settings import BrokerSettings

    ids = ("rc-a", "rc-b", "rc-c")
    fleet = _planned_boards(make_fleet, ids, secure=False, keep_worker=None)  # its own: one of them stops
    mosquitto = fleet.broker
    profiles, _ = load_profile_file(_profile(tmp_path, ids))
    request = PlanRequest(objective="time", max_power_w=None, deadline_s=None, global_batches=(64,), count_idle=False,
                          max_memory_fraction=0.9, top=5)
    planned = FleetCheck(boards=ids)
    chosen = request.run(profiles).chosen           # the fastest uses every board, rc-b among them
    assert "rc-b" in chosen.candidate.boards
    fleet.agent("rc-b").proc.send_signal(signal.SIGTERM)  # then rc-b stops
    assert fleet.agent("rc-b").proc.wait(timeout=10) == 0
    wait_until(lambda: status_json(mosquitto.address).get("rc-b", {}).get("state") == "offline",
               timeout_s=10, what="rc-b offline")
    lines: list[str] = []

    now, check = recheck_before_training(profiles, planned, chosen, request,
                                         BrokerSettings(host=mosquitto.host, port=mosquitto.port), None, "", lines.append)

    assert lines[0] == "board rc-b is left out and the plan recomputed: it is offline (stopped)"
    assert lines[1].startswith("chosen now: rc-a:") and "rc-b" not in lines[1]
    assert "rc-b" not in now.candidate.boards and check.boards == ("rc-a", "rc-c")
