"""The lab's CPU quotas are enforced in 10 ms CFS periods (a board with a fraction of a core runs like a slower
CPU, not in 100 ms bursts and stalls), and a quota below the kernel's 1 ms floor gets a longer period instead
of more CPU. Checked on a real cgroup (root and cgroup v1 cpu controller needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from edgefleet.lab.cgroups import CFS_PERIOD_US, Cgroup, find_controller_mounts


@pytest.fixture()
def group() -> Iterator[Cgroup]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup")
    mounts = find_controller_mounts()
    if "cpu" not in mounts:
        pytest.skip("no cgroup v1 cpu controller")
    cgroup = Cgroup(f"efl-test-period-{os.getpid()}", mounts)
    cgroup.create()
    try:
        yield cgroup
    finally:
        cgroup.remove()


def _read(cgroup: Cgroup, name: str) -> int:
    return int((cgroup.path("cpu") / name).read_text())


@pytest.mark.parametrize("cpus, period_us, quota_us", [(0.45, 10_000, 4_500), (0.1, 10_000, 1_000), (0.05, 20_000, 1_000),
                                                       (0.03, 33_334, 1_000)])
def test_a_quota_is_set_in_10_ms_periods_or_a_longer_one_below_a_tenth_of_a_core(
        group: Cgroup, cpus: float, period_us: int, quota_us: int) -> None:
    assert CFS_PERIOD_US == 10_000
    group.set_cpu_quota(cpus)
    assert (_read(group, "cpu.cfs_period_us"), _read(group, "cpu.cfs_quota_us")) == (period_us, quota_us)
    assert group.cpu_quota() == pytest.approx(cpus, rel=0.01)  # the board gets what the fleet file says, no more


@pytest.mark.parametrize("cpus, period_us", [(0.36, 2_778), (0.27, 3_704), (0.09, 11_112)])
def test_the_shortest_period_gives_each_board_a_1_ms_quota(group: Cgroup, cpus: float, period_us: int) -> None:
    """A fleet file's ``cpu_period_ms = 1``: a board runs at most 1 ms at the host's speed before its quota stops it."""
    group.set_cpu_quota(cpus, period_us=1_000)
    assert (_read(group, "cpu.cfs_period_us"), _read(group, "cpu.cfs_quota_us")) == (period_us, 1_000)
    assert group.cpu_quota() == pytest.approx(cpus, rel=0.01)
