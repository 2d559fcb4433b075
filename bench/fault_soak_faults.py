"""The fault soak's instruments and faults on a running lab: memory sampling, checkpoint keeping,
a broker restart, a paused coordinator, a board's agent killed and restarted.

Why here and not in the lab: these are a benchmark's tools for hurting a running job. The lab
offers what a rehearsal needs (``Lab.start_agent``, ``Lab.agent``); the broker restart reaches
into ``Lab.broker`` and the lab's broker cgroup, as nothing else should.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgefleet.lab.lab import Lab

log = logging.getLogger("bench.fault_soak")


def rss_bytes(pid: int) -> int | None:
    """The process's resident memory (VmRSS), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples a process's resident memory every ``period_s``, each sample tagged with the run's progress."""

    def __init__(self, pid: int, progress: Callable[[], float], period_s: float = 1.0) -> None:
        self.pid, self.progress, self.period_s = pid, progress, period_s
        self.samples: list[tuple[float, int]] = []  # (progress, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            rss = rss_bytes(self.pid)
            if rss is None:
                return
            self.samples.append((self.progress(), rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class CheckpointKeeper:
    """Keeps every checkpoint a run writes: a hard link to each new ``checkpoint.pt`` (the coordinator
    replaces it by rename, so each one is a new inode that a link keeps after the next replaces it)."""

    def __init__(self, run_dir: Path, keep_dir: Path, period_s: float = 0.1) -> None:
        self.source, self.keep_dir, self.period_s = run_dir / "checkpoint.pt", keep_dir, period_s
        keep_dir.mkdir(parents=True, exist_ok=True)
        self.kept: list[Path] = []
        self._inodes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def _take(self) -> None:
        try:
            inode = self.source.stat().st_ino
        except OSError:
            return
        if inode in self._inodes:
            return
        target = self.keep_dir / f"{len(self.kept):05d}.pt"
        try:
            os.link(self.source, target)  # whatever inode is there now: a whole checkpoint (renamed into place)
        except OSError:
            return
        self._inodes.add(target.stat().st_ino)
        self.kept.append(target)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._take()


def checkpoints_by_step(paths: list[Path]) -> dict[int, Path]:
    """The kept checkpoints by the step their replica continues from."""
    import torch

    out = {}
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)
        out[int(state["replica"]["step"])] = path
    return out


@dataclass
class FaultLog:
    """What was done to the run, when (seconds since the run started) and at which step."""

    started: float = field(default_factory=time.monotonic)
    events: list[tuple[float, int, str]] = field(default_factory=list)

    def note(self, step: int, what: str) -> None:
        at = time.monotonic() - self.started
        self.events.append((at, step, what))
        print(f"    {at:6.1f} s, step {step}: {what}", flush=True)


def restart_broker(lab: Lab, down_s: float) -> float:
    """Stop the lab's Mosquitto, wait ``down_s``, start a new one on the same address. Returns the seconds it was down.

    Retained messages go with it (the lab's broker keeps no persistence); agents publish theirs again on reconnecting.
    """
    from edgefleet.brokers.local_broker import start_mosquitto
    from edgefleet.lab import links

    old = lab.broker
    assert old is not None, "the lab is not up"
    host, port = old.host, old.port
    stopped = time.monotonic()
    old.stop()
    time.sleep(down_s)  # the fault itself: the broker is away this long
    deadline = time.monotonic() + 20
    while True:
        try:
            if lab.server_netns is not None:
                new = links.call_in_netns(lab.server_netns, lambda: start_mosquitto(host=host, port=port))
            else:
                new = start_mosquitto(host=host, port=port)
            break
        except Exception as exc:  # the port still held by the old listener: BrokerError; retried briefly
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start again on {host}:{port}: {exc}") from None
            time.sleep(0.5)
    lab.broker = new
    if lab.server_cgroup is not None:
        lab.server_cgroup.add(new.proc.pid)  # so that `edge-lab down` finds it after a crash
    return time.monotonic() - stopped


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP the process for ``seconds`` (a closed laptop lid), then SIGCONT; the SIGCONT is sent whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def kill_agent(lab: Lab, board: str) -> int:
    """kill -9 the board's agent (its worker follows: it asked for SIGTERM on its parent's death). Returns the pid."""
    agent = lab.agent(board)
    os.kill(agent.pid, signal.SIGKILL)
    agent.proc.wait(10)
    return agent.pid


def restart_agent(lab: Lab, board: str) -> int:
    """Start the board's agent again, as systemd would. Returns the new pid."""
    return lab.start_agent(board).pid
