"""Choose the board's power source from the ``power.source`` setting.

``auto`` tries the sensors from the most to the least specific and falls back to the CPU-load
estimate, so a board always reports something and says what it is:

    jtop -> ina3221 -> rpi5-pmic -> hwmon -> rapl -> estimated

A named source that is not there is a configuration error, not a silent fallback: the error says
what was looked for and how to fix it. ``none`` reports no power at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.agent.config import POWER_KINDS as KINDS
from edgefleet.agent.sensors.base import PowerSource, SensorPowerSource
from edgefleet.agent.sensors.power_estimated import EstimatedPower
from edgefleet.agent.sensors.power_hwmon import HwmonPower
from edgefleet.agent.sensors.power_ina3221 import Ina3221Power
from edgefleet.agent.sensors.power_jtop import JtopPower
from edgefleet.agent.sensors.power_rapl import RaplPower
from edgefleet.agent.sensors.power_rpi5_pmic import Rpi5PmicPower
from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

AUTO_ORDER = ("jtop", "ina3221", "rpi5-pmic", "hwmon", "rapl")
_FIX = 'set power.source = "auto" or "estimated" (or "none" to report no power)'


@dataclass
class NoPower:
    """The ``none`` source: reports no power, labelled ``none``."""

    name: str = field(default="none", init=False)

    def available(self) -> bool:
        """Always True."""
        return True

    def read(self) -> dict[str, Any]:
        """No reading."""
        return {"power_w": None, "power_source": "none", "power_rails_w": {}}


def _sensor(kind: str, sysfs_root: Path) -> SensorPowerSource:
    """A fresh, unprobed source of one sensor kind."""
    if kind == "jtop":
        return JtopPower()
    if kind == "ina3221":
        return Ina3221Power(sysfs_root)
    if kind == "rpi5-pmic":
        return Rpi5PmicPower()
    if kind == "hwmon":
        return HwmonPower(sysfs_root)
    if kind == "rapl":
        return RaplPower(sysfs_root)
    raise AssertionError(kind)


def select_power_source(
    kind: str,
    *,
    sysfs_root: Path,
    idle_w: float,
    max_w: float,
    cpu_percent: Callable[[], float | None],
) -> PowerSource:
    """Build the power source named by ``power.source``.

    Args:
        kind: One of ``KINDS``: ``auto``, ``jtop``, ``ina3221``, ``rpi5-pmic``, ``hwmon``,
            ``rapl``, ``estimated`` or ``none``.
        sysfs_root: Normally ``Path("/sys")``.
        idle_w: ``power.idle_w`` for the estimate, watts.
        max_w: ``power.max_w`` for the estimate, watts.
        cpu_percent: Whole-machine CPU load 0-100 (or None), for the estimate.

    Returns:
        An available source. ``auto`` never fails: it ends at ``estimated``.

    Raises:
        ConfigError: ``kind`` is unknown, a named sensor is not on this board, or the estimate's
            numbers are impossible.
    """
    kind = (kind or "").strip().lower()
    sysfs_root = Path(sysfs_root)
    if kind not in KINDS:
        raise ConfigError(
            f"power.source = {kind!r} is not a power source; use one of {', '.join(KINDS)}"
        )
    if kind == "none":
        return NoPower()
    if kind in AUTO_ORDER:
        source = _sensor(kind, sysfs_root)
        if source.available():
            log.info("power source: %s", kind)
            return source
        raise ConfigError(
            f'power.source = "{kind}" but it is not available on this board: looked for '
            f"{source.looked_for()}. Fix: {_FIX}."
        )
    if kind == "auto":
        for candidate in AUTO_ORDER:
            source = _sensor(candidate, sysfs_root)
            if source.available():
                log.info("power source (auto): %s", candidate)
                return source
            log.debug("power source %s not available: %s", candidate, source.looked_for())
        log.info("power source (auto): no sensor found, estimating from CPU load")
    try:
        return EstimatedPower(idle_w, max_w, cpu_percent)
    except ValueError as exc:
        raise ConfigError(
            f"power.idle_w = {idle_w!r} and power.max_w = {max_w!r} can't make an estimate "
            f"({exc}); "
            "set 0 <= power.idle_w <= power.max_w, e.g. power.idle_w = 3.0 and power.max_w = 7.0"
        ) from exc


__all__ = ["AUTO_ORDER", "KINDS", "NoPower", "select_power_source"]
