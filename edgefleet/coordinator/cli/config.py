"""The coordinator's configuration: an optional TOML file with ``[broker]`` and ``[security]``
sections, then ``$EDGEFLEET_BROKER``, then ``--broker``.

The file is ``--config FILE``, else the first of :func:`config_locations` that is there
(``$EDGEFLEET_CONFIG``, the user's ``~/.config/edgefleet/coordinator.toml``, the machine's
``/etc/edge-coordinator/coordinator.toml``, where the Ansible role writes it), so a fleet's broker
and keys need not be repeated on every command.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.protocol.address import HostPort, broker_from_env
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.fleet_key import load_fleet_key
from edgefleet.transport.settings import BrokerSettings, build_section, load_broker_settings, read_toml

log = logging.getLogger(__name__)

CONFIG_ENV = "EDGEFLEET_CONFIG"
SYSTEM_CONFIG = Path("/etc/edge-coordinator/coordinator.toml")  # where the Ansible coordinator role writes it
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
        if not self.security.fleet_key_file:
            raise ConfigError(missing)
        return load_fleet_key(Path(self.security.fleet_key_file))


def user_config_path(env: Mapping[str, str] | None = None) -> Path | None:
    """``$XDG_CONFIG_HOME/edgefleet/coordinator.toml`` (``~/.config`` when unset); None without a home directory."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME", "")
    if not base:
        try:
            base = str(Path.home() / ".config")
        except RuntimeError:  # no $HOME and no password entry (a bare container)
            return None
    return Path(base) / "edgefleet" / "coordinator.toml"


def config_locations(env: Mapping[str, str] | None = None) -> list[tuple[Path, str]]:
    """Where the coordinator looks for its file when ``--config`` is not given, first match wins, with
    how each was named (for the log line that says which file was read)."""
    env = os.environ if env is None else env
    named = env.get(CONFIG_ENV, "").strip()
    if named:
        return [(Path(named).expanduser(), f"${CONFIG_ENV}")]
    user = user_config_path(env)
    return [*([(user, "the user's default")] if user is not None else []), (SYSTEM_CONFIG, "the system default")]


def default_config_path(env: Mapping[str, str] | None = None) -> tuple[Path, str] | None:
    """The file to read when ``--config`` is not given (and how it was found), or None to use defaults.

    Raises:
        ConfigError: ``$EDGEFLEET_CONFIG`` names a file that does not exist (a typo should not quietly
            fall back to another file).
    """
    env = os.environ if env is None else env
    locations = config_locations(env)
    named = bool(env.get(CONFIG_ENV, "").strip())
    for path, how in locations:
        if not path.is_file():
            continue
        if named or os.access(path, os.R_OK):
            return path, how
        # The Ansible role's file is for coordinator_operators; anyone else still runs with --broker.
        log.info("%s exists but this user cannot read it (not in its group?); skipped", path)
    if named:
        raise ConfigError(f"${CONFIG_ENV}={locations[0][0]} does not exist; create it, fix the path or unset {CONFIG_ENV}")
    return None


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


__all__ = ["CONFIG_ENV", "NO_FLEET_KEY", "SYSTEM_CONFIG", "CoordinatorConfig", "CoordinatorSecurity", "config_locations",
           "default_config_path", "load_coordinator_config", "user_config_path"]
