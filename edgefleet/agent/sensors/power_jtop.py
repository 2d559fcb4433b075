"""Jetson power through jetson-stats (``jtop``), when it is installed and ``jtop.service`` runs.

jetson-stats is AGPL-3.0 and optional (extra ``edgefleet[jetson]``), so it is imported only inside
``available()``/``read()``; this module imports without it. Without it, ``power_ina3221`` reads the
same sensor from sysfs.

``jtop.power`` (jetson-stats >= 4.2) is ``{'rail': {NAME: {volt mV, curr mA, power mW, avg mW,
online, …}}, 'tot': {…, 'name': 'VDD_IN'}}``; ``tot`` is the board-input rail moved out of
``rail``, or the sum of the rails (no ``volt``/``curr``, no ``name``) when the board has none.
A board without sensors gives ``{}``. Every key is read with ``.get()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LABEL = "jtop"


def _watts(entry: Any) -> float | None:
    """``entry['power']`` (mW) in watts, or None if it is missing or not a number."""
    if not isinstance(entry, dict):
        return None
    mw = entry.get("power")
    if isinstance(mw, bool) or not isinstance(mw, (int, float)):
        return None
    return mw / 1e3


def parse_jtop_power(power: Any) -> tuple[float | None, dict[str, float]]:
    """Convert ``jtop.power`` to watts.

    Args:
        power: ``jtop().power``: a dict in the 4.2+ shape, ``{}`` without sensors. Anything else
            (None, the 4.0/4.1 tuple) gives no reading.

    Returns:
        ``(total_w, rails_w)``. ``rails_w`` also holds the input rail under its name
        (``VDD_IN``) when ``tot`` names one, so don't sum it. Offline rails are left out.
    """
    if not isinstance(power, dict):
        if power is not None:
            log.debug("unexpected jtop power %s (need jetson-stats >= 4.2)", type(power).__name__)
        return None, {}
    rails: dict[str, float] = {}
    raw_rails = power.get("rail")
    for name, entry in (raw_rails.items() if isinstance(raw_rails, dict) else ()):
        w = _watts(entry)
        if w is not None and entry.get("online", True) is not False:
            rails[str(name)] = w
    tot = power.get("tot")
    total = _watts(tot)
    if total is not None and isinstance(tot, dict) and tot.get("name"):
        rails[str(tot["name"])] = total
    if total is None and rails:
        total = sum(rails.values())
    return total, rails


@dataclass
class JtopPower:
    """Power from a jtop client connected to ``jtop.service``.

    ``available()`` starts the client (there is no cheaper way to learn that the service answers)
    and ``read()`` reuses it; call ``close()`` when done.

    Attributes:
        interval: jtop's sampling interval in seconds.
    """

    interval: float = 1.0
    name: str = field(default=LABEL, init=False)
    reason: str = field(default="", init=False)
    _client: Any = field(default=None, init=False, repr=False)

    def looked_for(self) -> str:
        """What this source looks for, for error messages."""
        where = (
            "jetson-stats (`from jtop import jtop`) and a running jtop.service "
            "(/run/jtop.sock; the agent needs group jtop)"
        )
        return f"{where}: {self.reason}" if self.reason else where

    def available(self) -> bool:
        """True if jtop imports and its service accepts us. Never raises."""
        try:
            self._start()
            return True
        except Exception as exc:
            self.reason = str(exc) or type(exc).__name__
            log.debug("jtop unavailable: %s", self.reason)
            return False

    def read(self) -> dict[str, Any]:
        """Board power in watts and each rail in watts. Raises OSError if jtop can't start."""
        client = self._start()
        total, rails = parse_jtop_power(getattr(client, "power", None))
        return {
            "power_w": None if total is None else round(total, 4),
            "power_source": LABEL,
            "power_rails_w": {k: round(v, 4) for k, v in rails.items()},
        }

    def running_client(self) -> Any:
        """The started jtop client, or None: other sources (the GPU's) read from the same client."""
        return self._client

    def close(self) -> None:
        """Stop the jtop client if one was started."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("jtop close failed", exc_info=True)

    def _start(self) -> Any:
        if self._client is None:
            try:
                from jtop import JtopException, jtop  # lazy: optional AGPL dependency
            except ImportError as exc:
                raise OSError(f"jetson-stats is not installed ({exc})") from exc
            client = jtop(interval=self.interval)
            try:
                client.start()
            except JtopException as exc:  # "The jtop.service is not active…", EACCES, version
                raise OSError(str(exc)) from exc
            self._client = client
        return self._client


__all__ = ["LABEL", "JtopPower", "parse_jtop_power"]
