"""Pipeline stages through real agents, a real broker and the real CLI (issue 35): LeNet-5 cut into three
stages, one board each, four micro-batches a step, the stages' links proved and encrypted with each board's own
key; then stage 0 as a group of two boards (data-parallel) and the dense layers on a third, whose board is killed
mid-run and the run resumed with the dense layers on a fourth. Each time the model is the one a single process
trains on the same global batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import AgentFactory
from tests.helpers import max_relative_error, plain_lenet_training, train_command, wait_boards_online, wait_until
from tests.hostile.board_keys import FleetKeys, agent_config, finish, make_keys

SEED = 7
BOARDS = ["q1", "q2", "q3"]


def _fleet(tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> FleetKeys:
    keys = make_keys(tmp_path, BOARDS)
    for board in BOARDS:
        agents.start(board, mosquitto.address, config=agent_config(board, keys, keys.own[board]))
    wait_boards_online(mosquitto.address, BOARDS)
    return keys


def _train(mosquitto: LocalBroker, keys: FleetKeys, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = train_command("--board-keys", str(keys.board_keys), *extra, broker=mosquitto, fleet_key=keys.fleet_key,
                        model="lenet5", model_options="optimizer=sgd,lr=0.05", dataset="digits", seed=SEED, threads=1,
                        run_dir=run_dir)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_three_stage_pipeline_trains_the_model_a_single_process_trains(tmp_path: Path, mosquitto: LocalBroker,
                                                                         agents: AgentFactory) -> None:
    keys = _fleet(tmp_path, mosquitto, agents)
    run_dir = tmp_path / "piped"
    code, out, err = finish(_train(mosquitto, keys, run_dir, "--pipeline", "q1,net.2@q2,net.8@q3",
                                   "--micro-batches", "4", "--batch", "16", "--steps", "20"), 300)
    output = out + err
    assert code == 0, output[-4000:]
    assert "pipeline of 3 stages, 4 micro-batch(es) a step" in output, output[-3000:]
    piped = torch.load(run_dir / "model.pt", weights_only=True)
    reference = plain_lenet_training(20, 16, seed=SEED)
    assert max_relative_error(piped, reference) <= 1e-5
    assert max_relative_error(piped, plain_lenet_training(0, 16, seed=SEED)) > 1e-3  # it did train


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


@pytest.mark.slow
def test_a_stage_board_that_dies_stops_the_run_and_resume_finishes_it_on_another_board(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    keys = make_keys(tmp_path, [*BOARDS, "q4"])
    started = {b: agents.start(b, mosquitto.address, config=agent_config(b, keys, keys.own[b])) for b in BOARDS}
    wait_boards_online(mosquitto.address, BOARDS)
    run_dir = tmp_path / "killed"
    # stage 0 a group of two boards (data-parallel, 6 and 10 samples), the dense layers on q3: layer placement with the
    # tail on a board (issue 34)
    args = ("--pipeline", "q1+q2,net.6@q3", "--batch", "6,10", "--steps", "16", "--checkpoint-every", "4")
    proc = _train(mosquitto, keys, run_dir, *args)
    try:
        wait_until(lambda: len(_steps(run_dir)) >= 6, timeout_s=180, what="6 pipelined steps")
        os.kill(started["q3"].proc.pid, signal.SIGKILL)  # the tail's board: its agent, and its worker with it
        code, out, err = finish(proc, 180)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = out + err
    assert code != 0 and "Traceback" not in output, output[-3000:]
    lost = [line for line in output.splitlines() if "sent no gradient" in line]
    assert "stage 0 on q1+q2" in output and lost and "q3" in lost[0] and "--resume" in lost[0], output[-3000:]
    done = [s["step"] for s in _steps(run_dir)]
    assert done == list(range(len(done))) and 6 <= len(done) < 16  # every step recorded once, in order
    # the tail's board is gone for good: the run goes on with the tail on q4, two micro-batches a step (the checkpoint
    # holds the whole model and optimizer, the coordinator's replica's)
    agents.start("q4", mosquitto.address, config=agent_config("q4", keys, keys.own["q4"]))
    wait_boards_online(mosquitto.address, ["q4"])
    code, out, err = finish(_train(mosquitto, keys, run_dir, "--resume", str(run_dir), "--pipeline", "q1+q2,net.6@q4",
                                   "--micro-batches", "2"), 300)
    assert code == 0, (out + err)[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["pipeline"] == "q1+q2,net.6@q4"
    assert [s["step"] for s in _steps(run_dir)] == list(range(16))  # none lost, none applied twice
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert max_relative_error(model, plain_lenet_training(16, 16, seed=SEED)) <= 1e-5
