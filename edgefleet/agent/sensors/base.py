"""What every telemetry source looks like.

A source is small and single-purpose: ``available()`` says whether this board has it (cheap, no
side effects) and ``read()`` returns the ``TelemetrySample`` fields it knows, by their wire names.
Sources read from ``sysfs_root`` (normally ``/sys``) so that tests can hand them a recorded tree.
"""

from __future__ import annotations

from typing import Any, Protocol


class TelemetrySource(Protocol):
    """One reader of one kind of reading."""

    name: str

    def available(self) -> bool:
        """True if this board has the source. Must not raise."""
        ...

    def read(self) -> dict[str, Any]:
        """The fields this source knows, by their ``TelemetrySample`` names.

        May raise OSError or ValueError; the sampler then logs once and leaves the fields out.
        """
        ...


class PowerSource(TelemetrySource, Protocol):
    """A source of ``power_w``, ``power_source`` and ``power_rails_w``.

    ``power_source`` is the source's label (``jtop``, ``ina3221``, ``rpi5-pmic``,
    ``hwmon:<chip>``, ``rapl``, ``estimated``); an estimate is never labelled as a sensor.
    """


class SensorPowerSource(PowerSource, Protocol):
    """A power sensor that may be missing on this board, and says where it looked."""

    def looked_for(self) -> str:
        """The files, devices or services probed, for an error that says what is missing."""
        ...


__all__ = ["PowerSource", "SensorPowerSource", "TelemetrySource"]
