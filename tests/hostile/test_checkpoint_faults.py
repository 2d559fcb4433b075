"""A full disk under the run directory, for real: a small tmpfs, filled, under the atomic writes
and under a real training job.

A full disk must end the run with one clear line (the run directory, the space needed, what to
do), never a traceback; leave no temporary file; keep the last good checkpoint loadable; and
``--resume`` must continue from it once there is space again.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edgefleet.coordinator.run.checkpoints import (
    CHECKPOINT,
    KEEP_PREVIOUS,
    DiskFullError,
    MetricsLog,
    atomic_write_bytes,
    atomic_write_json,
    load_checkpoint,
    save_checkpoint,
)
from tests.conftest import Fleet

KIB = 1024
BOARDS = ("cf-1", "cf-2")
STEPS = 20
EVERY = 5
MODEL_OPTIONS = {"optimizer": "sgd", "lr": 0.05}

# two real agents for the real training job (its one test that asks); its resumed run skips the worker's start
pytestmark = pytest.mark.fleet(boards=BOARDS, keep_worker=True)


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"mount failed: {done.stderr}"


def _unmount(where: Path) -> None:
    done = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:  # something still holds a file open: detach it now, it goes when released
        subprocess.run(["umount", "-l", str(where)], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real disk that fills up."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1m")
    try:
        yield disk
    finally:
        _unmount(disk)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, *, leave: int) -> Path:
    """Take all but ``leave`` bytes of ``disk``'s free space with a file (really allocated: fallocate)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(20):  # another writer may take space between statvfs and fallocate: measure again
            size = os.fstat(fd).st_size + _free(disk) - leave
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
                break
            except OSError:
                continue
    finally:
        os.close(fd)
    assert _free(disk) <= leave + 8 * KIB, f"{disk} still has {_free(disk)} bytes free"
    return filler


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# --- the atomic writes, on a disk that is really full ---------------------------------------------


def test_an_atomic_write_on_a_full_disk_raises_one_clear_error_and_keeps_the_old_file(small_disk: Path) -> None:
    target = small_disk / "result.json"
    atomic_write_json(target, {"steps": 5})
    before = target.read_bytes()
    fill(small_disk, leave=16 * KIB)
    free = _free(small_disk)

    with pytest.raises(DiskFullError) as caught:
        atomic_write_bytes(target, b"x" * (256 * KIB))

    error = caught.value
    assert target.read_bytes() == before  # the old file, whole
    assert _temps(small_disk) == []  # the partial temporary file is gone ...
    assert _free(small_disk) == free  # ... and so is the space it took
    text = str(error)
    assert "\n" not in text
    assert f"the disk holding {small_disk} is full: writing result.json needs 256.0 KiB" in text
    assert error.needed == 256 * KIB and error.free == free
    assert "free at least" in text and "larger disk" in text


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_loadable(small_disk: Path) -> None:
    first = {"replica": {"step": 5}, "weights": torch.arange(32 * KIB, dtype=torch.float32)}  # 128 KiB
    save_checkpoint(small_disk, first)
    save_checkpoint(small_disk, {**first, "replica": {"step": 10}})  # the first becomes checkpoint.prev.pt
    fill(small_disk, leave=64 * KIB)

    with pytest.raises(DiskFullError) as caught:
        save_checkpoint(small_disk, {**first, "replica": {"step": 15}})

    assert "writing checkpoint.pt needs" in str(caught.value)
    assert _temps(small_disk) == []
    assert load_checkpoint(small_disk)["replica"]["step"] == 10  # the newest good one, where it was
    assert torch.load(small_disk / KEEP_PREVIOUS, weights_only=True)["replica"]["step"] == 5
    assert torch.equal(load_checkpoint(small_disk)["weights"], first["weights"])


