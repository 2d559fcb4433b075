"""Temperatures from the kernel's thermal zones (m°C), falling back to psutil's hwmon reading."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

# Jetson reports an offline zone as -256 °C; nothing real on a board is below -40 °C.
MIN_PLAUSIBLE_C = -40.0
MAX_PLAUSIBLE_C = 150.0


def parse_millidegrees(text: str) -> float | None:
    """``"48312\\n"`` -> 48.312; garbage or implausible values -> None."""
    try:
        value = int(text.strip()) / 1000.0
    except ValueError:
        return None
    return value if MIN_PLAUSIBLE_C <= value <= MAX_PLAUSIBLE_C else None


def read_thermal_zones(sysfs_root: Path) -> dict[str, float]:
    """``{zone type: °C}`` from ``class/thermal/thermal_zone*``; duplicate types get a suffix."""
    temps: dict[str, float] = {}
    for zone in sorted((sysfs_root / "class" / "thermal").glob("thermal_zone*")):
        try:
            kind = (zone / "type").read_text().strip() or zone.name
            value = parse_millidegrees((zone / "temp").read_text())
        except OSError:  # a zone whose sensor is powered down raises EIO/ENODATA
            continue
        if value is None:
            continue
        name, n = kind, 1
        while name in temps:
            n += 1
            name = f"{kind}{n}"
        temps[name] = value
    return temps


class ThermalSource:
    name = "thermal"

    def __init__(self, sysfs_root: Path) -> None:
        self.sysfs_root = sysfs_root

    def available(self) -> bool:
        return bool(read_thermal_zones(self.sysfs_root)) or bool(self._psutil_temps())

    def _psutil_temps(self) -> dict[str, float]:
        if self.sysfs_root != Path("/sys"):
            return {}  # a test tree: psutil would read the real machine
        try:
            sensors = psutil.sensors_temperatures()
        except (OSError, AttributeError):
            return {}
        return {
            f"{chip}:{entry.label or i}": float(entry.current)
            for chip, entries in sensors.items()
            for i, entry in enumerate(entries)
            if MIN_PLAUSIBLE_C <= entry.current <= MAX_PLAUSIBLE_C
        }

    def read(self) -> dict[str, Any]:
        temps = read_thermal_zones(self.sysfs_root) or self._psutil_temps()
        return {"temp_c": max(temps.values()) if temps else None, "temps_c": temps}
