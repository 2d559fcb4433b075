"""The agent's cgroup CPU source, against fake cgroup trees (v1 split, v1 shared mount, v2)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgefleet.agent.sensors.cgroup_cpu import CgroupCpuSource
from edgefleet.agent.sensors.power_estimated import EstimatedPower


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1_tree(tmp_path: Path, *, shared_mount: bool = False, quota_us: int = 20_000, group: str = "efl-lab/efl-pi4-1") -> tuple[Path, Path]:
    """A cgroup v1 tree with the process in ``group``; returns (cgroup_root, proc_self_cgroup)."""
    root = tmp_path / "cgroup"
    cpu = root / ("cpu,cpuacct" if shared_mount else "cpu") / group
    acct = root / ("cpu,cpuacct" if shared_mount else "cpuacct") / group
    _write(cpu / "cpu.cfs_quota_us", f"{quota_us}\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    _write(acct / "cpuacct.usage", "5000000000\n")
    _write(acct / "cpuacct.usage_percpu", "3000000000 2000000000 \n")
    controllers = ["2:cpu,cpuacct:/" + group] if shared_mount else ["3:cpuacct:/" + group, "2:cpu:/" + group]
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "\n".join(["9:name=systemd:/", "4:memory:/" + group, *controllers, "0::/"]) + "\n")
    return root, proc


def _advance(root: Path, group: str, *, usage_ns: int, per_cpu: tuple[int, int], shared_mount: bool = False) -> None:
    acct = root / ("cpu,cpuacct" if shared_mount else "cpuacct") / group
    _write(acct / "cpuacct.usage", f"{usage_ns}\n")
    _write(acct / "cpuacct.usage_percpu", f"{per_cpu[0]} {per_cpu[1]} \n")


@pytest.mark.parametrize("shared_mount", [False, True])
def test_v1_percent_is_relative_to_the_quota(tmp_path: Path, shared_mount: bool) -> None:
    # Prepare: a 0.2-CPU group that used 0.1 s of CPU during 1 s of wall time.
    root, proc = _v1_tree(tmp_path, shared_mount=shared_mount)
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    assert source.available() and source.name == "cgroup-cpu"
    assert source.allowed_cores() == pytest.approx(0.2)
    clock.now += 1.0
    _advance(root, "efl-lab/efl-pi4-1", usage_ns=5_100_000_000, per_cpu=(3_060_000_000, 2_040_000_000), shared_mount=shared_mount)

    # Execute
    out = source.read()

    # Assert: half of its quota; each host CPU's share of the group's work.
    assert out == {"cpu_percent": 50.0, "cpu_percent_per_core": [6.0, 4.0]}
    assert source.cpu_percent() == 50.0


def test_v1_without_quota_is_relative_to_the_cpus_it_may_use(tmp_path: Path) -> None:
    root, proc = _v1_tree(tmp_path, quota_us=-1)
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    clock.now += 2.0
    _advance(root, "efl-lab/efl-pi4-1", usage_ns=6_000_000_000, per_cpu=(3_500_000_000, 2_500_000_000))
    assert source.read()["cpu_percent"] == 25.0  # 1 s of CPU in 2 s on 2 CPUs


def test_quota_changes_are_picked_up_and_bursts_are_clamped(tmp_path: Path) -> None:
    root, proc = _v1_tree(tmp_path)
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    clock.now += 1.0
    _advance(root, "efl-lab/efl-pi4-1", usage_ns=5_250_000_000, per_cpu=(3_250_000_000, 2_000_000_000))
    assert source.read()["cpu_percent"] == 100.0  # 0.25 s in a 0.2 quota: a period boundary, not 125 %
    _write(root / "cpu" / "efl-lab/efl-pi4-1" / "cpu.cfs_quota_us", "50000\n")
    clock.now += 1.0
    _advance(root, "efl-lab/efl-pi4-1", usage_ns=5_500_000_000, per_cpu=(3_500_000_000, 2_000_000_000))
    assert source.read()["cpu_percent"] == 50.0


def test_estimated_power_follows_the_cgroup_not_the_host(tmp_path: Path) -> None:
    root, proc = _v1_tree(tmp_path)
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    power = EstimatedPower(2.7, 6.4, source.cpu_percent)
    clock.now += 1.0
    _advance(root, "efl-lab/efl-pi4-1", usage_ns=5_100_000_000, per_cpu=(3_100_000_000, 2_000_000_000))
    source.read()
    reading = power.read()
    assert reading["power_source"] == "estimated"
    assert reading["power_w"] == pytest.approx(2.7 + 3.7 * 0.5)


@pytest.mark.parametrize("cpu_max, expected", [("50000 100000\n", 40.0), ("max 100000\n", 10.0)])
def test_v2_unified(tmp_path: Path, cpu_max: str, expected: float) -> None:
    root = tmp_path / "cgroup"
    group = root / "system.slice" / "edge-agent.service"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(group / "cpu.stat", "usage_usec 1000000\nuser_usec 800000\nsystem_usec 200000\n")
    _write(group / "cpu.max", cpu_max)
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "0::/system.slice/edge-agent.service\n")
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    assert source.available()
    clock.now += 1.0
    _write(group / "cpu.stat", "usage_usec 1200000\nuser_usec 900000\nsystem_usec 300000\n")
    out = source.read()
    # 0.2 s of CPU in 1 s: 40 % of a 0.5-CPU quota, or 10 % of 2 CPUs without one.
    assert out == {"cpu_percent": expected, "cpu_percent_per_core": []}


def test_v2_in_a_hybrid_layout(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    group = root / "unified" / "lab"
    _write(group / "cpu.stat", "usage_usec 0\n")
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "0::/lab\n")
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=FakeClock(), cpu_count=1)
    assert source.available() and source.allowed_cores() == 1.0


def test_not_available_without_a_cgroup(tmp_path: Path) -> None:
    missing = CgroupCpuSource(cgroup_root=tmp_path / "none", proc_self_cgroup=tmp_path / "nope")
    assert not missing.available()
    with pytest.raises(OSError):
        missing.read()
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "3:cpuacct:/gone\n")
    assert not CgroupCpuSource(cgroup_root=tmp_path / "cgroup", proc_self_cgroup=proc).available()


def test_a_group_that_vanishes_raises_for_the_sampler(tmp_path: Path) -> None:
    root, proc = _v1_tree(tmp_path)
    clock = FakeClock()
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=clock, cpu_count=2)
    (root / "cpuacct" / "efl-lab/efl-pi4-1" / "cpuacct.usage").unlink()
    clock.now += 1.0
    with pytest.raises(OSError):
        source.read()


def test_first_read_without_elapsed_time_is_unknown(tmp_path: Path) -> None:
    root, proc = _v1_tree(tmp_path)
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, clock=FakeClock(), cpu_count=2)
    assert source.read() == {"cpu_percent": None, "cpu_percent_per_core": []}
    assert source.cpu_percent() is None


def test_this_machine() -> None:
    """On the real /sys/fs/cgroup (when this process has a cgroup): a plausible 0-100 figure."""
    source = CgroupCpuSource()
    if not source.available():
        pytest.skip("this process has no readable cgroup CPU counters here")
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        pass  # a little work of our own to measure
    out = source.read()
    assert out["cpu_percent"] is not None and 0.0 < out["cpu_percent"] <= 100.0


@pytest.mark.parametrize(("quota_us", "threads"), [(20_000, 1), (100_000, 1), (150_000, 2), (-1, 4)])
def test_torch_threads_fit_the_quota_not_the_host(tmp_path: Path, quota_us: int, threads: int) -> None:
    """0.2 and 1.0 core -> 1 thread, 1.5 -> 2, no quota -> the 4 CPUs the process may use."""
    from edgefleet.agent.cpu_threads import fitting_threads

    root, proc = _v1_tree(tmp_path, quota_us=quota_us)
    source = CgroupCpuSource(cgroup_root=root, proc_self_cgroup=proc, cpu_count=4)
    assert fitting_threads(source.allowed_cores()) == threads
