"""Start processes inside a board (its namespace and cgroups), watch them, say in words how they ended.

Why a supervisor: a board whose agent dies must not vanish silently from a test or a rehearsal.
When the kernel's OOM killer ends a process because its board went over its memory limit, the
exit status alone only says SIGKILL; the supervisor reads the board's memory cgroup (oom_kill,
failcnt, limit) and reports, for example::

    board pi4-1: memory-hog was killed by the kernel's OOM killer (memory limit 2 GiB, memory.failcnt 31, oom_kill 1)

How a process enters a board: ``sh`` writes its own pid into the board's ``cgroup.procs`` files,
then ``exec``s ``nsenter --net=/run/netns/efl-<board>`` which ``exec``s the command, so the pid the
supervisor holds is the command itself, inside both the cgroups and the namespace from its first
instruction. ``nsenter`` rather than ``ip netns exec``: the latter remounts /sys, which hides
/sys/fs/cgroup from the board's processes (the agent's cgroup CPU source reads it).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from edgefleet.lab.cgroups import Cgroup
from edgefleet.lab.units import format_size

log = logging.getLogger(__name__)

_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def in_cgroups(procs_files: list[Path] | list[str], argv: list[str], *, name: str = "process") -> list[str]:
    """``argv`` as a command that first joins the groups of ``procs_files`` (exit 125 if it cannot)."""
    return ["sh", "-c", _ENTER, name, *map(str, procs_files), "--", *argv]


_EXIT_MEANINGS = {78: " (bad configuration)", 125: " (could not join the board's cgroups)", 126: " (not executable)",
                  127: " (command not found)"}


@dataclass(frozen=True, slots=True)
class Report:
    """How a supervised process ended without the lab asking it to.

    Attributes:
        board_id: The board.
        name: The process's name in the lab (``edge-agent``, ``memory-hog``, ...).
        kind: ``oom-killed``, ``killed`` (another signal) or ``exited``.
        returncode: Popen's returncode (negative: the signal number).
        message: The sentence for people.
    """

    board_id: str
    name: str
    kind: str
    returncode: int
    message: str
    ts: float = field(default_factory=time.time)


@dataclass
class BoardProcess:
    """A process the supervisor started inside a board."""

    board_id: str
    name: str
    proc: subprocess.Popen[bytes]
    cgroup: Cgroup
    log_path: Path | None
    stopping: bool = False
    expect_exit: bool = False   # a workload that ends by itself: exit code 0 is no news
    _buffer: bytes = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def readline(self, *, timeout_s: float) -> str:
        """The next line of a process started with ``capture_stdout=True``; '' at EOF or timeout."""
        assert self.proc.stdout is not None, "start the process with capture_stdout=True"
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return ""
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace").strip()


class Supervisor:
    """Starts board processes and reports every unrequested end, once, in words.

    Args:
        on_report: Called (from a watcher thread) with each ``Report``; reports are also logged
            and kept in ``reports()``.
    """

    def __init__(self, on_report: Callable[[Report], None] | None = None) -> None:
        self._on_report = on_report
        self._reports: list[Report] = []
        self._procs: list[BoardProcess] = []
        self._oom_attributed: dict[str, int] = {}
        self._changed = threading.Condition()

    def start(self, *, board_id: str, name: str, argv: list[str], netns: str, cgroup: Cgroup, cwd: Path,
              log_path: Path | None = None, capture_stdout: bool = False, expect_exit: bool = False,
              env: dict[str, str] | None = None) -> BoardProcess:
        """Start ``argv`` inside the board's cgroups and network namespace, and watch it.

        ``expect_exit``: the process is a job that ends by itself, so exit code 0 is not reported
        (any other end still is). A daemon such as the agent is expected to run until stopped.
        """
        cmd = in_cgroups(cgroup.procs_files(), ["nsenter", f"--net=/run/netns/{netns}", "--", *argv],
                         name=f"{name}@{board_id}")
        with self._changed:
            # OOM kills already counted in this group belong to processes before this one.
            key = cgroup.relpath
            if key not in self._oom_attributed:
                self._oom_attributed[key] = cgroup.oom_kills() or 0
        log_file = log_path.open("ab") if log_path is not None else None
        sink: int | IO[bytes] = log_file if log_file is not None else subprocess.DEVNULL
        stdout_target: int | IO[bytes]
        stderr_target: int | IO[bytes]
        try:
            if capture_stdout:  # stdout to us (a workload's result), stderr to the log
                stdout_target, stderr_target = subprocess.PIPE, sink
            else:
                stdout_target, stderr_target = sink, (subprocess.STDOUT if log_file is not None else sink)
            proc = subprocess.Popen(cmd, stdout=stdout_target, stderr=stderr_target, cwd=cwd,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        finally:
            if log_file is not None:
                log_file.close()
        bp = BoardProcess(board_id, name, proc, cgroup, log_path, expect_exit=expect_exit)
        with self._changed:
            self._procs.append(bp)
        threading.Thread(target=self._watch, args=(bp,), name=f"watch-{name}@{board_id}", daemon=True).start()
        log.info("board %s: started %s (pid %d)", board_id, name, proc.pid)
        return bp

    def _watch(self, bp: BoardProcess) -> None:
        rc = bp.proc.wait()
        quiet = bp.stopping or (bp.expect_exit and rc == 0)
        report = None if quiet else self._explain(bp, rc)
        with self._changed:
            if report is not None:
                self._reports.append(report)
            self._changed.notify_all()
        if report is not None:
            log.warning("%s", report.message)
            if self._on_report is not None:
                self._on_report(report)

    def _explain(self, bp: BoardProcess, rc: int) -> Report:
        who = f"board {bp.board_id}: {bp.name}"
        if rc == -signal.SIGKILL:
            try:
                kills = bp.cgroup.oom_kills()
                failcnt = bp.cgroup.memory_failcnt()
                limit = bp.cgroup.memory_limit()
            except OSError:
                kills, failcnt, limit = None, 0, 0
            with self._changed:
                seen = self._oom_attributed.get(bp.cgroup.relpath, 0)
                by_oom = kills > seen if kills is not None else failcnt > 0
                if by_oom and kills is not None:
                    self._oom_attributed[bp.cgroup.relpath] = seen + 1
            if by_oom:
                counted = f", oom_kill {kills}" if kills is not None else ""
                return Report(bp.board_id, bp.name, "oom-killed", rc,
                              f"{who} was killed by the kernel's OOM killer (memory limit {format_size(limit)}, "
                              f"memory.failcnt {failcnt}{counted})")
        if rc < 0:
            try:
                signame = signal.Signals(-rc).name
            except ValueError:
                signame = f"signal {-rc}"
            return Report(bp.board_id, bp.name, "killed", rc, f"{who} was killed by {signame} (not by the lab)")
        tail = next((line for line in reversed(bp.log().splitlines()) if line.strip()), "")
        last = f"; last log line: {tail.strip()[:300]}" if tail else ""
        return Report(bp.board_id, bp.name, "exited", rc, f"{who} exited with code {rc}{_EXIT_MEANINGS.get(rc, '')}{last}")

    def reports(self, *, board_id: str | None = None, name: str | None = None) -> list[Report]:
        with self._changed:
            return [r for r in self._reports if (board_id is None or r.board_id == board_id) and (name is None or r.name == name)]

    def wait_for_report(self, *, board_id: str, name: str, timeout_s: float) -> Report | None:
        """Block until a report about ``name`` on ``board_id`` arrives (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = [r for r in self._reports if r.board_id == board_id and r.name == name]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found[0] if found else None
                self._changed.wait(left)

    def processes(self, *, board_id: str | None = None, name: str | None = None) -> list[BoardProcess]:
        with self._changed:
            return [p for p in self._procs if (board_id is None or p.board_id == board_id) and (name is None or p.name == name)]

    def stop(self, bp: BoardProcess, *, timeout_s: float = 5.0) -> int | None:
        """Ask the process to stop (SIGTERM), then SIGKILL; no report is made for it."""
        bp.stopping = True
        if bp.proc.poll() is None:
            try:
                bp.proc.terminate()
                bp.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                bp.proc.kill()
                try:
                    bp.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("board %s: %s (pid %d) did not die", bp.board_id, bp.name, bp.pid)
        if bp.proc.stdout is not None:
            bp.proc.stdout.close()
        return bp.proc.returncode

    def stop_all(self, *, timeout_s: float = 5.0) -> None:
        """Stop every process: SIGTERM to all at once, then SIGKILL to whoever is left."""
        procs = self.processes()
        for bp in procs:
            bp.stopping = True
            if bp.proc.poll() is None:
                try:
                    bp.proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for bp in procs:
            try:
                bp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for bp in procs:
            self.stop(bp, timeout_s=timeout_s)


__all__ = ["BoardProcess", "Report", "Supervisor", "in_cgroups"]
