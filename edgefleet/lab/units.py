"""Link rates and memory sizes as people write them in a fleet file, and back.

Why strict: ``tc`` reads ``mbps`` as megaBYTES per second and ``mbit`` as megabits, so a fleet
file that says ``"100mbps"`` would silently be 8x too fast. The lab accepts bits per second only,
spelled unambiguously, and binary memory units (what ``memory.limit_in_bytes`` counts), and says
how to fix anything else.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_BYTE_RATE_UNITS = ("bps", "kbps", "mbps", "gbps", "b/s", "kb/s", "mb/s", "gb/s")
_SIZE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z/]*)\s*$")

RATE_EXAMPLE = "'100mbit' or '20 Mbit/s' (bits per second: kbit, mbit, gbit)"
SIZE_EXAMPLE = "'512MiB' or '2GiB' (KiB, MiB, GiB) or a whole number of bytes"

# The limits below keep a fleet file inside what tbf and the kernel handle well on one machine.
MIN_RATE_BPS = 100 * 10**3
MAX_RATE_BPS = 10 * 10**9
MIN_MEMORY_BYTES = 64 * 2**20   # the idle agent alone needs about 40 MB


class UnitError(ValueError):
    """A value with a missing or wrong unit; the message says what to write instead."""


def parse_rate(value: object) -> int:
    """``"100mbit"``, ``"20 Mbit/s"``, ``"1gbit"`` -> bits per second.

    Raises:
        UnitError: not a string, no number, an unknown unit, a bytes-per-second unit, or a rate
            outside 100 kbit/s - 10 Gbit/s.
    """
    if not isinstance(value, str):
        raise UnitError(f"{value!r} is not a string; write a rate such as {RATE_EXAMPLE}")
    match = _NUMBER_UNIT.match(value)
    if not match:
        raise UnitError(f"{value!r} is not a number followed by a unit; write e.g. {RATE_EXAMPLE}")
    number, unit = float(match.group(1)), match.group(2).lower()
    unit_key = unit.removesuffix("/s")
    if unit in _BYTE_RATE_UNITS:
        raise UnitError(f"{value!r} uses {match.group(2)!r}, which tc reads as BYTES per second; "
                        f"write bits per second, e.g. {RATE_EXAMPLE}")
    if unit_key not in _RATE_UNITS:
        shown = match.group(2) or "no unit"
        raise UnitError(f"{value!r} has {shown!r}, not a rate unit; write e.g. {RATE_EXAMPLE}")
    bps = round(number * _RATE_UNITS[unit_key])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise UnitError(f"{value!r} is outside {format_rate(MIN_RATE_BPS)} - {format_rate(MAX_RATE_BPS)}")
    return bps


def parse_size(value: object) -> int:
    """``"512MiB"``, ``"2GiB"`` or a whole number of bytes -> bytes.

    Raises:
        UnitError: a decimal unit (MB, GB: ambiguous in practice), an unknown unit, or less
            than 64 MiB.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnitError(f"{value!r} is not a size; write e.g. {SIZE_EXAMPLE}")
    if isinstance(value, int):
        size = value
    else:
        match = _NUMBER_UNIT.match(value)
        if not match:
            raise UnitError(f"{value!r} is not a number followed by a unit; write e.g. {SIZE_EXAMPLE}")
        unit = match.group(2).lower()
        if unit not in _SIZE_UNITS:
            shown = match.group(2) or "no unit"
            raise UnitError(f"{value!r} has {shown!r}, not a binary size unit; write e.g. {SIZE_EXAMPLE}")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size < MIN_MEMORY_BYTES:
        raise UnitError(f"{value!r} is less than {format_size(MIN_MEMORY_BYTES)}, too little for the agent itself")
    return size


def format_rate(bps: float) -> str:
    """``100000000`` -> ``"100 Mbit/s"``."""
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.0f} bit/s"


def format_size(size: int) -> str:
    """``2147483648`` -> ``"2 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} B"


__all__ = ["UnitError", "format_rate", "format_size", "parse_rate", "parse_size"]
