"""``plan --pipeline --verify K`` through the real CLI, a real broker and real agents (issue 35): the K best distinct
plans are pre-trained for a few real steps, twice each in turn forth and back, a pipeline among them over stage links
proved with each board's own key, and the plan with the best mean measured step is chosen, with the train flags that run
it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from edgefleet import __version__
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.coordinator.planning import save_profiles
from edgefleet.coordinator.planning.cut_profile import CutProfile
from edgefleet.coordinator.planning.profiles import ProfileMeta
from tests.conftest import AgentFactory
from tests.helpers import coordinator, status_json, wait_boards_online
from tests.hostile.board_keys import agent_config, make_keys
from tests.planning import MB, board
from tests.planning import fleet as fleet_profile

LENET = "lenet5{}[1,32,32]"
BOARDS = ["v1", "v2", "v3"]
SAMPLES = 192  # synthetic samples: an epoch of 6 steps of 32
# Two of LeNet-5's cuts as the coordinator profiles them (planning.layer_profile): after the first convolution's
# pooling, and after the first dense layer
CUTS = (CutProfile(name="net.2", boundary_elements=1176, output_elements=10, head_params=156, tail_params=61550,
                   head_share=0.21, host_a_s=0.0, host_c_s=0.0),
        CutProfile(name="net.8", boundary_elements=120, output_elements=10, head_params=50692, tail_params=11014,
                   head_share=0.97, host_a_s=0.0, host_c_s=0.0))


def _profile(tmp_path: Path) -> Path:
    """Three boards on a slow link, so that a pipeline (no gradient exchange with one board a stage) is among the
    best plans beside data parallelism."""
    boards = [board(b, key=LENET, version=__version__, a=0.01, c=0.002, link=0.5 * MB) for b in BOARDS]
    profile = fleet_profile(*boards, key=LENET, dataset_len=SAMPLES, grad_bytes=250_000)
    path = tmp_path / "edgefleet-profile.json"
    save_profiles(path, {"default": dataclasses.replace(profile, cuts=CUTS)},
                  meta=ProfileMeta(model="lenet5", dataset="synthetic", dataset_options={"n": SAMPLES}, batch_sizes=[8, 32]))
    return path


def _pipeline_port() -> str:
    """Below Linux's ephemeral ports, one range for each xdist worker (tests/pipeline/test_pipelined_training.py)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return str(24050 + 100 * int(worker or 0))


@pytest.mark.slow
# 3 + 3 + 1 steps of 32 of 192 samples (6 batches): the data's epoch ends before the last step, where a later stage's
# board sends its state (protocol.stage_sync) and the coordinator must expect it
def test_plan_pipeline_verify_pretrains_the_best_plans_and_chooses_the_fastest_measured(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    keys = make_keys(tmp_path, BOARDS)
    kept = "[training]\nkeep_worker = true\n"  # one worker a board for the pre-trainings in turn
    for b in BOARDS:
        agents.start(b, mosquitto.address, config=agent_config(b, keys, keys.own[b]) + kept)
    wait_boards_online(mosquitto.address, BOARDS)
    profile = _profile(tmp_path)

    result = coordinator("--broker", mosquitto.address, "plan", "--profile", str(profile), "--pipeline",
                         "--objective", "time", "--batch", "32", "--boards", "v1,v2,v3", "--verify", "2",
                         "--verify-steps", "3", "--verify-rounds", "2", "--fleet-key", str(keys.fleet_key),
                         "--board-keys", str(keys.board_keys),
                         "--pipeline-port", _pipeline_port(), "--json", timeout_s=300)

    assert result.returncode == 0 and "Traceback" not in result.stderr, f"{result.stderr[-4000:]}\n{agents.tails()}"
    doc = json.loads(result.stdout)
    trials = doc["verify"]["trials"]
    assert len(trials) == 2 and all(t["error"] == "" for t in trials), (trials, result.stderr[-3000:])
    assert len({t["plan"] for t in trials}) == 2  # two distinct plans
    assert any("--pipeline" in t["train_flags"] for t in trials), trials  # a pipeline was pre-trained
    for t in trials:
        m, takes = t["measured"], t["takes"]
        assert len(takes) == 2 and all(len(x["intervals_s"]) == 3 for x in takes)
        assert m["steps"] == 6 and m["step_time_s"] == pytest.approx((takes[0]["step_time_s"] + takes[1]["step_time_s"]) / 2)
        assert m["samples_per_s"] == pytest.approx(32 / m["step_time_s"])
        assert t["predicted"]["step_time_s"] > 0
    assert trials[0]["predicted"]["epoch_time_s"] <= trials[1]["predicted"]["epoch_time_s"]  # the estimate's order
    fastest = min(range(2), key=lambda i: trials[i]["measured"]["epoch_time_s"])
    assert doc["verify"]["chosen"] == fastest
    assert doc["verify"]["agrees"] == (fastest == 0)
    order = [line.split(": plan ")[1][0] for line in result.stderr.splitlines() if line.startswith("pre-training ")]
    assert order == ["1", "2", "2", "1"], result.stderr[-3000:]  # A B B A
    assert "train it with: edge-coordinator train ... " + " ".join(trials[fastest]["train_flags"]) in result.stderr
    rows = status_json(mosquitto.address)  # the boards are idle again
    assert all(rows[b]["state"] == "online" for b in BOARDS)
