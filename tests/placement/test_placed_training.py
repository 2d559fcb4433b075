"""Layer placement through real agents, a real broker and the real CLI: the boards train LeNet-5's
convolutions, the coordinator its fully connected tail over the whole global batch, and the model is
the one a single process trains on the same global batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import Fleet
from tests.helpers import interrupt_after, max_relative_error, plain_lenet_training, wait_until

SEED = 7
MODEL_OPTIONS = "optimizer=sgd,lr=0.05"  # SGD: see tests/integration/test_training.py on Adam and rounding
LENET_JOB = {"model": "lenet5", "model_options": MODEL_OPTIONS, "dataset": "digits", "seed": SEED, "threads": 1}

pytestmark = pytest.mark.fleet(boards=("p1", "p2", "p3"), keep_worker=True)  # each job skips the worker's start


def _train(fleet: Fleet, run_dir: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return fleet.train(*args, run_dir=run_dir, timeout_s=timeout_s, **LENET_JOB)


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_a_placed_run_trains_the_model_a_single_process_trains(fleet: Fleet, tmp_path: Path) -> None:
    run = _train(fleet, tmp_path / "placed", "--boards", "p1,p2,p3", "--batch", "8,16,24", "--steps", "20",
                 "--placement", "net.6", "--no-rebalance")
    assert run.returncode == 0, run.stderr + run.stdout
    assert "layer placement after net.6" in run.stdout + run.stderr
    placed = torch.load(tmp_path / "placed" / "model.pt", weights_only=True)
    reference = plain_lenet_training(20, 48, seed=SEED)
    assert max_relative_error(placed, reference) <= 1e-5
    torch.manual_seed(SEED)
    assert max_relative_error(placed, plain_lenet_training(0, 48, seed=SEED)) > 1e-3  # it did train
    steps = _steps(tmp_path / "placed")
    assert [s["step"] for s in steps] == list(range(20))
    assert all(s["boards"] == ["p1", "p2", "p3"] and s["n"] == 48 for s in steps)


def test_a_cut_that_does_not_exist_is_refused_before_any_board_starts_listing_the_cuts(fleet: Fleet,
                                                                                       tmp_path: Path) -> None:
    run = _train(fleet, tmp_path / "bad", "--boards", "p1", "--batch", "8", "--steps", "2", "--placement", "net.99")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out
    assert "no layer named 'net.99'" in out and "net.6" in out, out


def test_an_interrupted_placed_run_resumes_to_the_single_process_model(fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    args = ("--boards", "p1,p2", "--batch", "16,32", "--steps", "24", "--checkpoint-every", "4", "--no-rebalance",
            "--placement", "net.6")
    cmd = fleet.train_command(*args, run_dir=run_dir, **LENET_JOB)
    code, out, err = interrupt_after(cmd, lambda: len(_steps(run_dir)), 6, what="6 steps of the placed run")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 6 <= stopped_at < 24 and not (run_dir / "model.pt").exists()
    resumed = _train(fleet, run_dir, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert max_relative_error(torch.load(run_dir / "model.pt", weights_only=True), plain_lenet_training(24, 48, seed=SEED)) <= 1e-5
    assert [s["step"] for s in _steps(run_dir)] == list(range(24))  # no step lost, none applied twice


def test_a_board_killed_mid_placed_run_is_dropped_on_both_sides_and_the_run_finishes(fleet: Fleet,
                                                                                       tmp_path: Path) -> None:
    victim = fleet.start("p-victim")  # a board of this test's own
    run_dir = tmp_path / "kill"
    cmd = fleet.train_command("--placement", "net.6", run_dir=run_dir, boards="p1,p-victim", batch="16,16", steps=40,
                              no_rebalance=True, **LENET_JOB)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(_steps(run_dir)) >= 8, timeout_s=180, what="8 placed steps with both boards")
        os.kill(victim.proc.pid, signal.SIGKILL)  # the agent; its worker follows it (PR_SET_PDEATHSIG)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in out + err, err + out
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(40))  # every step applied once, in order
    assert steps[0]["boards"] == ["p1", "p-victim"] and steps[-1]["boards"] == ["p1"] and steps[-1]["n"] == 16
    flags = json.loads((run_dir / "result.json").read_text())["boards"]["p-victim"]["flags"]
    assert flags, "the dropped board is named in the run's result"


def test_batchnorm_in_the_head_follows_ddps_rule_as_data_parallel_does(fleet: Fleet, tmp_path: Path) -> None:
    job = {"model": "resnet_small", "model_options": "norm=batch,width=4,norm_groups=2,optimizer=sgd,lr=0.05", "dataset": "digits",
           "seed": SEED, "threads": 1}
    args = ("--boards", "p1,p2", "--batch", "4,8", "--steps", "4", "--no-rebalance")
    placed = fleet.train(*args, "--placement", "net.6", run_dir=tmp_path / "placed", timeout_s=240, **job)
    assert placed.returncode == 0, placed.stderr + placed.stdout
    parallel = fleet.train(*args, run_dir=tmp_path / "parallel", timeout_s=240, **job)
    assert parallel.returncode == 0, parallel.stderr + parallel.stdout
    a = torch.load(tmp_path / "placed" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "parallel" / "model.pt", weights_only=True)
    # relative L2 of all the final parameters and buffers together: the residual blocks' last convolutions start at
    # zero, and a tensor near 1e-8 differs relatively by rounding alone
    flat_a, flat_b = (torch.cat([t[k].float().reshape(-1) for k in sorted(t)]) for t in (a, b))
    assert float((flat_a - flat_b).norm() / flat_b.norm()) <= 1e-5
    assert any("running_mean" in k for k in a) and int(a["net.1.body.0.num_batches_tracked"]) == 4
