"""x86 CPU package power from Intel RAPL through the powercap sysfs interface.

``class/powercap/intel-rapl:N/energy_uj`` is a µJ counter that wraps at ``max_energy_range_uj``;
power is the energy delta over the time delta (``d += max_range if d < 0``). Only the top-level
``package-N`` zones are read: sub-zones (``intel-rapl:0:0`` core, uncore, dram) are inside the
package, and ``psys`` covers the whole platform, so adding either would count power twice.

``energy_uj`` is readable by root only since Linux 5.10 (CVE-2020-8694); ``available()`` is False
on PermissionError. The first ``read()`` has no delta and returns ``power_w`` None.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LABEL = "rapl"
_TOP_ZONE = re.compile(r"^intel-rapl:\d+$")


def _read_text(path: Path) -> str:
    """One sysfs attribute, stripped. Tests patch this to simulate EACCES."""
    return path.read_text(encoding="ascii", errors="replace").strip()


@dataclass(frozen=True)
class Zone:
    """One top-level RAPL package zone.

    Attributes:
        name: The zone's ``name`` (``package-0``), or its directory name if it has none.
        path: The ``class/powercap/intel-rapl:N`` directory.
        max_range_uj: Where ``energy_uj`` wraps; None if unreadable (a wrap then gives no reading).
    """

    name: str
    path: Path
    max_range_uj: int | None

    def energy_uj(self) -> int:
        """The counter now.

        Raises:
            PermissionError: Not root on Linux >= 5.10.
            OSError, ValueError: The zone vanished or reads garbage.
        """
        return int(_read_text(self.path / "energy_uj"))


def find_zones(sysfs_root: Path) -> list[Zone]:
    """The package zones under ``sysfs_root/class/powercap``, in a stable order."""
    zones = []
    for d in sorted((sysfs_root / "class" / "powercap").glob("intel-rapl:*")):
        if not _TOP_ZONE.match(d.name):
            continue
        try:
            name = _read_text(d / "name")
        except OSError:
            name = d.name
        if not name.startswith("package") and name != d.name:
            continue  # psys, or a vendor-specific zone
        try:
            max_range: int | None = int(_read_text(d / "max_energy_range_uj"))
        except (OSError, ValueError):
            max_range = None
        zones.append(Zone(name, d, max_range))
    return zones


def energy_delta_uj(before: int, after: int, max_range_uj: int | None) -> int | None:
    """``after - before`` across at most one wrap; None if it wrapped and the range is unknown."""
    d = after - before
    if d < 0:
        if not max_range_uj:
            return None
        d += max_range_uj
    return d


@dataclass
class RaplPower:
    """Package power from RAPL energy counters.

    Attributes:
        sysfs_root: Normally ``/sys``; tests pass a recorded tree.
        clock: Monotonic seconds; injectable so tests need no sleeps.
    """

    sysfs_root: Path = Path("/sys")
    clock: Callable[[], float] = time.monotonic
    name: str = field(default=LABEL, init=False)
    reason: str = field(default="", init=False)
    _last: tuple[float, dict[str, int]] | None = field(default=None, init=False, repr=False)

    def looked_for(self) -> str:
        """Where this source looks, for error messages."""
        where = (
            f"{self.sysfs_root}/class/powercap/intel-rapl:N/energy_uj "
            "(root-only since Linux 5.10)"
        )
        return f"{where}: {self.reason}" if self.reason else where

    def available(self) -> bool:
        """True if a package zone exists and its counter is readable. Never raises."""
        try:
            zones = find_zones(self.sysfs_root)
            if not zones:
                self.reason = "no intel-rapl package zone"
                return False
            for z in zones:
                z.energy_uj()
            return True
        except PermissionError as exc:
            self.reason = f"permission denied ({exc.filename or 'energy_uj'}); run as root"
        except Exception as exc:
            self.reason = f"unreadable: {exc}"
        log.debug("rapl unavailable: %s", self.reason)
        return False

    def read(self) -> dict[str, Any]:
        """Average package power since the previous call; None on the first call."""
        now = self.clock()
        zones = find_zones(self.sysfs_root)
        energy = {z.name: z.energy_uj() for z in zones}
        last, self._last = self._last, (now, energy)
        rails: dict[str, float] = {}
        if last is not None and now > last[0]:
            dt = now - last[0]
            for z in zones:
                if z.name not in last[1]:
                    continue
                d = energy_delta_uj(last[1][z.name], energy[z.name], z.max_range_uj)
                if d is not None:
                    rails[z.name] = d / 1e6 / dt
        return {
            "power_w": round(sum(rails.values()), 4) if rails else None,
            "power_source": LABEL,
            "power_rails_w": {k: round(v, 4) for k, v in rails.items()},
        }


__all__ = ["LABEL", "RaplPower", "Zone", "energy_delta_uj", "find_zones"]
