"""The wire contract between ``edge-agent`` and ``edge-coordinator``.

No I/O happens here and torch is never imported at module level.
"""

from protocol.errors import (
    BrokerError,
    ConfigError,
    DecodeError,
    EdgeTrainError,
    PlanError,
    ProtocolError,
    RoundTimeout,
)
from protocol.messages import SCHEMA_VERSION, BoardCaps, BoardStatus, TelemetrySample

__version__ = "0.1.0"

__all__ = [
    "SCHEMA_VERSION",
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
    "__version__",
]
