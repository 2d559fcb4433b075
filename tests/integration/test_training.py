"""Synchronous data-parallel training through real agents, a real broker and the real CLI.

The core property: the same seed trains the same model whether a global batch of 48 is split
8/16/24 across three boards, taken by one board, or computed by one plain process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import Fleet
from tests.helpers import interrupt_after, max_relative_error, plain_lenet_training, status_json, wait_until

SEED = 7
# SGD with momentum: Adam divides by sqrt(v), which turns rounding-level differences in the summation
# order (1e-9) into steps of lr/10 for parameters whose gradient is near zero; SGD keeps them at 1e-7.
MODEL_OPTIONS = "optimizer=sgd,lr=0.05"
LENET_JOB = {"model": "lenet5", "model_options": MODEL_OPTIONS, "dataset": "digits", "seed": SEED, "threads": 1}

# Four training boards, shared by the tests. t3 runs each job in a worker of its own, as an agent does by default (the
# split test checks that it ends with its job); the others keep theirs, so that a job after the first skips its start.
pytestmark = pytest.mark.fleet(boards={"t1": {"keep_worker": True}, "t2": {"keep_worker": True}, "t3": {},
                                       "solo": {"keep_worker": True}})


def _train(fleet: Fleet, run_dir: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return fleet.train(*args, run_dir=run_dir, timeout_s=timeout_s, **LENET_JOB)


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_split_batches_train_the_same_model_as_one_board_and_one_process(fleet: Fleet, tmp_path: Path) -> None:
    split = _train(fleet, tmp_path / "split", "--boards", "t1,t2,t3", "--batch", "8,16,24", "--steps", "20")
    assert split.returncode == 0, split.stderr + split.stdout
    single = _train(fleet, tmp_path / "single", "--boards", "solo", "--batch", "48", "--steps", "20")
    assert single.returncode == 0, single.stderr + single.stdout

    split_model = torch.load(tmp_path / "split" / "model.pt", weights_only=True)
    single_model = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    reference = plain_lenet_training(20, 48, seed=SEED)
    assert max_relative_error(split_model, reference) <= 1e-5
    assert max_relative_error(single_model, reference) <= 1e-5
    # and it did train: the weights moved away from the initial ones
    torch.manual_seed(SEED)
    assert max_relative_error(split_model, plain_lenet_training(0, 48, seed=SEED)) > 1e-3

    steps = _steps(tmp_path / "split")
    assert [s["step"] for s in steps] == list(range(20))
    assert all(s["boards"] == ["t1", "t2", "t3"] and s["n"] == 48 for s in steps)
    result = json.loads((tmp_path / "split" / "result.json").read_text())
    assert result["val_accuracy"] is not None and result["steps"] == 20
    # Timings a benchmark can use: joining, steady throughput, and each validation's own time.
    assert result["join_s"] > 0 and result["steady_samples_per_s"] > 0
    # val_s counts the replica's validation_step, which runs inside the step's apply (a loop of Lightning's: > 1 ms)
    assert all(s["val_s"] > 0.001 for s in steps if "val_accuracy" in s) and any("val_s" in s for s in steps)

    # The boards are back to idle: status online, torch never loaded by the agent itself, and t3's worker (the agent's
    # default, no keep_worker) gone with its job.
    for agent in map(fleet.agent, ("t1", "t2", "t3")):
        wait_until(lambda agent=agent: status_json(fleet.broker.address).get(agent.board_id, {}).get("state") == "online",
                   timeout_s=30, what=f"{agent.board_id} back online")
        if agent.board_id == "t3":
            assert not psutil.Process(agent.proc.pid).children(), "the training worker outlived its job"
        maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert psutil.Process(agent.proc.pid).memory_info().rss < 80 * 1024 * 1024


def test_interrupted_then_resumed_run_ends_like_an_uninterrupted_one(fleet: Fleet, tmp_path: Path) -> None:
    # --no-rebalance: a re-split follows timing, and a different split sums in another fp32 order.
    args = ("--boards", "t1,t2", "--batch", "16,32", "--steps", "30", "--checkpoint-every", "5", "--no-rebalance")
    whole = _train(fleet, tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr + whole.stdout

    run_dir = tmp_path / "interrupted"
    cmd = fleet.train_command(*args, run_dir=run_dir, **LENET_JOB)
    code, out, err = interrupt_after(cmd, lambda: len(_steps(run_dir)), 12, what="12 steps of the interrupted run")
    assert code == 130, err + out
    assert "--resume" in out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 12 <= stopped_at < 30 and not (run_dir / "model.pt").exists()

    resumed = _train(fleet, run_dir, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert max_relative_error(a, b) <= 1e-6
    assert [s["step"] for s in _steps(run_dir)] == list(range(30))  # no step lost, none applied twice


def test_a_board_killed_mid_job_is_dropped_and_the_job_finishes(fleet: Fleet, tmp_path: Path) -> None:
    victim = fleet.start("victim")  # started and connected: a board of this test's own
    run_dir = tmp_path / "kill"
    cmd = fleet.train_command(model="lenet5", dataset="digits", seed=SEED, threads=1, run_dir=run_dir, boards="t1,victim",
                              batch="16,16", steps=60,
                              no_rebalance=True)  # a re-split on timing noise before the kill would change t1's share
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(_steps(run_dir)) >= 10, timeout_s=180, what="10 steps with both boards")
        os.kill(victim.proc.pid, signal.SIGKILL)  # the agent; its worker follows it (PR_SET_PDEATHSIG)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err + out
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(60))  # every step applied once, in order
    assert steps[0]["boards"] == ["t1", "victim"]
    assert steps[-1]["boards"] == ["t1"] and steps[-1]["n"] == 16
    result = json.loads((run_dir / "result.json").read_text())
    assert any("left" in flag for flag in result["boards"]["victim"]["flags"])


def test_a_run_with_a_target_accuracy_stops_complete_at_the_first_epoch_that_reaches_it(fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "target"
    done = _train(fleet, run_dir, "--boards", "t1,t2", "--batch", "32,32", "--epochs", "8",
                  "--target-accuracy", "0.6", timeout_s=240)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "reached the target 0.6; the run is complete" in done.stdout
    epochs = [s for s in _steps(run_dir) if "val_accuracy" in s]
    assert epochs[-1]["val_accuracy"] >= 0.6 and all(e["val_accuracy"] < 0.6 for e in epochs[:-1])
    result = json.loads((run_dir / "result.json").read_text())
    assert not result["interrupted"] and result["steps"] < result["total_steps"]  # it stopped early, complete
    assert result["target_reached"]["step"] == epochs[-1]["step"] and (run_dir / "model.pt").exists()
    assert _steps(run_dir)[-1]["step"] == epochs[-1]["step"] == result["steps"] - 1  # none recorded past it
    assert f"step {epochs[-1]['step']}: validation accuracy" in done.stdout
    again = _train(fleet, tmp_path / "unused", "--resume", str(run_dir), timeout_s=120)
    assert again.returncode == 1 and "reached its target accuracy" in again.stderr and "Traceback" not in again.stderr


def test_bad_requests_fail_before_training_with_the_reason(fleet: Fleet, tmp_path: Path) -> None:
    ghost = _train(fleet, tmp_path / "ghost", "--boards", "t1,ghost", "--steps", "5", timeout_s=120)
    assert ghost.returncode == 1 and "board ghost has never reported" in ghost.stderr
    assert "Traceback" not in ghost.stderr
    unknown = fleet.train(boards="t1", model="no-such-model", steps=5, timeout_s=120)
    assert unknown.returncode == 1 and "no-such-model" in unknown.stderr and "lenet5" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    planner_only = fleet.train("--objective", "time", "--max-power", "20", boards="t1", steps=5, timeout_s=120)
    assert planner_only.returncode == 1 and "--objective, --max-power" in planner_only.stderr
    assert "add --auto" in planner_only.stderr and "Traceback" not in planner_only.stderr


def test_the_readme_example_model_and_dataset_train_unchanged(fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "user"
    done = fleet.train("--logger", "tensorboard", boards="t1,t2", model="examples.my_fleet_job.model:LitClassifier",
                       model_options="hidden=32", dataset="examples.my_fleet_job.data:make_dataset", batch="32,32", epochs=3,
                       threads=1, run_dir=run_dir)
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["val_accuracy"] == result["val_metrics"]["val_acc"] >= 0.9  # x0 + x1 > 0 is easy to learn
    assert "val_loss" in result["val_metrics"]
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert state["net.0.weight"].shape == (32, 16)
    assert list((run_dir / "logs").glob("events.out.tfevents.*"))
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["replica"]["schedulers"][0]["last_epoch"] == 3  # StepLR stepped at each epoch's end
