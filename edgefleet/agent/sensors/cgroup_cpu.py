"""CPU utilisation of the agent's own cgroup, relative to what that cgroup may use.

Why: ``CpuSource`` reads the whole machine (/proc/stat). On a board that is the same thing, but an
agent in a container, a systemd slice with ``CPUQuota=``, or an emulated board of the lab shares
the machine with others: host-wide load then says nothing about its own work, and the estimated
power model (``idle + (max - idle) * cpu / 100``) would charge this board for its neighbours.
Here 100 % means "using all the CPU this cgroup is allowed": its CFS quota when it has one
(cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2 ``cpu.max``), else every CPU the
process may run on.

Where the numbers come from:
  - cgroup v1: ``cpuacct.usage`` (ns, all CPUs) and ``cpuacct.usage_percpu`` (ns per CPU) of the
    group named on the ``cpuacct`` line of /proc/self/cgroup, under ``<root>/cpuacct`` or a
    shared mount such as ``<root>/cpu,cpuacct``; the quota from the ``cpu`` line's group.
  - cgroup v2 (used when no v1 cpuacct line exists): ``cpu.stat`` ``usage_usec`` and ``cpu.max``
    of the ``0::`` group, under ``<root>`` (unified) or ``<root>/unified`` (hybrid). v2 keeps no
    per-CPU usage, so ``cpu_percent_per_core`` is empty there.

``cpu_percent_per_core`` is the share of each host CPU this cgroup used (0-100 each), which
shows where a throttled board's work actually ran.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Location:
    version: int                 # 1 or 2
    usage_dir: Path              # cpuacct (v1) or the v2 group
    quota_dir: Path | None       # cpu controller's group (v1), the v2 group, or None if not found


@dataclass(frozen=True, slots=True)
class _Reading:
    wall_s: float
    usage_ns: int
    per_cpu_ns: tuple[int, ...]


def _parse_proc_cgroup(text: str) -> tuple[dict[str, str], str | None]:
    """``/proc/self/cgroup`` -> ({v1 controller: path}, v2 path or None)."""
    v1: dict[str, str] = {}
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
            continue
        for controller in controllers.split(","):
            v1[controller] = path
    return v1, v2


def _v1_dir(root: Path, controller: str, path: str) -> Path | None:
    """The directory of ``path`` in the v1 hierarchy that carries ``controller``."""
    candidates = [root / controller]
    try:
        candidates += sorted(p for p in root.iterdir() if controller in p.name.split(",") and p not in candidates)
    except OSError:
        pass
    for mount in candidates:
        directory = mount / path.lstrip("/")
        if directory.is_dir():
            return directory
    return None


class CgroupCpuSource:
    """Utilisation of this process's cgroup since the previous ``read()``.

    Args:
        cgroup_root: Where the cgroup hierarchies are mounted (``/sys/fs/cgroup``).
        proc_self_cgroup: The file naming this process's groups (``/proc/self/cgroup``).
        clock: Monotonic seconds (tests pass a fake).
        cpu_count: CPUs this process may use when the group has no quota (default: its affinity).
    """

    name = "cgroup-cpu"

    def __init__(self, *, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup"),
                 clock: Callable[[], float] = time.monotonic, cpu_count: int | None = None) -> None:
        self.cgroup_root = Path(cgroup_root)
        self.proc_self_cgroup = Path(proc_self_cgroup)
        self._clock = clock
        self._cpu_count = cpu_count
        self.last_percent: float | None = None
        self.location = self._locate()
        self._previous: _Reading | None = None
        if self.location is not None:
            try:
                self._previous = self._sample()  # the first read() measures from here
            except (OSError, ValueError) as exc:
                log.info("cgroup CPU counters unreadable (%s); the cgroup CPU source is not available", exc)
                self.location = None

    def _locate(self) -> _Location | None:
        try:
            v1, v2 = _parse_proc_cgroup(self.proc_self_cgroup.read_text())
        except OSError:
            return None
        if "cpuacct" in v1:
            usage_dir = _v1_dir(self.cgroup_root, "cpuacct", v1["cpuacct"])
            if usage_dir is not None and (usage_dir / "cpuacct.usage").exists():
                quota_dir = _v1_dir(self.cgroup_root, "cpu", v1["cpu"]) if "cpu" in v1 else None
                return _Location(1, usage_dir, quota_dir)
        if v2 is not None:
            for mount in (self.cgroup_root, self.cgroup_root / "unified"):
                directory = mount / v2.lstrip("/")
                if (directory / "cpu.stat").exists():
                    return _Location(2, directory, directory)
        return None

    def available(self) -> bool:
        """True if this process's cgroup and its CPU counters were found."""
        return self.location is not None

    def _sample(self) -> _Reading:
        assert self.location is not None
        wall = self._clock()
        if self.location.version == 1:
            usage = int((self.location.usage_dir / "cpuacct.usage").read_text().strip())
            percpu_file = self.location.usage_dir / "cpuacct.usage_percpu"
            per_cpu = tuple(int(v) for v in percpu_file.read_text().split()) if percpu_file.exists() else ()
            return _Reading(wall, usage, per_cpu)
        stats = dict(line.split(None, 1) for line in (self.location.usage_dir / "cpu.stat").read_text().splitlines() if " " in line)
        return _Reading(wall, int(stats["usage_usec"]) * 1000, ())

    def usage_s(self) -> float:
        """CPU seconds the group has used so far: all its processes, on every CPU.

        Raises:
            OSError, ValueError: no group was found, or its files vanished or are unreadable.
        """
        if self.location is None:
            raise OSError("no cgroup CPU counters for this process")
        return self._sample().usage_ns / 1e9

    def allowed_cores(self) -> float:
        """How many cores' worth of CPU the group may use: its quota, else the CPUs it may run on."""
        cpus = float(self._cpu_count or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
        quota = self._quota_cores()
        return min(quota, cpus) if quota is not None else cpus

    def _quota_cores(self) -> float | None:
        loc = self.location
        if loc is None or loc.quota_dir is None:
            return None
        try:
            if loc.version == 1:
                quota = int((loc.quota_dir / "cpu.cfs_quota_us").read_text().strip())
                period = int((loc.quota_dir / "cpu.cfs_period_us").read_text().strip())
                return quota / period if quota > 0 and period > 0 else None
            fields = (loc.quota_dir / "cpu.max").read_text().split()
            if not fields or fields[0] == "max":
                return None
            period = int(fields[1]) if len(fields) > 1 else 100_000
            return int(fields[0]) / period if period > 0 else None
        except (OSError, ValueError):
            return None

    def read(self) -> dict[str, Any]:
        """``cpu_percent`` (0-100 of what the group may use) and per-CPU shares since the last read.

        Raises:
            OSError, ValueError: the group's files vanished or are unreadable (the sampler logs it).
        """
        if self.location is None:
            raise OSError("no cgroup CPU counters for this process")
        now = self._sample()
        previous, self._previous = self._previous, now
        if previous is None or now.wall_s <= previous.wall_s:
            self.last_percent = None
            return {"cpu_percent": None, "cpu_percent_per_core": []}
        wall_ns = (now.wall_s - previous.wall_s) * 1e9
        used_cores = max(0, now.usage_ns - previous.usage_ns) / wall_ns
        total = round(min(100.0, 100.0 * used_cores / self.allowed_cores()), 1)
        per_core: list[float] = []
        if len(now.per_cpu_ns) == len(previous.per_cpu_ns):
            per_core = [round(min(100.0, 100.0 * max(0, a - b) / wall_ns), 1) for a, b in zip(now.per_cpu_ns, previous.per_cpu_ns)]
        self.last_percent = total
        return {"cpu_percent": total, "cpu_percent_per_core": per_core}

    def cpu_percent(self) -> float | None:
        """The utilisation measured by the last ``read()`` (for the estimated power model)."""
        return self.last_percent


__all__ = ["CgroupCpuSource"]
