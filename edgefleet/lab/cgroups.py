"""cgroup v1 groups for emulated boards: a CPU quota, a memory limit, and the counters to check both.

Why v1 and files rather than systemd: the lab machine mounts each v1 controller under
/sys/fs/cgroup/<controller>, and writing cpu.cfs_quota_us / memory.limit_in_bytes directly is
what the kernel enforces, with nothing in between that could round or delay it. Each board's
group is ``efl-lab/efl-<board>`` in the cpu, cpuacct and memory hierarchies (the same directory
once when controllers share a mount, as in ``cpu,cpuacct``).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgefleet.lab.naming import CGROUP_PARENT, PREFIX

log = logging.getLogger(__name__)

CONTROLLERS = ("cpu", "cpuacct", "memory")

# The CFS period the quotas are expressed in. The kernel's default is 100 ms: a board with 0.09 of
# a core would then run 9 ms and stall up to 91 ms, at every step and every exchange, which is
# slower than a slow CPU would be. At 10 ms it stalls at most ~9 ms, like a slower CPU. The kernel
# refuses a quota under 1 ms, so a board below 0.1 core gets a longer period (1 ms of CPU in it).
CFS_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000

# cpu.shares of the lab's parent group. In v1 the parent competes with every task at the root as
# ONE entity of weight 1024, so on a busy host all boards together would get the share of a single
# process and fall below their quotas. A large weight lets them reach their quotas (which cap
# them, so the host keeps what the fleet file reserved).
LAB_PARENT_SHARES = 1024 * 64

# A board's own cpu.shares per core of quota. With equal weights (the default 1024 each) a board's
# share of a contended host core does not depend on its quota, so when every board computes at
# once the large ones (an x86 box of 0.6 CPU beside a Pi of 0.2 on the same core) fall below their
# quotas first, and a board's speed depends on which others are busy. Weights in proportion to the
# quotas share a contended core in the same proportion as the quotas, so every board slows alike,
# if at all (tests/lab/test_cpu_quotas.py checks both).
SHARES_PER_CPU = 10_240


def find_controller_mounts(mounts_file: Path = Path("/proc/self/mounts")) -> dict[str, Path]:
    """``{"cpu": Path("/sys/fs/cgroup/cpu"), ...}`` for the v1 controllers the lab uses."""
    found: dict[str, Path] = {}
    try:
        lines = mounts_file.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or parts[2] != "cgroup":
            continue
        for option in parts[3].split(","):
            if option in CONTROLLERS:
                found.setdefault(option, Path(parts[1]))
    return found


def _write(path: Path, value: str) -> None:
    with path.open("w") as handle:
        handle.write(value)


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


@dataclass
class Cgroup:
    """One board's group in every controller the lab uses.

    Attributes:
        relpath: The group's path below each controller's mount, e.g. ``efl-lab/efl-pi4-1``.
        mounts: Controller name -> mount point (from ``find_controller_mounts()``).
    """

    relpath: str
    mounts: dict[str, Path] = field(default_factory=find_controller_mounts)

    def path(self, controller: str) -> Path:
        return self.mounts[controller] / self.relpath

    def _dirs(self) -> list[Path]:
        """Each distinct directory once, even where controllers share a mount."""
        seen: dict[Path, None] = {}
        for controller in CONTROLLERS:
            seen.setdefault(self.path(controller), None)
        return list(seen)

    def create(self) -> None:
        for directory in self._dirs():
            directory.mkdir(parents=True, exist_ok=True)
        log.debug("cgroup %s created", self.relpath)

    def set_cpu_quota(self, cpus: float, period_us: int = CFS_PERIOD_US, *, burst_periods: float = 0.0) -> bool:
        """Limit the group to ``cpus`` cores' worth of CPU time (0.2 = 2 ms per 10 ms), and weigh it as much.

        ``period_us`` is lengthened where ``cpus`` of it would be under the kernel's 1 ms floor.

        ``burst_periods`` > 0 lets the group carry quota it could not use (other groups held the
        host's cores) into later periods, up to that many periods' quota, one at most
        (``cpu.cfs_burst_us``, Linux 5.14+): over time it still gets ``cpus`` at most, as a real board's own CPU would
        give, but a moment of contention on the shared host no longer costs it CPU for good.
        Returns False if the kernel has no burst (the quota is set all the same).
        """
        if not cpus > 0:
            raise ValueError(f"a CPU quota must be positive, got {cpus}")
        directory = self.path("cpu")
        period_us = max(period_us, math.ceil(MIN_QUOTA_US / cpus))  # a quota of at least 1 ms: the kernel's floor
        quota = max(MIN_QUOTA_US, round(cpus * period_us))
        _write(directory / "cpu.shares", str(max(2, round(cpus * SHARES_PER_CPU))))
        burst = directory / "cpu.cfs_burst_us"
        if burst.exists():
            _write(burst, "0")  # a burst above a new, smaller quota would be refused
        _write(directory / "cpu.cfs_period_us", str(period_us))
        _write(directory / "cpu.cfs_quota_us", str(quota))
        if burst_periods <= 0:
            return True
        if not burst.exists():
            log.debug("cgroup %s: no cpu.cfs_burst_us on this kernel; no burst", self.relpath)
            return False
        _write(burst, str(min(quota, round(burst_periods * quota))))
        return True

    def set_cpu_shares(self, shares: int) -> None:
        """The group's weight against its siblings when CPUs are contended (not a cap)."""
        _write(self.path("cpu") / "cpu.shares", str(shares))

    def set_memory_limit(self, limit_bytes: int) -> None:
        """Cap RAM (and RAM + swap, where swap accounting exists, so the host's swap is not lent out)."""
        directory = self.path("memory")
        _write(directory / "memory.limit_in_bytes", str(limit_bytes))
        memsw = directory / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            try:
                _write(memsw, str(limit_bytes))
            except OSError as exc:  # swap accounting compiled in but off
                log.debug("cannot set %s: %s", memsw, exc)

    def add(self, pid: int) -> None:
        for directory in self._dirs():
            _write(directory / "cgroup.procs", str(pid))

    def procs_files(self) -> list[Path]:
        """The ``cgroup.procs`` files a starting process writes its own pid into."""
        return [directory / "cgroup.procs" for directory in self._dirs()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self._dirs():
            try:
                found.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return found

    def exists(self) -> bool:
        return any(directory.is_dir() for directory in self._dirs())

    # Counters -------------------------------------------------------------------------------

    def cpu_usage_ns(self) -> int:
        """Total CPU time of the group's tasks since it was made (cpuacct.usage), nanoseconds."""
        return _read_int(self.path("cpuacct") / "cpuacct.usage")

    def cpu_quota(self) -> float | None:
        """The quota in cores, or None when unlimited."""
        directory = self.path("cpu")
        quota = _read_int(directory / "cpu.cfs_quota_us")
        return None if quota < 0 else quota / _read_int(directory / "cpu.cfs_period_us")

    def throttled(self) -> tuple[int, int]:
        """(nr_throttled, throttled_time ns) from cpu.stat."""
        stats = dict(line.split() for line in (self.path("cpu") / "cpu.stat").read_text().splitlines() if line.strip())
        return int(stats.get("nr_throttled", 0)), int(stats.get("throttled_time", 0))

    def memory_limit(self) -> int:
        return _read_int(self.path("memory") / "memory.limit_in_bytes")

    def memory_failcnt(self) -> int:
        """How many times the group hit its memory limit (memory.failcnt)."""
        return _read_int(self.path("memory") / "memory.failcnt")

    def memory_max_usage(self) -> int:
        return _read_int(self.path("memory") / "memory.max_usage_in_bytes")

    def oom_kills(self) -> int | None:
        """How many tasks the kernel's OOM killer killed in this group (memory.oom_control's
        ``oom_kill``, Linux 4.13+), or None if the kernel does not count them."""
        try:
            text = (self.path("memory") / "memory.oom_control").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    # Teardown -------------------------------------------------------------------------------

    def kill_all(self, *, timeout_s: float = 5.0) -> list[int]:
        """SIGKILL every task left in the group (the lab started all of them); returns their pids."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.pids() - {os.getpid()}
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return sorted(set(killed))

    def remove(self, *, timeout_s: float = 5.0) -> None:
        """rmdir the group everywhere (killing leftovers first); a gone group is fine."""
        self.kill_all(timeout_s=timeout_s)
        for directory in self._dirs():
            _rmdir_tree(directory, timeout_s=timeout_s)


def _rmdir_tree(directory: Path, *, timeout_s: float) -> None:
    """rmdir a cgroup directory and its child groups, deepest first (cgroupfs has no rm -r)."""
    if not directory.is_dir():
        return
    for child in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _rmdir_retry(child, timeout_s=timeout_s)
    _rmdir_retry(directory, timeout_s=timeout_s)


def _rmdir_retry(directory: Path, *, timeout_s: float) -> None:
    # A killed task leaves its group a moment after SIGKILL; EBUSY until then.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def leftover_groups(mounts: dict[str, Path] | None = None) -> list[Path]:
    """Every lab group in any hierarchy: top-level directories named ``efl-*`` (normally ``efl-lab``)."""
    mounts = find_controller_mounts() if mounts is None else mounts
    found: dict[Path, None] = {}
    for mount in mounts.values():
        try:
            for entry in mount.iterdir():
                if entry.is_dir() and entry.name.startswith(PREFIX):
                    found.setdefault(entry, None)
        except OSError:
            continue
    return list(found)


def remove_leftover_groups(mounts: dict[str, Path] | None = None) -> list[str]:
    """Kill the tasks in every lab group and remove the groups; returns what was removed."""
    removed: list[str] = []
    for top in leftover_groups(mounts):
        groups = sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for group in groups:
            procs = group / "cgroup.procs"
            try:
                pids = {int(p) for p in procs.read_text().split()} - {os.getpid()}
            except OSError:
                pids = set()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    log.info("killed pid %d left in %s", pid, group)
                except ProcessLookupError:
                    pass
        for group in groups:
            try:
                _rmdir_retry(group, timeout_s=5.0)
                removed.append(str(group))
            except OSError as exc:
                log.warning("cannot remove cgroup %s: %s", group, exc)
    return removed


__all__ = [
    "CFS_PERIOD_US",
    "CGROUP_PARENT",
    "CONTROLLERS",
    "MIN_QUOTA_US",
    "Cgroup",
    "find_controller_mounts",
    "leftover_groups",
    "remove_leftover_groups",
]
