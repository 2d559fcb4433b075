"""A Raspberry Pi's throttling and under-voltage flags (``vcgencmd get_throttled``), on every Pi model.

The firmware answers ``throttled=0x50005``: bits 0-3 are the conditions active now (under-voltage,
Arm frequency capped, throttled, soft temperature limit) and bits 16-19 the same since boot
(raspberrypi.com/documentation/computers/os.html#get_throttled). Alert on the "now" flags; the
"since boot" flags say the board's figures may be slower than it can do. ``vcgencmd`` forks and
talks to the firmware, so it runs at most once per ``min_period_s``; between runs the last answer
is reported again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.agent.sensors.power_rpi5_pmic import Throttled, parse_throttled, run_vcgencmd

log = logging.getLogger(__name__)

NAME = "throttling"
# The TelemetrySample field stems of bits 0-3 (and, + 16, of the same since boot).
CONDITIONS = ("under_voltage", "freq_capped", "throttled", "soft_temp_limit")
MIN_PERIOD_S = 1.0


def throttle_fields(state: Throttled | None) -> dict[str, Any]:
    """``throttled_bits`` and one ``<condition>_now`` / ``<condition>_since_boot`` flag per condition.

    None (no answer) gives every field None.
    """
    fields: dict[str, Any] = {"throttled_bits": None if state is None else state.raw}
    for bit, stem in enumerate(CONDITIONS):
        fields[f"{stem}_now"] = None if state is None else bool(state.raw >> bit & 1)
        fields[f"{stem}_since_boot"] = None if state is None else bool(state.raw >> (16 + bit) & 1)
    return fields


@dataclass
class ThrottlingSource:
    """The firmware's throttling flags.

    Attributes:
        run: runs ``vcgencmd`` with the given arguments and returns stdout or None; tests inject a
            recorded capture. None means ``power_rpi5_pmic.run_vcgencmd``.
        min_period_s: the shortest time between two ``vcgencmd`` runs.
        clock: monotonic seconds (tests step it).
    """

    run: Callable[..., str | None] | None = None
    min_period_s: float = MIN_PERIOD_S
    clock: Callable[[], float] = time.monotonic
    name: str = field(default=NAME, init=False)
    _last: tuple[float, Throttled | None] | None = field(default=None, init=False, repr=False)
    _missing_logged: bool = field(default=False, init=False, repr=False)

    def _query(self) -> Throttled | None:
        text = (self.run or run_vcgencmd)("get_throttled")
        state = parse_throttled(text or "")
        if state is None and not self._missing_logged:
            log.debug("vcgencmd get_throttled gave no answer (%r); the throttling flags are reported as None", text)
            self._missing_logged = True
        self._last = (self.clock(), state)
        return state

    def available(self) -> bool:
        """True if ``vcgencmd get_throttled`` answers (any Pi with the video group). Never raises."""
        try:
            return self._query() is not None
        except Exception:
            log.debug("get_throttled probe failed", exc_info=True)
            return False

    def read(self) -> dict[str, Any]:
        """The flags, from a fresh ``vcgencmd`` run or the last one if it is recent."""
        last = self._last
        if last is not None and self.clock() - last[0] < self.min_period_s:
            return throttle_fields(last[1])
        return throttle_fields(self._query())


__all__ = ["CONDITIONS", "NAME", "ThrottlingSource", "throttle_fields"]
