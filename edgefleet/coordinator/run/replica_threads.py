"""How many torch threads the coordinator's replica validates with: the CPU this machine has free.

The replica validates the model at every epoch's end while the boards wait for the next result
(the run's serial part). torch starts one intra-op thread per CPU it sees; when others keep those
CPUs busy (boards on the same machine: the lab, a board that is also the coordinator, any other
work) its threads wait for each other at every operator's barrier. ``bench/replica_threads.py`` on
a 2-core host: resnet_small's validation of 359 digits with both cores kept busy took 623 ms at 2
threads and 279 ms at 1; with 1.44 cores busy (the lab's eight boards) 326 and 310 ms; on the quiet
host both picks are 2 threads (195 ms). A coordinator alone on its machine keeps all its threads.

So before each validation the replica takes as many threads as whole cores were free over the
epoch just trained: the machine's busy CPU time (``/proc/stat``) less this process's own, over
the time since the last look, against the cores this process may use (its cgroup quota or
affinity). ``train --threads N`` fixes the count instead.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import psutil

from edgefleet.agent.cpu_threads import fitting_threads, usable_cores

log = logging.getLogger(__name__)

# A core counts as free when at most this share of it was busy: a thread on a core others use a
# fifth of the time waits at barriers less than the one it adds gains.
FREE_CORE_SLACK = 0.2


@dataclass(frozen=True, slots=True)
class CpuReading:
    """The machine's busy CPU seconds and this process's own, at a moment."""

    at_s: float
    machine_busy_s: float
    own_s: float


def threads_for_free_cores(usable: float, others_busy: float) -> int:
    """Threads for the cores of ``usable`` that others (``others_busy`` cores' worth) left free: at least one."""
    free = usable - max(0.0, others_busy)
    return max(1, min(fitting_threads(usable), math.floor(free + FREE_CORE_SLACK)))


def read_cpu() -> CpuReading:
    """Now: the machine's busy CPU time (all CPUs, idle and I/O wait left out) and this process's (all threads)."""
    times = psutil.cpu_times()
    # Linux counts a guest's time in user and nice too (psutil's own cpu_percent leaves it out the same way).
    counted_twice = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0) - counted_twice
    own = psutil.Process().cpu_times()
    return CpuReading(time.monotonic(), busy, own.user + own.system)


class FreeCpuThreads:
    """The replica's validation threads, fitted to the CPU others left free since the last call.

    Args:
        usable: The cores' worth of CPU this process may use (default: its cgroup quota or affinity).
    """

    def __init__(self, usable: float | None = None) -> None:
        self.usable = usable_cores() if usable is None else usable
        self._last = read_cpu()

    def threads(self) -> int:
        """Threads for the next validation (all usable cores' threads if nothing could be read)."""
        try:
            now = read_cpu()
        except (OSError, psutil.Error) as exc:
            log.debug("could not read the machine's CPU time (%s): validating with every usable core", exc)
            return fitting_threads(self.usable)
        last, self._last = self._last, now
        elapsed = now.at_s - last.at_s
        if elapsed <= 0:
            return fitting_threads(self.usable)
        others = ((now.machine_busy_s - last.machine_busy_s) - (now.own_s - last.own_s)) / elapsed
        return threads_for_free_cores(self.usable, others)


__all__ = ["FREE_CORE_SLACK", "CpuReading", "FreeCpuThreads", "read_cpu", "threads_for_free_cores"]
