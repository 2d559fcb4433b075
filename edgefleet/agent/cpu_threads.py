"""How many torch threads fit the CPU a board may really use.

torch starts one intra-op thread per CPU it sees, not per CPU it may use: under a cgroup quota
(a container with ``--cpus``, systemd ``CPUQuota=``, the lab's boards) the extra threads spin
against each other's throttling, and a board with a fraction of a core computed 1.4-3.5x slower
than with one thread (issue 22's measurements). The CPU a board may use is its cgroup's CFS quota
(v1 or v2), else the CPUs it may run on (its affinity): ``agent.sensors.cgroup_cpu`` reads both.
No torch here: the idle agent reports the figure in its caps.
"""

from __future__ import annotations

import logging
import math

from edgefleet.agent.sensors.cgroup_cpu import CgroupCpuSource

log = logging.getLogger(__name__)


def fitting_threads(cores: float) -> int:
    """Threads for ``cores`` cores' worth of CPU: at least one, one per started core (0.2 -> 1, 1.5 -> 2)."""
    return max(1, math.ceil(round(cores, 3)))


def usable_cores() -> float:
    """The cores' worth of CPU this process may use: its cgroup's quota, else the CPUs it may run on."""
    return CgroupCpuSource().allowed_cores()


def board_threads() -> int:
    """The torch intra-op threads a job on this board should use when the user gives none."""
    return fitting_threads(usable_cores())


__all__ = ["board_threads", "fitting_threads", "usable_cores"]
