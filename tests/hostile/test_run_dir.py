"""A new run pointed at a run directory that already holds a run is refused before anything starts.

Without ``--resume`` it would append to the old run's metrics and overwrite its model. The
refusal must come before the broker is reached or any board is asked: these tests point the
coordinator at a port where nothing listens, so getting as far as the broker would fail
differently (and a job sent to a board cannot happen at all).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edgefleet.brokers.ports import free_port
from edgefleet.coordinator.run.checkpoints import check_new_run_dir
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import train
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.settings import BrokerSettings
from tests.helpers import coordinator, train_args, write_fleet_key


def _old_run(run_dir: Path) -> dict[str, str]:
    """A previous run's files; returns their digests."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text('{"run_id": "old"}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run_dir / "model.pt").write_bytes(b"old model")
    (run_dir / "result.json").write_text('{"steps": 2}\n')
    return _digests(run_dir)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return write_fleet_key(tmp_path / "fleet.key")


@pytest.mark.parametrize("extra", [(), ("--auto",)], ids=["train", "train --auto"])
def test_the_command_refuses_an_existing_run_directory_without_resume(tmp_path: Path, key_file: Path,
                                                                      extra: tuple[str, ...]) -> None:
    run_dir = tmp_path / "runs" / "old"
    before = _old_run(run_dir)
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: reaching the broker would be another error

    done = coordinator(*train_args(*extra, broker=nowhere, fleet_key=key_file, boards="a,b", steps=5, run_dir=run_dir))

    assert done.returncode == 1, done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"edge-coordinator: {run_dir} already holds a run (config.json, metrics.jsonl, result.json, model.pt); "
        f"pass --resume {run_dir} to continue it, or choose another --run-dir for a new run (nothing was changed)"]
    assert _digests(run_dir) == before  # metrics not appended to, model not overwritten


def test_the_service_refuses_an_existing_run_directory_before_any_board_is_asked(tmp_path: Path, key_file: Path) -> None:
    run_dir = tmp_path / "old"
    before = _old_run(run_dir)
    spec = JobSpec(model="lenet5", dataset="digits", boards=("a", "b"), batch_sizes=(8, 8), steps=5, threads=1)

    with pytest.raises(ConfigError, match=r"already holds a run .*pass --resume .* or choose another --run-dir"):
        train(spec, broker=BrokerSettings(host="127.0.0.1", port=free_port()), fleet_key=key_file.read_bytes(),
              run_dir=run_dir)

    assert _digests(run_dir) == before


def test_an_empty_folder_is_a_fine_new_run_directory_and_a_file_is_not(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    check_new_run_dir(empty)  # made beforehand by the user: nothing of a run in it
    check_new_run_dir(tmp_path / "not-yet")  # made by the run
    (empty / "notes.txt").write_text("the user's own file\n")
    check_new_run_dir(empty)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"is a file, not a folder; choose another --run-dir"):
        check_new_run_dir(a_file)


def test_a_run_directory_that_cannot_be_created_is_one_clear_line(tmp_path: Path, key_file: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")

    done = coordinator(*train_args(broker=f"127.0.0.1:{free_port()}", fleet_key=key_file, boards="a", steps=1,
                                   run_dir=blocker / "run"))

    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # The broker is never reached: the job is refused at the run directory, before any board.
    assert f"cannot write {blocker / 'run'}: cannot create the folder" in done.stderr
    assert "choose another --run-dir" in done.stderr
