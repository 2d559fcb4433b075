"""What a board offers the profile job: its memory, the CPU it may use, and its power draw.

Memory is the process's peak resident memory (VmHWM, which ``reset_peak_rss`` resets so that a kept
worker's earlier jobs do not count) and what the worker may use: physical RAM, or the tightest
cgroup memory limit (v1 or v2) if lower. Power is averaged over a window by :class:`PowerMeter`:
the board's sensor sampled in a thread, or, with no sensor, ``idle_w + (max_w - idle_w) x`` the
share of the CPU this board may use (its cgroup quota, else its cores) that the agent's cgroup
filled (every process of the agent, the kernel's work on their behalf included: what the board's
telemetry estimates its power from), else this process's CPU time.

Kept apart from ``agent.profile_worker`` because none of it needs torch or Lightning.
"""

from __future__ import annotations

import logging
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from edgefleet.agent.sensors.cgroup_cpu import CgroupCpuSource
from edgefleet.agent.sensors.power import select_power_source
from edgefleet.protocol.errors import ConfigError

if TYPE_CHECKING:
    from edgefleet.agent.job_runner import WorkerContext

log = logging.getLogger(__name__)

IDLE_SAMPLE_S = 1.0       # a power sensor is read this long before the first batch size for the idle figure
SENSOR_PERIOD_S = 0.1     # how often a power sensor is read during the timed steps


# --------------------------------------------------------------------------------------- memory

def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current RSS; False if Linux refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def cgroup_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup"),
                        proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v1 or v2), or None."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[tuple[Path, str, str]] = []  # (mount, group path, limit file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            mounts = [cgroup_root / "memory"]
            try:
                mounts += sorted(p for p in cgroup_root.iterdir() if "memory" in p.name.split(",") and p not in mounts)
            except OSError:
                pass
            candidates += [(m, parts[2], "memory.limit_in_bytes") for m in mounts]
        elif parts[1] == "":
            candidates += [(m, parts[2], "memory.max") for m in (cgroup_root, cgroup_root / "unified")]
    for mount, group, limit_file in candidates:
        if not (mount / limit_file).exists() and not (mount / group.lstrip("/") / limit_file).exists():
            continue
        directory = mount / group.lstrip("/")
        if not directory.is_dir():  # a cgroup namespace: our group is the mount's root
            directory = mount
        limits = []
        while True:
            try:
                text = (directory / limit_file).read_text().strip()
                if text != "max":
                    limits.append(int(text))
            except (OSError, ValueError):
                pass
            if directory == mount:
                break
            directory = directory.parent
        return min(limits) if limits else None
    return None


def memory_total_bytes() -> int:
    """What the worker may use: physical RAM, or its cgroup's memory limit if lower."""
    total = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit()
    return min(total, limit) if limit else total


# ---------------------------------------------------------------------------------------- power

def allowed_cores() -> float:
    """The CPU this board may use: its cgroup's quota if it has one, else the cores it may run on."""
    cgroup = CgroupCpuSource()
    if cgroup.available():
        return cgroup.allowed_cores()
    return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _board_cpu_clock() -> Callable[[], float]:
    """The agent's cgroup's CPU seconds if its counters can be read, else this process's CPU time."""
    group = CgroupCpuSource()
    if group.available():
        try:
            group.usage_s()
            return group.usage_s
        except (OSError, ValueError) as exc:
            log.info("cgroup CPU counters unreadable (%s); estimating power from the worker's CPU time", exc)
    return time.process_time


class PowerMeter:
    """Average power over a window, from the agent's power source.

    A sensor is read every ``SENSOR_PERIOD_S`` in a thread. Without one (``estimated``, ``none``,
    or ``auto`` finding nothing) the estimate is ``idle_w + (max_w - idle_w) x u`` where ``u`` is
    the CPU time over the window divided by the window and ``allowed_cores()``. The CPU time is
    the agent's cgroup's, as the board's telemetry reads it (``CgroupCpuSource``), where there is
    one: moving a gradient costs CPU in the kernel's network stack too, which this process's own
    clock did not see (on the lab, 0.6 ms per MB where the board's cgroup counted 0.8-1.1 ms).
    ``cpu_seconds`` replaces that clock (tests).
    """

    def __init__(self, context: WorkerContext, *, cpu_seconds: Callable[[], float] | None = None) -> None:
        self.idle_model_w, self.max_model_w = context.idle_w, context.max_w
        self.cores = allowed_cores()
        self._cpu_seconds = cpu_seconds or _board_cpu_clock()
        self.sensor: Any = None
        self.label = "estimated"
        if context.power_source not in ("estimated", "none"):
            try:
                source = select_power_source(context.power_source, sysfs_root=Path(context.sysfs_root),
                                             idle_w=context.idle_w, max_w=context.max_w, cpu_percent=lambda: None)
            except ConfigError as exc:
                log.warning("power sensor unavailable in the worker (%s); estimating", exc)
                source = None
            if source is not None and source.name not in ("estimated", "none"):
                self.sensor = source
        self._failed = False  # the sensor gave nothing once: every figure of this job is estimated
        self._readings: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._cpu0 = 0.0

    def _read_sensor(self) -> float | None:
        try:
            reading = self.sensor.read()
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("power sensor read failed: %s", exc)
            return None
        watts = reading.get("power_w")
        if watts is None:
            return None
        self.label = str(reading.get("power_source") or self.sensor.name)
        return float(watts)

    def _sample(self) -> None:
        while not self._stop.wait(SENSOR_PERIOD_S):
            watts = self._read_sensor()
            if watts is not None:
                self._readings.append(watts)

    def start(self) -> None:
        self._t0, self._cpu0 = time.perf_counter(), self._cpu_seconds()
        if self.sensor is not None and not self._failed:
            self._readings = []
            self._read_sensor()  # primes sensors that report the average since their last read (RAPL)
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="power-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> float:
        """Watts over the window since ``start()``."""
        wall, cpu = time.perf_counter() - self._t0, self._cpu_seconds() - self._cpu0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            last = self._read_sensor()
            readings = self._readings + ([last] if last is not None else [])
            if readings:
                return statistics.fmean(readings)
            log.warning("the power sensor gave no reading during the timed steps; estimating from CPU time")
            self._failed = True
        self.label = "estimated"
        utilisation = min(1.0, cpu / (wall * self.cores)) if wall > 0 else 0.0
        return self.idle_model_w + (self.max_model_w - self.idle_model_w) * utilisation

    def idle_w(self) -> float:
        """Idle draw: the sensor read for ``IDLE_SAMPLE_S`` while the worker waits, else ``idle_w``."""
        if self.sensor is None or self._failed:
            return self.idle_model_w
        self._read_sensor()
        readings = []
        deadline = time.monotonic() + IDLE_SAMPLE_S
        while time.monotonic() < deadline:
            time.sleep(SENSOR_PERIOD_S)
            watts = self._read_sensor()
            if watts is not None:
                readings.append(watts)
        return statistics.fmean(readings) if readings else self.idle_model_w

    def close(self) -> None:
        close = getattr(self.sensor, "close", None)
        if callable(close):
            close()


__all__ = ["PowerMeter", "allowed_cores", "cgroup_memory_limit", "memory_total_bytes", "peak_rss_bytes",
           "reset_peak_rss"]
