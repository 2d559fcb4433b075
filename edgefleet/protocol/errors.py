"""The one exception tree both sides raise.

    EdgeTrainError
    ├── ConfigError        a config file or option is wrong (names the key, the file and the fix)
    ├── ProtocolError      something on the wire is wrong
    │   └── DecodeError    a payload could not be decoded or failed validation
    ├── BrokerError        the MQTT broker refused us or could not be reached
    ├── PlanError          no configuration satisfies the request
    └── RoundTimeout       a training step's deadline passed
"""

from __future__ import annotations


class EdgeTrainError(Exception):
    """Root of every error edgefleet raises on purpose."""


class ConfigError(EdgeTrainError):
    """A configuration value is missing, unknown or of the wrong type."""


class ProtocolError(EdgeTrainError):
    """A message on the wire breaks the contract."""


class DecodeError(ProtocolError):
    """A payload could not be decoded, or decoded to something invalid."""


class BrokerError(EdgeTrainError):
    """The MQTT broker refused the connection or cannot be reached."""


class PlanError(EdgeTrainError):
    """No candidate configuration satisfies the request."""


class NeighbourFault(EdgeTrainError):
    """A job ended because another party failed (a pipeline neighbour stalled or left): this process is sound, and a
    kept training worker may take the next job (the re-planned one) without starting again."""


class RoundTimeout(EdgeTrainError):
    """A training step did not complete before its deadline."""


__all__ = [
    "BrokerError",
    "ConfigError",
    "DecodeError",
    "EdgeTrainError",
    "NeighbourFault",
    "PlanError",
    "ProtocolError",
    "RoundTimeout",
]
