"""Board power estimated from CPU load when no sensor exists: ``idle + (max - idle) * cpu / 100``.

This is a linear model with two configured numbers, not a measurement: it is always labelled
``estimated`` (``protocol.messages.is_measured`` is False for it) and never reports rails.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LABEL = "estimated"


def estimate_watts(idle_w: float, max_w: float, cpu_percent: float | None) -> float | None:
    """The linear estimate; CPU load is clamped to 0-100 and None (or NaN) gives None."""
    if cpu_percent is None or math.isnan(cpu_percent):
        return None
    load = min(max(float(cpu_percent), 0.0), 100.0)
    return idle_w + (max_w - idle_w) * load / 100.0


@dataclass
class EstimatedPower:
    """A CPU-load power model.

    Attributes:
        idle_w: Board power at 0 % CPU, watts.
        max_w: Board power at 100 % CPU, watts; at least ``idle_w``.
        cpu_percent: Returns whole-machine CPU load 0-100, or None when unknown (for example
            the sampler's ``psutil.cpu_percent()`` value, so that psutil is called only once).
    """

    idle_w: float
    max_w: float
    cpu_percent: Callable[[], float | None]
    name: str = field(default=LABEL, init=False)

    def __post_init__(self) -> None:
        if not (0 <= self.idle_w <= self.max_w) or math.isinf(self.max_w):
            raise ValueError(
                f"need 0 <= idle_w <= max_w, got idle_w={self.idle_w}, max_w={self.max_w}"
            )

    def looked_for(self) -> str:
        """Nothing is looked for: the estimate is always available."""
        return "nothing (an estimate from CPU load)"

    def available(self) -> bool:
        """Always True."""
        return True

    def read(self) -> dict[str, Any]:
        """The estimate in watts, or None if the CPU load is unknown."""
        try:
            cpu = self.cpu_percent()
        except Exception:
            log.debug("cpu_percent callback failed", exc_info=True)
            cpu = None
        try:
            watts = estimate_watts(self.idle_w, self.max_w, cpu)
        except (TypeError, ValueError):
            watts = None
        return {
            "power_w": None if watts is None else round(watts, 4),
            "power_source": LABEL,
            "power_rails_w": {},
        }


__all__ = ["LABEL", "EstimatedPower", "estimate_watts"]
