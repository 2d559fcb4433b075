"""Telemetry sources of a board, one module per kind of reading."""

from edgefleet.agent.sensors.sampler import Sampler

__all__ = ["Sampler"]
