"""Add-on INA219/220/226/230/231/260 power meters through the kernel ``ina2xx`` hwmon driver.

``class/hwmon/hwmonN/name`` is the chip (``ina219`` …). Units, from
``Documentation/hwmon/ina2xx.rst``: ``in0_input`` shunt mV, ``in1_input`` bus mV,
``curr1_input`` mA and ``power1_input`` **µW**. When ``power1_input`` is absent the power is
``in1_input`` x ``curr1_input``.

``hwmonN`` numbers change across boots, so each meter's rail is named after the chip and its
``device`` link (``ina219:1-0040``). Several meters are summed (each is assumed to sit on its own
supply); the label names the first chip: ``hwmon:ina219``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.agent.sensors.sysfs import read_int, read_str

log = logging.getLogger(__name__)

INA2XX_CHIPS = frozenset({"ina219", "ina220", "ina226", "ina230", "ina231", "ina260"})



@dataclass(frozen=True)
class Meter:
    """One ina2xx hwmon device.

    Attributes:
        chip: The hwmon ``name``, e.g. ``ina219``.
        path: Its ``class/hwmon/hwmonN`` directory.
    """

    chip: str
    path: Path

    @property
    def rail(self) -> str:
        """``chip:i2c-device`` (``ina219:1-0040``), or ``chip:hwmonN`` without a device link."""
        device = self.path / "device"
        if device.exists():
            return f"{self.chip}:{os.path.basename(os.path.realpath(device))}"
        return f"{self.chip}:{self.path.name}"

    def watts(self) -> float:
        """Power in watts. Raises OSError or ValueError if the meter can't be read."""
        power = self.path / "power1_input"
        if power.exists():
            return read_int(power) / 1e6  # µW
        return read_int(self.path / "in1_input") * read_int(self.path / "curr1_input") / 1e6


def find_meters(sysfs_root: Path) -> list[Meter]:
    """The ina2xx-family meters under ``sysfs_root/class/hwmon``, in a stable order."""
    meters = []
    for d in sorted((sysfs_root / "class" / "hwmon").glob("hwmon*")):
        try:
            chip = read_str(d / "name")
        except OSError:
            continue
        if chip in INA2XX_CHIPS:
            meters.append(Meter(chip, d))
    return meters


@dataclass
class HwmonPower:
    """Sum of the INA2xx add-on meters found in hwmon.

    Attributes:
        sysfs_root: Normally ``/sys``; tests pass a recorded tree.
    """

    sysfs_root: Path = Path("/sys")
    name: str = field(default="hwmon", init=False)

    def looked_for(self) -> str:
        """Where this source looks, for error messages."""
        chips = "/".join(sorted(INA2XX_CHIPS))
        return f"{self.sysfs_root}/class/hwmon/hwmon*/name in {chips} (kernel driver ina2xx)"

    def available(self) -> bool:
        """True if at least one meter reads. Never raises."""
        try:
            return bool(self._rails()[1])
        except Exception:
            log.debug("hwmon ina2xx probe failed", exc_info=True)
            return False

    def read(self) -> dict[str, Any]:
        """Summed power in watts, one rail per meter."""
        label, rails = self._rails()
        return {
            "power_w": round(sum(rails.values()), 4) if rails else None,
            "power_source": label,
            "power_rails_w": {k: round(v, 4) for k, v in rails.items()},
        }

    def _rails(self) -> tuple[str, dict[str, float]]:
        meters = find_meters(self.sysfs_root)
        label = f"hwmon:{meters[0].chip}" if meters else "hwmon"
        rails: dict[str, float] = {}
        for m in meters:
            try:
                rails[m.rail] = m.watts()
            except (OSError, ValueError) as exc:
                log.debug("%s at %s unreadable: %s", m.chip, m.path, exc)
        return label, rails


__all__ = ["INA2XX_CHIPS", "HwmonPower", "Meter", "find_meters"]
