"""Teardown always happens: the context manager, SIGTERM to ``lab up``, and ``down`` after a crash
each leave nothing named ``efl-*`` and no process the lab started; a machine that can't run the
lab gets a reason, not a half-built lab."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefleet.lab import host_check
from edgefleet.lab.cgroups import find_controller_mounts
from edgefleet.lab.fleet_file import parse_fleet
from edgefleet.lab.lab import Lab, LabBusy, LabUnavailable
from edgefleet.lab.leftovers import leftovers
from edgefleet.lab.naming import CGROUP_PARENT
from tests.helpers import wait_until

SMALL_FLEET = """
[lab]
name = "small"
keepalive_s = 2

[[board]]
id = "t-1"
model = "test board"
cpu = 0.3
memory = "256MiB"
rate_up = "50mbit"
rate_down = "50mbit"
idle_w = 1.0
max_w = 2.0

[[board]]
id = "t-2"
model = "test board"
cpu = 0.3
memory = "256MiB"
rate_up = "20mbit"
rate_down = "20mbit"
idle_w = 1.0
max_w = 2.0
"""


@pytest.fixture
def small_fleet(tmp_path: Path, no_lab: None) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL_FLEET)
    return path


def _lab_pids() -> set[int]:
    """Every process in the lab's cgroups (agents, broker, workloads)."""
    pids: set[int] = set()
    for mount in find_controller_mounts().values():
        top = mount / CGROUP_PARENT
        for procs in top.rglob("cgroup.procs") if top.exists() else []:
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                pass
    return pids


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _read_until(proc: subprocess.Popen[str], marker: str, *, timeout_s: float) -> tuple[str | None, list[str]]:
    """Read ``proc``'s stdout until a line holds ``marker``: (the line from the marker on, or None; lines seen)."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            line = proc.stdout.readline()
            if not line:
                break
            if marker in line:
                return line[line.index(marker):].strip(), seen
            seen.append(line.rstrip())
    return None, seen


def _start_up(fleet: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """``edge-lab up``, waited on until it prints ``broker=HOST:PORT``."""
    proc = subprocess.Popen([sys.executable, "-m", "edgefleet.lab", "up", "--fleet", str(fleet), "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "up.err").open("w"), text=True)
    line, seen = _read_until(proc, "broker=", timeout_s=90)
    if line is None:
        proc.kill()
        raise AssertionError(f"lab up printed no broker= line: {seen}; stderr: {(tmp_path / 'up.err').read_text()[-1000:]}")
    return proc, line.split("=", 1)[1]


def test_the_context_manager_removes_everything_even_after_an_error(small_fleet: Path) -> None:
    fleet = parse_fleet(small_fleet.read_text(), source=str(small_fleet))
    with pytest.raises(RuntimeError, match="boom"), Lab(fleet, start_agents=False) as lab:
        assert lab.broker_address
        built = leftovers()
        assert "netns efl-t-1" in built and "link efl-br0" in built
        raise RuntimeError("boom")
    assert leftovers() == []


def test_lab_up_tears_down_on_sigterm(small_fleet: Path, tmp_path: Path) -> None:
    proc, broker = _start_up(small_fleet, tmp_path)
    try:
        pids = _lab_pids()
        assert len(pids) >= 3, pids  # two agents and the broker
        assert broker.startswith("198.18.0.1:")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout is not None and "everything removed" in proc.stdout.read()
    assert leftovers() == []
    assert not [p for p in pids if _alive(p)]


def test_down_removes_what_a_killed_lab_left_behind(small_fleet: Path, tmp_path: Path) -> None:
    proc, _ = _start_up(small_fleet, tmp_path)
    try:
        # Only one lab per machine: a second one is refused, naming the owner.
        with pytest.raises(LabBusy, match=f"pid {proc.pid}"):
            Lab(parse_fleet(SMALL_FLEET, host_cores=2), start_agents=False).up()
        pids = _lab_pids()
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait(timeout=10)
        assert leftovers(), "a killed lab leaves its objects behind"
        assert all(_alive(p) for p in pids), "and its processes"

        done = subprocess.run([sys.executable, "-m", "edgefleet.lab", "down"], capture_output=True, text=True, timeout=120, check=False)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert done.returncode == 0, done.stderr
    assert "removed netns efl-t-1" in done.stdout and "removed link efl-br0" in done.stdout
    assert leftovers() == []
    wait_until(lambda: not [p for p in pids if _alive(p)], timeout_s=10, what="the killed lab's processes to be gone")
    again = subprocess.run([sys.executable, "-m", "edgefleet.lab", "down"], capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0 and "nothing to remove" in again.stdout


def test_a_machine_that_cannot_run_the_lab_gets_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs anywhere: the checks are fed a machine that lacks one thing at a time."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (host_check.lab_unavailable_reason() or "")
    with pytest.raises(LabUnavailable, match="needs root"):
        Lab(parse_fleet(SMALL_FLEET, host_cores=2), start_agents=False).up()

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(host_check, "_effective_caps", lambda: 0)
    assert "CAP_NET_ADMIN" in (host_check.lab_unavailable_reason() or "")

    monkeypatch.setattr(host_check, "_effective_caps", lambda: (1 << host_check.CAP_NET_ADMIN) | (1 << host_check.CAP_SYS_ADMIN))
    monkeypatch.setattr(host_check.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(host_check, "find_controller_mounts", dict)
    assert "cgroup v1" in (host_check.lab_unavailable_reason() or "")


def test_a_pytest_run_killed_with_sigterm_still_tears_its_lab_down(small_fleet: Path, tmp_path: Path) -> None:
    # Prepare: a test session (its own pytest process, with the lab fixtures as a plugin) that
    # builds the small fleet and then hangs.
    test_file = tmp_path / "test_hangs.py"
    test_file.write_text(
        "import time\nfrom pathlib import Path\n"
        "def test_hangs(lab_manager):\n"
        f"    lab_manager.get(Path({str(small_fleet)!r}), start_agents=False)\n"
        "    print('LAB IS UP', flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "edgefleet.lab.fixtures", "-p", "no:cacheprovider",
                             "--rootdir", str(tmp_path), str(test_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
    try:
        line, seen = _read_until(proc, "LAB IS UP", timeout_s=90)
        assert line, "\n".join(seen)[-2000:]
        assert leftovers()

        # Execute: what CI does to a job that overran.
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()

    # Assert
    assert leftovers() == []
