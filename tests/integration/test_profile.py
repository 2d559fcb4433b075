"""``edge-coordinator profile`` through a real broker, two real agents and the real CLI.

One agent runs a worker per job (the default); the other keeps its worker between jobs
(``[training] keep_worker = true``), so its next job runs in the same process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from edgefleet.coordinator.planning.pipeline_model import problem_from_fleet
from edgefleet.coordinator.planning.profiles import load_profile_meta, load_profiles
from edgefleet.protocol.jobs import ProfileCommand
from edgefleet.protocol.signing import sign_command
from tests.board_watch import BoardWatch
from tests.conftest import Fleet
from tests.helpers import COORDINATOR, wait_until

ONE_SHOT, KEPT = "prof-once", "prof-kept"

pytestmark = pytest.mark.fleet(boards={ONE_SHOT: {"keep_worker": False}, KEPT: {"keep_worker": True}})


def _profile(fleet: Fleet, *args: str, timeout_s: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*COORDINATOR, "--broker", fleet.broker.address, "profile", "--fleet-key", str(fleet.key), "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **(env or {})})


def _workers(agent_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(agent_pid).children()]


def test_two_boards_are_profiled_and_the_kept_worker_runs_the_next_job(fleet: Fleet, tmp_path: Path) -> None:
    once, kept = fleet.agent(ONE_SHOT), fleet.agent(KEPT)
    path = tmp_path / "profile.json"
    done = _profile(fleet, "--boards", f"{ONE_SHOT},{KEPT}", "--model", "lenet5", "--dataset", "digits",
                    "--batch", "8,16", "--warmup", "2", "--steps", "8", "--timed-budget", "0.001", "--probe-bytes",
                    "1000000", "--profile", str(path))
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"saved to {path}" in done.stdout and "batch 16" in done.stdout and "Traceback" not in done.stderr
    # the budget reached both boards: each batch size timed over the fewest steps it allows
    assert done.stdout.count("(5 of 8 steps timed: 0.001 s budget)") == 4, done.stdout

    fleet_profile = load_profiles(path)["default"]
    assert set(fleet_profile.boards) == {ONE_SHOT, KEPT}
    assert fleet_profile.grad_bytes > 0 and fleet_profile.coordinator_link_bytes_per_s > 0
    for board in fleet_profile.boards.values():
        small, large = board.points
        assert (small.batch_size, large.batch_size) == (8, 16)
        # The two "boards" share this machine's cores and run at once, so one board's raw medians at 8
        # and 16 can swap; the fitted line, which the planner uses, grows with the batch.
        assert small.step_time_s > 0 and large.step_time_s > 0
        assert 0 < board.step_time(8) < board.step_time(16) < board.step_time(64)
        assert small.peak_memory_bytes > 0 and large.peak_memory_bytes > 0 and board.memory_total_bytes > 0
        assert board.link_bytes_per_s > 0 and (board.link_down_bytes_per_s or 0) > 0
        # every job timed LeNet-5's own gradient up and back, and the planner's exchange follows it
        assert board.link_round_bytes == fleet_profile.grad_bytes and 0 < (board.link_round_s or 0) < 1.0
        assert board.exchange_link_s_per_byte * fleet_profile.grad_bytes == pytest.approx(board.link_round_s)
        assert board.power_source == "estimated" and board.active_power_w >= board.idle_power_w > 0
    meta = load_profile_meta(path)
    assert meta is not None and (meta.model, meta.dataset, meta.batch_sizes) == ("lenet5", "digits", [8, 16])
    # every board timed LeNet-5's pipeline units, the runs between the cuts the coordinator profiled, and the
    # pipeline planner takes them instead of its stand-ins
    cut_names = [cut.name for cut in fleet_profile.cuts]
    for board in fleet_profile.boards.values():
        assert len(board.units) == len(cut_names) + 1 == 12 and [u.name for u in board.units][:-1] == cut_names
    _, notes = problem_from_fleet(fleet_profile, global_batch=32)
    assert "measured on 2 board(s)" in notes[0] and not any("no per-layer figures" in note for note in notes)

    # The one-shot board's worker exits after its job; the kept one waits for the next job.
    wait_until(lambda: not _workers(once.proc.pid), timeout_s=30, what="the one-shot worker to exit")
    (worker_pid,) = _workers(kept.proc.pid)
    client = BoardWatch(fleet.broker, KEPT)
    try:
        command = ProfileCommand(job_id="again-0", board_id=KEPT, model="lenet5", dataset="digits", batch_sizes=[4, 8],
                                 warmup_steps=1, timed_steps=2, threads=1, probe_host="127.0.0.1", probe_port=9,
                                 probe_token="t", probe_bytes=0)
        client.publish(sign_command(command.to_dict(), key=bytes.fromhex(fleet.key.read_text())))
        ended = wait_until(lambda: [e for e in client.events if e.job_id == "again-0" and e.phase in ("finished", "failed")],
                           timeout_s=30, what="the second job on the kept worker")
    finally:
        client.close()
    assert ended[0].phase == "finished", ended[0].message
    running = [e for e in client.events if e.phase == "running"]
    assert running[0].data == {"worker_pid": worker_pid} and ended[0].data["worker_pid"] == worker_pid
    assert _workers(kept.proc.pid) == [worker_pid]
    assert f"sending it to the running worker (pid {worker_pid})" in kept.log()


def test_an_unknown_model_fails_before_anything_starts(fleet: Fleet, tmp_path: Path) -> None:
    done = _profile(fleet, "--boards", ONE_SHOT, "--model", "no-such-model", "--profile", str(tmp_path / "p.json"))
    assert done.returncode == 1
    assert "no-such-model" in done.stderr and "lenet5" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_board_that_is_not_there_is_named_before_anything_starts(fleet: Fleet, tmp_path: Path) -> None:
    done = _profile(fleet, "--boards", f"{ONE_SHOT},ghost", "--batch", "8,16", "--profile", str(tmp_path / "p.json"))
    assert done.returncode == 1
    assert "board ghost has never reported" in done.stderr and "Traceback" not in done.stderr


COORDINATOR_ONLY_MODEL = """
import math

import pytorch_lightning as pl
import torch


class Net(pl.LightningModule):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = torch.nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x):
        return self.linear(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_board_that_fails_mid_profile_is_named_with_its_reason(fleet: Fleet, tmp_path: Path) -> None:
    (tmp_path / "coordinator_only_model.py").write_text(COORDINATOR_ONLY_MODEL)  # installed here, not on the board
    done = _profile(fleet, "--boards", ONE_SHOT, "--model", "coordinator_only_model:Net", "--batch", "8,16",
                    "--profile", str(tmp_path / "p.json"), env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stderr + done.stdout
    assert f"board {ONE_SHOT} failed to profile variant default" in done.stderr
    assert "cannot import module 'coordinator_only_model'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "p.json").exists()
