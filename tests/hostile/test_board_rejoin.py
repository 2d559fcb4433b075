"""A board whose agent dies mid-run and comes back is asked to rejoin, and trains again from the next step boundary.

Real Mosquitto, real agents (one killed with its worker, as a power cut would, then started again), a real
`edge-coordinator train`: the job goes on without the board, then with it.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.conftest import Fleet
from tests.helpers import wait_until

STEPS = 100_000  # more than the test waits for: it stops the run (Ctrl-C) once the board has rejoined


def _steps(run_dir: Path) -> list[dict[str, object]]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # read while the run appends: the last line may not be whole yet
    return [record for line in lines if line.strip() and "step" in (record := json.loads(line))]


def test_a_restarted_board_rejoins_the_running_job(tmp_path: Path, make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(["steady-1", "restarted-1"], wait="online")  # its own: one of them is killed
    restarted = fleet.agent("restarted-1")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(fleet.train_command(boards="steady-1,restarted-1", model="lenet5", dataset="digits", batch=8,
                                                steps=STEPS, threads=1, checkpoint_every=1000, no_rebalance=True,
                                                run_dir=run_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(_steps(run_dir)) >= 20 or proc.poll() is not None, timeout_s=120, what="20 steps")
        family = psutil.Process(restarted.proc.pid)
        for process in [*family.children(recursive=True), family]:
            process.kill()
        fleet.start("restarted-1", wait=None)  # the same board again (its config and key)

        def rejoined() -> list[int]:
            # steps the killed board was still counted in (until the exchange noticed) come before the first
            # step without it; only the steps with both boards after that one are the rejoined board's
            steps = _steps(run_dir)
            dropped = [int(str(s["step"])) for s in steps if s["boards"] == ["steady-1"]]
            return [int(str(s["step"])) for s in steps
                    if dropped and s["boards"] == ["steady-1", "restarted-1"] and int(str(s["step"])) > dropped[0]]

        wait_until(lambda: len(rejoined()) >= 5 or proc.poll() is not None, timeout_s=180, what="the board to rejoin")
        proc.send_signal(signal.SIGINT)  # stops at a step boundary with a checkpoint
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = _steps(run_dir)
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    assert "board restarted-1 is online again: asked it to rejoin" in out, out[-3000:]
    without = [int(str(s["step"])) for s in steps if s["boards"] == ["steady-1"]]
    assert without and rejoined() and min(rejoined()) > max(without), (without[:3], rejoined()[:3])
    assert [s["step"] for s in steps] == list(range(len(steps)))  # every step once