def test_the_old_checkpoint_is_renamed_away_only_once_the_new_one_is_on_disk(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, {"replica": {"step": 5}})
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")

    def replace(src: Path, dst: Path) -> None:
        real_replace(src, dst)
        events.append(f"rename {Path(src).name} -> {Path(dst).name}")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(tmp_path, {"replica": {"step": 10}})

    assert events == [f"fsync .{CHECKPOINT}.tmp", f"rename {CHECKPOINT} -> {KEEP_PREVIOUS}",
                      f"rename .{CHECKPOINT}.tmp -> {CHECKPOINT}", f"fsync {tmp_path.name}"]
    assert load_checkpoint(tmp_path)["replica"]["step"] == 10


def test_a_metrics_line_that_does_not_fit_is_cut_off_again(small_disk: Path) -> None:
    path = small_disk / "metrics.jsonl"
    metrics = MetricsLog(path)
    for step in range(3):
        metrics.write({"step": step, "loss": 1.0})
    metrics.sync()
    before = path.read_bytes()
    fill(small_disk, leave=0)

    with pytest.raises(DiskFullError, match=r"writing metrics\.jsonl needs"):
        metrics.write({"step": 3, "loss": 1.0, "pad": "x" * (64 * KIB)})  # larger than any page left over
    metrics.close()

    assert path.read_bytes() == before  # whole lines only, as before the failed write
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def test_a_resume_drops_a_torn_last_line_of_metrics(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # killed mid-line

    MetricsLog.truncate_after(path, 2)

    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


# --- a real training job whose run directory fills up ---------------------------------------------


@pytest.fixture
def run_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs for a run directory (a LeNet-5 checkpoint is about 0.5 MiB)."""
    disk = tmp_path / "rundisk"
    _mount_tmpfs(disk, "4m")
    try:
        yield disk
    finally:
        _unmount(disk)


def _checkpoint_estimate() -> int:
    """Bytes of a LeNet-5 checkpoint, roughly: its weights and SGD's momentum, float32 each."""
    from edgefleet.workloads.registry import build_dataset, build_model

    model = build_model("lenet5", MODEL_OPTIONS, data=build_dataset("digits", "train", {}))
    return 2 * 4 * sum(p.numel() for p in model.parameters())


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line] if path.exists() else []


@pytest.mark.timeout(240)
def test_a_full_disk_while_checkpointing_stops_with_one_line_and_the_run_resumes(fleet: Fleet, run_disk: Path) -> None:
    run_dir = run_disk / "run"
    # Room for the run's start (start.pt, kept for the audits: the weights, no momentum yet) and the first checkpoint,
    # not for the second beside it: the checkpoint of step 10 hits ENOSPC.
    filler = fill(run_disk, leave=_checkpoint_estimate() * 2)
    done = fleet.train(boards=BOARDS, batch="8,8", steps=STEPS, checkpoint_every=EVERY, model="lenet5",
                       model_options=MODEL_OPTIONS, dataset="digits", seed=3, threads=1, no_rebalance=True, run_dir=run_dir,
                       timeout_s=180)

    assert done.returncode == 1, done.stderr + done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "is full" in line]
    assert len(lines) == 1, done.stderr
    assert load_checkpoint(run_dir)["replica"]["step"] == EVERY  # the last good checkpoint, loadable
    assert lines[0].startswith(f"edge-coordinator: the disk holding {run_dir} is full: writing {CHECKPOINT} needs ")
    assert " KiB is free; free at least " in lines[0]
    assert lines[0].endswith(f"the checkpoint of step {EVERY} is intact: then continue with "
                             f"edge-coordinator train --resume {run_dir}")
    assert _temps(run_dir) == []
    assert not (run_dir / KEEP_PREVIOUS).exists()  # the old checkpoint was never renamed away
    assert not (run_dir / "model.pt").exists()
    assert _steps(run_dir)[:2 * EVERY] == list(range(2 * EVERY))  # every step the checkpoint covers, and on to 10

    # Space again: --resume continues from the checkpoint and ends the run, every step once.
    filler.unlink()
    resumed = fleet.train(resume=run_dir, timeout_s=180)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert _steps(run_dir) == list(range(STEPS))
    assert json.loads((run_dir / "result.json").read_text())["steps"] == STEPS
    assert torch.load(run_dir / "model.pt", weights_only=True)
    assert _temps(run_dir) == []
