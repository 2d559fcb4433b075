"""The coordinator's configuration: an optional TOML file with ``[broker]`` and ``[security]``
sections, then ``$EDGEFLEET_BROKER``, then ``--broker``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.protocol.address import HostPort, broker_from_env
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.settings import BrokerSettings, build_section, load_broker_settings, read_toml

log = logging.getLogger(__name__)

NO_FLEET_KEY = "no fleet key: give --fleet-key FILE or [security] fleet_key_file (the key the boards verify commands with)"


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSecurity:
    """The ``[security]`` section."""

    fleet_key_file: str = ""   # the key the boards verify commands with (the same file ansible installs)
    board_keys_dir: str = ""   # <board_id>.pub files: job events are checked against them (like --board-keys DIR)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """The broker to use and the key that signs commands, and where they were read from."""

    broker: BrokerSettings = field(default_factory=BrokerSettings)
    security: CoordinatorSecurity = field(default_factory=CoordinatorSecurity)
    source: str = "defaults"

    def fleet_key(self, *, missing: str = NO_FLEET_KEY) -> bytes:
        """The key that signs the boards' commands.

        Raises:
            ConfigError: no key file is configured (``missing`` is the message), or it cannot be read.
        """
        from edgefleet.transport.fleet_key import load_fleet_key

        if not self.security.fleet_key_file:
            raise ConfigError(missing)
        return load_fleet_key(Path(self.security.fleet_key_file))


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


__all__ = ["NO_FLEET_KEY", "CoordinatorConfig", "CoordinatorSecurity", "load_coordinator_config"]
