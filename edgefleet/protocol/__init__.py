"""The wire contract between ``edge-agent`` and ``edge-coordinator``.

No I/O happens here and torch is never imported at module level. What carries a version, and
the rule for changing one: docs/protocol.md.
"""

from edgefleet.protocol.errors import (
    BrokerError,
    ConfigError,
    DecodeError,
    EdgeTrainError,
    PlanError,
    ProtocolError,
    RoundTimeout,
)
from edgefleet.protocol.messages import MESSAGE_SCHEMA_VERSION, BoardCaps, BoardStatus, TelemetrySample

__all__ = [
    "MESSAGE_SCHEMA_VERSION",
    "BoardCaps",
    "BoardStatus",
    "BrokerError",
    "ConfigError",
    "DecodeError",
    "EdgeTrainError",
    "PlanError",
    "ProtocolError",
    "RoundTimeout",
    "TelemetrySample",
]
