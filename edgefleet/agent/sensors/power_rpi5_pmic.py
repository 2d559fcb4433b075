"""Raspberry Pi 5 rail power from the PMIC ADC (``vcgencmd pmic_read_adc``).

Each rail prints a current line and a voltage line with different indices
(``VDD_CORE_A current(7)=…A`` / ``VDD_CORE_V volt(15)=…V``), so they are paired by name.
``EXT5V_V`` and ``BATT_V`` have no current line. The sum of V·A over the rails is PMIC rail power,
**not** wall power: USB/5 V loads and conversion losses are missing.

``vcgencmd`` forks and talks to the firmware through ``/dev/vcio`` (group ``video``); sample at
1-2 Hz at most. Older Pis answer ``error=1 error_msg="Command not registered"``, which parses to
no rails, so the source is unavailable there.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LABEL = "rpi5-pmic"
TIMEOUT_S = 2.0
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_PMIC = re.compile(rf"^\s*(\S+)_([AV])\s+(?:current|volt)\(\d+\)=({_NUMBER})[AV]\s*$")
_THROTTLED = re.compile(r"^\s*throttled=0x([0-9a-fA-F]+)\s*$")
_THROTTLE_BITS = ("under-voltage", "arm frequency capped", "throttled", "soft temperature limit")


def parse_pmic(text: str) -> tuple[float | None, dict[str, float], float | None]:
    """Parse ``vcgencmd pmic_read_adc`` output.

    Args:
        text: The command's stdout.

    Returns:
        ``(total_w, rails_w, ext5v_v)``: the sum of V·A over rails that have both lines (None if
        none do), watts per rail, and the 5 V input voltage if printed. Garbage gives
        ``(None, {}, None)``.
    """
    amps: dict[str, float] = {}
    volts: dict[str, float] = {}
    for line in (text or "").splitlines():
        m = _PMIC.match(line)
        if m:
            with contextlib.suppress(ValueError):
                (amps if m[2] == "A" else volts)[m[1]] = float(m[3])
    rails = {n: amps[n] * volts[n] for n in amps if n in volts}
    return (sum(rails.values()) if rails else None), rails, volts.get("EXT5V")


@dataclass(frozen=True)
class Throttled:
    """Decoded ``vcgencmd get_throttled``: bits 0-3 are now, bits 16-19 the same since boot.

    Attributes:
        raw: The bit field.
    """

    raw: int

    @property
    def now(self) -> tuple[str, ...]:
        """Conditions active now (alert on these)."""
        return tuple(n for i, n in enumerate(_THROTTLE_BITS) if self.raw >> i & 1)

    @property
    def since_boot(self) -> tuple[str, ...]:
        """Conditions that happened since boot (report as state)."""
        return tuple(n for i, n in enumerate(_THROTTLE_BITS) if self.raw >> (16 + i) & 1)


def parse_throttled(text: str) -> Throttled | None:
    """Parse ``throttled=0x50000``; anything else gives None."""
    m = _THROTTLED.match((text or "").strip())
    return Throttled(int(m[1], 16)) if m else None


def run_vcgencmd(*args: str) -> str | None:
    """stdout of ``vcgencmd ARGS`` (2 s timeout), or None without vcgencmd or on failure."""
    exe = shutil.which("vcgencmd")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("vcgencmd %s failed: %s", " ".join(args), exc)
        return None
    if proc.returncode != 0:
        log.debug("vcgencmd %s exited %d: %s", " ".join(args), proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


@dataclass
class Rpi5PmicPower:
    """Pi 5 PMIC rail power.

    Attributes:
        run: Runs ``vcgencmd`` with the given arguments and returns stdout or None; tests inject
            a recorded capture. None means the module's ``run_vcgencmd``.
    """

    run: Callable[..., str | None] | None = None
    name: str = field(default=LABEL, init=False)

    def _vcgencmd(self, *args: str) -> str:
        return (self.run or run_vcgencmd)(*args) or ""

    def looked_for(self) -> str:
        """What this source looks for, for error messages."""
        return "the `vcgencmd pmic_read_adc` command (Raspberry Pi 5 only; needs group video)"

    def available(self) -> bool:
        """True if ``pmic_read_adc`` answers with at least one rail. Never raises."""
        try:
            return parse_pmic(self._vcgencmd("pmic_read_adc"))[0] is not None
        except Exception:
            log.debug("pmic probe failed", exc_info=True)
            return False

    def read(self) -> dict[str, Any]:
        """PMIC rail power in watts and each rail in watts."""
        total, rails, _ = parse_pmic(self._vcgencmd("pmic_read_adc"))
        return {
            "power_w": None if total is None else round(total, 4),
            "power_source": LABEL,
            "power_rails_w": {k: round(v, 4) for k, v in rails.items()},
        }

    def throttled(self) -> Throttled | None:
        """The current ``get_throttled`` state, or None if it can't be read."""
        return parse_throttled(self._vcgencmd("get_throttled"))


__all__ = ["LABEL", "Rpi5PmicPower", "Throttled", "parse_pmic", "parse_throttled", "run_vcgencmd"]
