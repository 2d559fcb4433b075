"""What every command shares: the coordinator's configuration from the global flags and ``--fleet-key``,
and the check that the terminal library is installed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from edgefleet.protocol.address import parse_host_port
from edgefleet.protocol.errors import EdgeTrainError

if TYPE_CHECKING:
    from edgefleet.coordinator.config import CoordinatorConfig


def load_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The configuration ``--config``, ``--broker`` (else ``$EDGEFLEET_BROKER``) and the command's ``--fleet-key`` say."""
    from edgefleet.coordinator.config import load_coordinator_config

    broker = parse_host_port(args.broker, what="--broker") if args.broker else None
    return load_coordinator_config(args.config, broker=broker, fleet_key_file=getattr(args, "fleet_key", None))


def require_rich() -> None:
    """Raises EdgeTrainError saying how to install rich when it is missing."""
    try:
        import rich  # noqa: F401
    except ImportError:
        raise EdgeTrainError("edge-coordinator needs the 'rich' package: pip install 'edgefleet[coordinator]'") from None


__all__ = ["load_config", "require_rich"]
