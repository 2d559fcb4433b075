"""Reads every available source into one ``TelemetrySample``.

A source that fails is logged once (then at DEBUG) and its fields are left out of the sample;
one broken sensor never stops the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgefleet.agent.sensors.base import PowerSource, TelemetrySource
from edgefleet.agent.sensors.cgroup_cpu import CgroupCpuSource
from edgefleet.agent.sensors.cpu import CpuSource
from edgefleet.agent.sensors.disk import DiskSource
from edgefleet.agent.sensors.gpu_jetson import JetsonGpuSource
from edgefleet.agent.sensors.memory import MemorySource
from edgefleet.agent.sensors.network import NetworkSource
from edgefleet.agent.sensors.power import select_power_source
from edgefleet.agent.sensors.power_jtop import JtopPower
from edgefleet.agent.sensors.thermal import ThermalSource
from edgefleet.agent.sensors.throttling import ThrottlingSource
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import TelemetrySample

log = logging.getLogger(__name__)


class Sampler:
    """All telemetry sources of one board.

    ``disk_folders`` names the folders whose file systems are reported (``{"data": state_dir, "run":
    working directory}``). The GPU and throttling sources find themselves (a Jetson's iGPU, a Pi's
    ``vcgencmd``) and are left out elsewhere.
    """

    def __init__(self, *, board_id: str, interval_s: float, sysfs_root: Path, net_interfaces: tuple[str, ...],
                 power_kind: str, idle_w: float, max_w: float, cpu_scope: str = "system",
                 disk_folders: Mapping[str, Path] | None = None) -> None:
        self.board_id = board_id
        self.interval_s = interval_s
        self.cpu: CpuSource | CgroupCpuSource
        if cpu_scope == "cgroup":
            self.cpu = CgroupCpuSource()
            if not self.cpu.available():
                raise ConfigError('telemetry.cpu_scope = "cgroup" but this process has no readable cgroup CPU counters '
                                  '(/proc/self/cgroup, /sys/fs/cgroup); set cpu_scope = "system"')
        else:
            self.cpu = CpuSource()
        self.power: PowerSource = select_power_source(
            power_kind, sysfs_root=sysfs_root, idle_w=idle_w, max_w=max_w, cpu_percent=self.cpu.cpu_percent)
        jtop = self.power.running_client if isinstance(self.power, JtopPower) else None
        candidates: list[TelemetrySource] = [
            self.cpu, MemorySource(), NetworkSource(net_interfaces), ThermalSource(sysfs_root), self.power,
            JetsonGpuSource(sysfs_root, jtop_client=jtop), ThrottlingSource(), DiskSource(disk_folders or {})]
        # CPU comes first: the estimated power model reads the utilisation it just measured.
        self.sources = [s for s in candidates if s.available()]
        self._failed: set[str] = set()
        self._seq = 0
        log.info("telemetry sources: %s; power from %s", ", ".join(s.name for s in self.sources), self.power.name)

    def read(self) -> TelemetrySample:
        fields: dict[str, Any] = {}
        for source in self.sources:
            try:
                fields.update(source.read())
            except (OSError, ValueError, RuntimeError) as exc:
                level = logging.DEBUG if source.name in self._failed else logging.WARNING
                log.log(level, "telemetry source %s failed: %s (its fields are left out)", source.name, exc)
                self._failed.add(source.name)
        self._seq += 1
        return TelemetrySample(board_id=self.board_id, ts=round(time.time(), 3), seq=self._seq,
                               interval_s=self.interval_s, **fields)

    def close(self) -> None:
        """Release what a source holds open (jtop keeps a client connected to its service)."""
        close = getattr(self.power, "close", None)
        if callable(close):
            close()
