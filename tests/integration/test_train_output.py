"""``train`` as people watch it, through the real CLI, real agents and a real broker, stdout a pipe (as under
``nohup``, systemd or ``| tee``): plain progress lines and each board's joining, no Lightning chatter but the
user's own warnings, ``--json``, ``--boards`` naming a board that is not there, and completing ``--boards`` from
the last ``status``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import Fleet
from tests.helpers import COORDINATOR, wait_until
from tests.integration.warning_module import WARNING_TEXT

pytestmark = pytest.mark.fleet(boards=("w1", "w2"), keep_worker=True)  # a job after the first skips the worker's start

JOB = {"boards": "w1,w2", "model": "tests.integration.warning_module:WarningMLP", "dataset": "synthetic", "seed": 3,
       "threads": 1}
STEPS = 8
PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d · epoch 1/1 · step (\d+)/8 · \d+ samples/s · loss \d+\.\d+ .*· ETA \S+$")
LIGHTNING_CHATTER = ("GPU available", "TPU available", "litlogger", "LitLogger", "rank_zero", "`Trainer.fit` stopped",
                     "is deprecated")


def test_through_a_pipe_train_prints_progress_lines_each_board_joining_and_no_lightning_chatter(
        fleet: Fleet, tmp_path: Path) -> None:
    # Execute: stdout and stderr are pipes (the run is shorter than --progress-every's 30 s: its first and last steps)
    done = fleet.train(steps=STEPS, run_dir=tmp_path / "run", **JOB)

    # Assert: a line per board as it joins, then plain progress lines up to the last step
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    joined = [line for line in lines if re.fullmatch(r"board w[12] joined \([12]/2\)", line)]
    assert sorted(line.split()[1] for line in joined) == ["w1", "w2"], done.stdout
    steps = [int(m.group(1)) for m in map(PROGRESS_LINE.match, lines) if m]
    assert steps[0] == 1 and steps[-1] == STEPS, done.stdout
    assert lines.index(joined[-1]) < next(i for i, line in enumerate(lines) if PROGRESS_LINE.match(line))
    # ... Lightning's INFO lines (each came twice), its advert and the libraries' deprecations are gone
    output = done.stdout + done.stderr
    assert not [word for word in LIGHTNING_CHATTER if word in output], output[-4000:]
    assert not [line for line in output.splitlines() if line.startswith("INFO")], output[-4000:]
    # ... but the user's module's own warning shows, once; the legacy key's security warning too, once per run
    assert done.stderr.count(WARNING_TEXT) == 1, done.stderr[-3000:]
    assert done.stderr.count("is a shared HMAC secret") == 1, done.stderr[-3000:]


def test_train_json_prints_the_result_as_one_json_document_and_the_progress_on_stderr(fleet: Fleet, tmp_path: Path) -> None:
    done = fleet.train("--json", steps=STEPS, run_dir=tmp_path / "run", **JOB)

    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # the whole of stdout: one document
    assert (result["steps"], result["total_steps"], result["interrupted"]) == (STEPS, STEPS, False)
    assert result["run_dir"] == str(tmp_path / "run") and Path(result["model"]).is_file()
    assert result == {**json.loads((tmp_path / "run" / "result.json").read_text()), "run_dir": result["run_dir"],
                      "model": result["model"]}
    assert "board w1 joined" in done.stderr and f"step {STEPS}/{STEPS}" in done.stderr


@pytest.mark.parametrize("auto", [(), ("--auto",)], ids=["train", "train --auto"])
def test_boards_that_are_not_there_are_refused_before_anything_is_built(fleet: Fleet, tmp_path: Path,
                                                                         auto: tuple[str, ...]) -> None:
    started = time.monotonic()
    done = fleet.train(*auto, steps=STEPS, run_dir=tmp_path / "run", **{**JOB, "boards": "w1,nosuch"}, timeout_s=120)
    took_s = time.monotonic() - started

    assert done.returncode == 1, done.stderr[-3000:]
    assert "board nosuch has never reported on this broker" in done.stderr, done.stderr
    assert {"w1", "w2"} <= set(done.stderr.partition("Online now: ")[2].partition(";")[0].split(", ")), done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory, the model or a Trainer
    assert WARNING_TEXT not in done.stderr and "Traceback" not in done.stderr
    assert took_s < 60, took_s  # a snapshot of the fleet, not a join that times out


def test_board_ids_complete_from_the_last_status(fleet: Fleet, tmp_path: Path) -> None:
    # Prepare: status, with the user's cache directory in tmp_path
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    shown = subprocess.run([*COORDINATOR, "--broker", fleet.broker.address, "status", "--json", "--wait", "2"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert {"w1", "w2"} <= set((tmp_path / "cache" / "edgefleet" / "boards").read_text().split())

    # Execute: complete `train --boards w`, then the id after a comma
    def complete(*words: str) -> str:
        array = " ".join(f"'{w}'" for w in words)
        return f'COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; _edgefleet_edge_coordinator; echo "${{COMPREPLY[*]}}"'

    script = "; ".join([f"source <({' '.join(COORDINATOR)} completion bash)",
                        complete("edge-coordinator", "train", "--boards", "w"),
                        complete("edge-coordinator", "train", "--boards", "w1,w"),
                        complete("edge-coordinator", "profile", "--boards", "")])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)

    # Assert
    assert done.returncode == 0 and not done.stderr, done.stderr
    first, after_comma, profile = done.stdout.splitlines()
    assert {"w1", "w2"} <= set(first.split()) and {"w1,w1", "w1,w2"} <= set(after_comma.split())
    assert {"w1", "w2"} <= set(profile.split())


def test_status_watch_shows_the_time_and_the_fleets_total_power(fleet: Fleet, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Prepare: a view of the fleet, every board with a power reading (the board ids it keeps: in tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from edgefleet.coordinator.cli.status import watch
    from edgefleet.coordinator.control.monitor import monitor_fleet
    from edgefleet.protocol.address import parse_broker
    from edgefleet.transport.settings import BrokerSettings

    address = parse_broker(fleet.broker.address, what="--broker")
    with monitor_fleet(BrokerSettings(host=address.host, port=address.port)) as view:
        wait_until(lambda: all(r.sample is not None and r.sample.power_w for r in view.rows() if r.board_id in ("w1", "w2"))
                   and {"w1", "w2"} <= {r.board_id for r in view.rows()}, timeout_s=30, what="w1 and w2's power")

        # Execute: the live view for a moment (off a terminal, rich draws its last frame at the end)
        watch(view, title="edgefleet test", seconds=1.0)

    # Assert: the title carries the date and time and the fleet's total power (estimated here: W*)
    title = next(line for line in capsys.readouterr().out.splitlines() if "edgefleet test" in line)
    match = re.search(r"edgefleet test  (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)  fleet power (\d+\.\d) W\*", title)
    assert match, title
    assert 2 * 2.7 - 0.1 <= float(match.group(2)) <= 2 * 6.4 + 0.1  # two boards of the estimated model's 2.7-6.4 W
    assert {"w1", "w2"} <= set((tmp_path / "cache" / "edgefleet" / "boards").read_text().split())
