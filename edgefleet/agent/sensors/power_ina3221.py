"""Jetson board power from the on-module INA3221, read straight from sysfs (no jetson-stats).

Two kernel layouts exist:

* hwmon (L4T R34+ / JetPack 5-6, and mainline): ``class/hwmon/hwmonN/name`` is ``ina3221``;
  channel ``n`` in 1-3 has ``in{n}_label``, ``in{n}_input`` (bus mV) and ``curr{n}_input`` (mA).
  Channels labelled ``NC`` (not connected, AGX Orin) and channels 4-7 (shunt µV, sums) are skipped.
* iio (L4T R32 / JetPack 4): ``bus/i2c/drivers/ina3221x/*/iio:device*/`` with ``rail_name_{k}``
  and ``in_power{k}_input`` (mW), ``k`` in 0-2.

The total is the board-input rail (``VDD_IN`` on Orin/Xavier NX, ``POM_5V_IN`` on Nano/TX2) when
present, as jetson-stats does (``jtop/core/power.py: total_power``); otherwise the sum of the rails.
``power_rails_w`` lists every rail, the input rail included, so do not sum it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.agent.sensors.sysfs import read_int, read_str

log = logging.getLogger(__name__)

LABEL = "ina3221"
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")
_HWMON_CHANNELS = (1, 2, 3)
_IIO_CHANNELS = (0, 1, 2)



def hwmon_dirs(sysfs_root: Path) -> list[Path]:
    """The hwmon directories whose ``name`` is ``ina3221``, in a stable order."""
    found = []
    for d in sorted((sysfs_root / "class" / "hwmon").glob("hwmon*")):
        try:
            if read_str(d / "name") == "ina3221":
                found.append(d)
        except OSError:
            continue
    return found


def iio_dirs(sysfs_root: Path) -> list[Path]:
    """The L4T R32 ``ina3221x`` IIO device directories (``iio:device0``; ``iio_device`` on R28)."""
    base = sysfs_root / "bus" / "i2c" / "drivers" / "ina3221x"
    return sorted(d for d in base.glob("*/iio*device*") if (d / "rail_name_0").exists())


def read_hwmon_rails(directory: Path) -> dict[str, float]:
    """Watts per labelled channel of one hwmon ina3221; an unreadable channel is left out."""
    rails: dict[str, float] = {}
    for n in _HWMON_CHANNELS:
        try:
            label = read_str(directory / f"in{n}_label")
        except OSError:
            continue  # no label in the device tree: the channel is unused
        if not label or label.upper() == "NC":
            continue
        try:
            mv = read_int(directory / f"in{n}_input")
            ma = read_int(directory / f"curr{n}_input")
        except (OSError, ValueError) as exc:  # disabled channel reads -ENODATA
            log.debug("ina3221 %s channel %d (%s) unreadable: %s", directory, n, label, exc)
            continue
        rails[label] = mv * ma / 1e6
    return rails


def read_iio_rails(directory: Path) -> dict[str, float]:
    """Watts per rail of one L4T R32 ``ina3221x`` device (``in_power{k}_input`` is mW)."""
    rails: dict[str, float] = {}
    for k in _IIO_CHANNELS:
        try:
            label = read_str(directory / f"rail_name_{k}")
            mw = read_int(directory / f"in_power{k}_input")
        except (OSError, ValueError) as exc:
            log.debug("ina3221x %s rail %d unreadable: %s", directory, k, exc)
            continue
        if label:
            rails[label] = mw / 1e3
    return rails


def total_of(rails: dict[str, float]) -> float | None:
    """The input rail if there is one, else the sum of the rails; None without rails."""
    for name in TOTAL_RAILS:
        if name in rails:
            return rails[name]
    return sum(rails.values()) if rails else None


@dataclass
class Ina3221Power:
    """Jetson INA3221 rails from hwmon or the L4T R32 IIO driver.

    Attributes:
        sysfs_root: Normally ``/sys``; tests pass a recorded tree.
    """

    sysfs_root: Path = Path("/sys")
    name: str = field(default=LABEL, init=False)

    def looked_for(self) -> str:
        """Where this source looks, for error messages."""
        return (
            f'{self.sysfs_root}/class/hwmon/hwmon*/name == "ina3221" and '
            f"{self.sysfs_root}/bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_N"
        )

    def available(self) -> bool:
        """True if an INA3221 with at least one readable rail is present. Never raises."""
        try:
            return bool(self._rails())
        except Exception:
            log.debug("ina3221 probe failed", exc_info=True)
            return False

    def read(self) -> dict[str, Any]:
        """Board power in watts and each rail in watts."""
        rails = self._rails()
        total = total_of(rails)
        return {
            "power_w": None if total is None else round(total, 4),
            "power_source": LABEL,
            "power_rails_w": {k: round(v, 4) for k, v in rails.items()},
        }

    def _rails(self) -> dict[str, float]:
        rails: dict[str, float] = {}
        for d in hwmon_dirs(self.sysfs_root):
            rails.update(read_hwmon_rails(d))
        if not rails:
            for d in iio_dirs(self.sysfs_root):
                rails.update(read_iio_rails(d))
        return rails


__all__ = [
    "LABEL",
    "TOTAL_RAILS",
    "Ina3221Power",
    "hwmon_dirs",
    "iio_dirs",
    "read_hwmon_rails",
    "read_iio_rails",
    "total_of",
]
