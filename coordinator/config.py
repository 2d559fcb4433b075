"""The coordinator's configuration: an optional TOML file with a ``[broker]`` section, then
``$EDGEFLEET_BROKER``, then ``--broker``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.protocol.address import HostPort, broker_from_env
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.settings import BrokerSettings, build_section, load_broker_settings, read_toml


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSecurity:
    """The ``[security]`` section."""

    fleet_key_file: str = ""   # the key the boards verify commands with (the same file ansible installs)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    security: CoordinatorSecurity = field(default_factory=CoordinatorSecurity)
    source: str = "defaults"


def load_coordinator_config(path: Path | None, *, broker: HostPort | None = None,
                            fleet_key_file: str | None = None) -> CoordinatorConfig:
    """Raises ConfigError naming the key, the file and the fix."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "command line"
    unknown = sorted(set(data) - {"broker", "security"})
    if unknown:
        raise ConfigError(f"{source}: unknown key or section {unknown[0]!r}; the coordinator's file has [broker] and [security] sections")
    settings = load_broker_settings(data, source=source, address=broker or broker_from_env())
    security = build_section(CoordinatorSecurity, data.get("security", {}), section="security", source=source,
                             overrides={"fleet_key_file": fleet_key_file})
    return CoordinatorConfig(broker=settings, security=security, source=source)
