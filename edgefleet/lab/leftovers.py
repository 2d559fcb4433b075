"""The lab's state file, and removing whatever a lab left behind, found by the ``efl-`` prefix alone.

Why by prefix: a lab killed with SIGKILL (or a machine rebooted mid-test, for cgroups that
survive in a container) cannot clean up after itself, and its state file may be half-written.
Everything it makes is named ``efl-*`` and every process it starts lives in an ``efl-`` cgroup
and an ``efl-`` namespace, so ``down`` finds and removes all of it with no other knowledge.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import edgefleet.lab.links as links
from edgefleet.lab.cgroups import leftover_groups, remove_leftover_groups
from edgefleet.lab.naming import PREFIX, workdir
from edgefleet.transport.atomic_file import write_atomically

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


def state_path() -> Path:
    return workdir() / STATE_FILE


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a live pid from a reused one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; the fields after its ')' are fixed.
    return int(stat.rsplit(")", 1)[1].split()[19])


def write_state(state: dict[str, Any]) -> None:
    """Atomically replace the state file (a crash leaves the old or the new one, never half)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(state, indent=2).encode())


def read_state() -> dict[str, Any] | None:
    try:
        state: dict[str, Any] | None = json.loads(state_path().read_text())
        return state
    except (OSError, ValueError):
        return None


def running_lab() -> dict[str, Any] | None:
    """The state of a lab whose owning process is still alive (not this process), else None."""
    state = read_state()
    if not state:
        return None
    pid = state.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    if process_start_ticks(pid) != state.get("pid_start_ticks"):
        return None  # dead, or the pid now belongs to someone else
    return state


def stop_running_lab(*, timeout_s: float = 30.0) -> int | None:
    """SIGTERM the process that owns a running lab and wait for it to tear down; its pid, or None."""
    state = running_lab()
    if state is None:
        return None
    pid = int(state["pid"])
    log.info("stopping the lab owned by pid %d", pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_start_ticks(pid) == state.get("pid_start_ticks"):
        time.sleep(0.1)
    return pid


def leftovers() -> list[str]:
    """Names of every lab object that exists now (empty when the machine is clean)."""
    found = [f"netns {n}" for n in links.list_netns()]
    found += [f"link {n}" for n in links.list_links()]
    found += [f"cgroup {p}" for p in leftover_groups()]
    if workdir().exists():
        found.append(f"directory {workdir()}")
    return found


def sweep() -> list[str]:
    """Remove every lab object: processes, cgroups, namespaces, links, the bridge, the work dir.

    Only processes inside ``efl-`` cgroups or ``efl-`` namespaces are killed (the lab started
    each of them); this process is never touched. Returns what was removed.
    """
    removed: list[str] = []
    state = read_state() or {}
    removed += [f"cgroup {p}" for p in remove_leftover_groups()]
    for netns in links.list_netns():
        for pid in links.netns_pids(netns):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                    removed.append(f"process {pid} in {netns}")
                except ProcessLookupError:
                    pass
        links.delete_netns(netns)
        removed.append(f"netns {netns}")
    for name in links.list_links():
        links.delete_link(name)  # deleting one end of a veth deletes both; the bridge last is fine
        removed.append(f"link {name}")
    broker_dir = state.get("broker_workdir")
    if isinstance(broker_dir, str) and Path(broker_dir).name.startswith("edgefleet-broker-") and Path(broker_dir).exists():
        shutil.rmtree(broker_dir, ignore_errors=True)
        removed.append(f"directory {broker_dir}")
    if workdir().exists():
        shutil.rmtree(workdir(), ignore_errors=True)
        removed.append(f"directory {workdir()}")
    for item in removed:
        log.info("removed %s", item)
    return removed


__all__ = [
    "PREFIX",
    "leftovers",
    "process_start_ticks",
    "read_state",
    "running_lab",
    "state_path",
    "stop_running_lab",
    "sweep",
    "write_state",
]
