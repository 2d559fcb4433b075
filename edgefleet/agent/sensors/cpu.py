"""CPU: total and per-core utilisation, frequency and load average (psutil)."""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil

log = logging.getLogger(__name__)


class CpuSource:
    """Utilisation since the previous ``read()``; psutil's module-wide state is used by this source only."""

    name = "cpu"

    def __init__(self) -> None:
        self.last_percent: float | None = None
        # psutil compares with the previous call: the first call returns a meaningless 0.0.
        psutil.cpu_percent(percpu=True)

    def available(self) -> bool:
        return True

    def read(self) -> dict[str, Any]:
        per_core = psutil.cpu_percent(percpu=True)
        total = round(sum(per_core) / len(per_core), 1) if per_core else None
        self.last_percent = total
        out: dict[str, Any] = {"cpu_percent": total, "cpu_percent_per_core": [float(p) for p in per_core]}
        try:
            freq = psutil.cpu_freq()
        except (OSError, NotImplementedError):  # absent on some VMs and containers
            freq = None
        out["cpu_freq_mhz"] = float(freq.current) if freq and freq.current else None
        load1, load5, load15 = os.getloadavg()
        out.update(load_avg_1m=round(load1, 2), load_avg_5m=round(load5, 2), load_avg_15m=round(load15, 2))
        return out

    def cpu_percent(self) -> float | None:
        """The utilisation measured by the last ``read()`` (for the estimated power model)."""
        return self.last_percent
