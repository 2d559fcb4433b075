"""The agent's configuration: one TOML file, then ``$EDGEFLEET_BROKER``, then command-line flags.

Every key, its default and its meaning are listed in the README's configuration reference.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.protocol.address import HostPort, broker_from_env
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import MAX_ADDRESS_CHARS, POWER_SOURCES
from edgefleet.protocol.topics import valid_board_id, valid_prefix
from edgefleet.transport.fleet_key import load_board_key, read_key_file
from edgefleet.transport.settings import BrokerSettings, build_section, load_broker_settings, read_toml
from edgefleet.transport.toml_text import toml_document

DEFAULT_DISCOVERY_PREFIX = "homeassistant"  # Home Assistant's own default
POWER_KINDS = ("auto", *POWER_SOURCES)  # power.source: a source of protocol.messages, or "auto" (the first found)


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetrySettings:
    """The ``[telemetry]`` section."""

    interval_s: float = 1.0              # seconds between samples
    net_interfaces: tuple[str, ...] = ()  # interfaces summed for net_*; empty = all but loopback
    sysfs_root: str = "/sys"             # where hwmon, thermal and powercap live (tests use a copy)
    cpu_scope: str = "system"            # "system": the machine's CPU; "cgroup": this agent's cgroup (100% = its quota)
    # Publish Home Assistant MQTT discovery configs (retained) so the board shows up there as a device
    # with its sensors; off by default (it writes outside the fleet's topic prefix).
    home_assistant: bool = False
    home_assistant_prefix: str = DEFAULT_DISCOVERY_PREFIX  # Home Assistant's discovery_prefix

    def __post_init__(self) -> None:
        if not 0.05 <= self.interval_s <= 3600:
            raise ValueError(f"interval_s = {self.interval_s} is outside 0.05-3600 seconds")
        if self.cpu_scope not in ("system", "cgroup"):
            raise ValueError(f'cpu_scope = {self.cpu_scope!r} is not "system" or "cgroup"')
        if not valid_prefix(self.home_assistant_prefix):
            raise ValueError(f"home_assistant_prefix = {self.home_assistant_prefix!r} must be non-empty topic levels without + or # "
                             f'or a leading/trailing /; Home Assistant\'s default is "{DEFAULT_DISCOVERY_PREFIX}"')


@dataclass(frozen=True, slots=True, kw_only=True)
class PowerSettings:
    """The ``[power]`` section."""

    source: str = "auto"   # auto, jtop, ina3221, rpi5-pmic, hwmon, rapl, estimated, none
    idle_w: float = 2.7    # estimated model: watts at 0% CPU (Raspberry Pi 4 B measured at the wall)
    max_w: float = 6.4     # estimated model: watts at 100% CPU

    def __post_init__(self) -> None:
        if self.source not in POWER_KINDS:
            raise ValueError(f"source = {self.source!r} is not one of {', '.join(POWER_KINDS)}")
        if not 0 <= self.idle_w <= self.max_w:
            raise ValueError(f"idle_w = {self.idle_w} and max_w = {self.max_w} must satisfy 0 <= idle_w <= max_w")


@dataclass(frozen=True, slots=True, kw_only=True)
class SecuritySettings:
    """The ``[security]`` section: how the agent tells the coordinator's commands from a stranger's."""

    # The coordinator's public key(s), "ed25519-public <hex>" lines (a legacy shared HMAC key still
    # works, with a warning); without it every command is refused.
    fleet_key_file: str = ""
    max_command_age_s: float = 30.0  # older commands are refused as stale (keep the clocks in sync: NTP)
    # This board's own private key ("ed25519-private <hex>"): it signs the job events the board sends,
    # so that a coordinator given --board-keys can tell them from forgeries. Empty: events are unsigned.
    board_key_file: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.max_command_age_s <= 3600:
            raise ValueError(f"max_command_age_s = {self.max_command_age_s} is outside 1-3600 seconds")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSettings:
    """The ``[training]`` section: how the board runs the jobs it is given."""

    # Keep the worker process (torch and Lightning imported) between jobs: the next job starts at
    # once instead of after the import (~20 s on a Pi-class board), at the price of the worker's
    # memory while idle. Off by default: an idle board returns to its idle memory.
    keep_worker: bool = False
    # Where the fleet's other boards reach this one (a pipeline's stage links), published in its caps: an IP address
    # or a host name. Empty: the local address of its broker connection, which suits a flat LAN; set it behind NAT,
    # or when the broker runs on this board (its connection is then on 127.0.0.1).
    address: str = ""

    def __post_init__(self) -> None:
        if self.address and not valid_address(self.address):
            raise ValueError(f"address = {self.address!r:.80} is not an IP address or a host name; give the address "
                             "other boards reach this one at, e.g. \"192.168.1.21\" or \"pi-1.lab\", or leave it out")


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # RFC 1123 (fullmatch)


def valid_address(text: str) -> bool:
    """True for an IP address (v4 or v6, with a zone) or a host name (RFC 1123 labels, an optional final dot)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= MAX_ADDRESS_CHARS and not name.replace(".", "").isdigit() and \
        all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything the agent daemon needs, loaded once."""

    board_id: str
    # Where the agent keeps what must outlive a restart (the accepted commands' nonces); "" = none.
    state_dir: str = ""
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    power: PowerSettings = field(default_factory=PowerSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    source: str = "defaults"   # where it came from, for messages


@dataclass(frozen=True, slots=True, kw_only=True)
class _TopLevel:
    board_id: str = ""
    state_dir: str = ""


STATE_DIRECTORY_ENV = "STATE_DIRECTORY"  # systemd's StateDirectory= (the unit's /var/lib/edge-agent)


def default_state_dir(config_path: Path | None) -> str:
    """systemd's ``$STATE_DIRECTORY``, else the config file's directory, else "" (no config file: no fleet key either)."""
    from_systemd = os.environ.get(STATE_DIRECTORY_ENV, "").split(":")[0]
    if from_systemd:
        return from_systemd
    return str(config_path.resolve().parent) if config_path is not None else ""


def default_board_id() -> str:
    """The host name, reduced to what a topic level allows."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname().split(".")[0]) or "board"
    return name if valid_board_id(name) else "board"


def load_agent_config(path: Path | None, *, board_id: str | None = None, broker: HostPort | None = None,
                      interval_s: float | None = None) -> AgentConfig:
    """Load the config file (if any), then apply ``$EDGEFLEET_BROKER`` and the command-line overrides.

    Raises:
        ConfigError: naming the key, the file and the fix.
    """
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "command line"
    sections = {"broker": BrokerSettings, "telemetry": TelemetrySettings, "power": PowerSettings,
                "security": SecuritySettings, "training": TrainingSettings}
    top = build_section(_TopLevel, {k: v for k, v in data.items() if k not in sections}, section="", source=source)
    broker_cfg = load_broker_settings(data, source=source, address=broker or broker_from_env())
    telemetry = build_section(TelemetrySettings, data.get("telemetry", {}), section="telemetry", source=source,
                              overrides={"interval_s": interval_s})
    power = build_section(PowerSettings, data.get("power", {}), section="power", source=source)
    security = build_section(SecuritySettings, data.get("security", {}), section="security", source=source)
    training = build_section(TrainingSettings, data.get("training", {}), section="training", source=source)
    if security.fleet_key_file and not Path(security.fleet_key_file).is_file():
        raise ConfigError(f"{source}: security.fleet_key_file = {security.fleet_key_file!r} does not exist; install the "
                          "coordinator's public key there (python -m edgefleet.transport.fleet_key --public fleet.key > "
                          "fleet.pub; ansible does) or remove the key to refuse all commands")
    if security.board_key_file and not Path(security.board_key_file).is_file():
        raise ConfigError(f"{source}: security.board_key_file = {security.board_key_file!r} does not exist; make the "
                          f"board's key with python -m edgefleet.transport.fleet_key --generate --output "
                          f"{security.board_key_file} (ansible does) or remove the key to send unsigned events")
    # What the key files hold is checked here too, so that --check-config (ansible's check) catches a wrong file.
    if security.fleet_key_file:
        read_key_file(security.fleet_key_file)
    if security.board_key_file:
        load_board_key(security.board_key_file)
    final_id = board_id or top.board_id or default_board_id()
    if not valid_board_id(final_id):
        where = "--id" if board_id else f"{source}: board_id"
        raise ConfigError(f"{where} = {final_id!r} is not a valid board id: use 1-63 letters, digits, '.', '_' or '-', starting with a "
                          "letter or digit")
    return AgentConfig(board_id=final_id, state_dir=top.state_dir or default_state_dir(path), broker=broker_cfg,
                       telemetry=telemetry, power=power, security=security, training=training, source=source)


def nonce_file_path(cfg: AgentConfig) -> Path | None:
    """Where the accepted commands' nonces are kept (one file per board id); None without a state_dir."""
    return Path(cfg.state_dir) / f"command-nonces-{cfg.board_id}.json" if cfg.state_dir else None


def describe(cfg: AgentConfig) -> str:
    """The configuration in effect as TOML for ``--check-config``: ``tomllib`` reads it back to the same values, and
    ``edge-agent --config`` takes it as a file. The password is never shown (a comment says whether one is set)."""
    tables = {name: {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
              for name, section in (("broker", cfg.broker), ("telemetry", cfg.telemetry), ("power", cfg.power),
                                    ("security", cfg.security), ("training", cfg.training))}
    notes: dict[str, str] = {}
    if tables["broker"].pop("password"):
        notes["broker.password"] = ("password: set (not shown; from password_file)" if cfg.broker.password_file
                                    else "password: set in the file (not shown here)")
    header = f"config OK ({cfg.source})\nthe configuration in effect (the file, $EDGEFLEET_BROKER, the flags), as TOML"
    return toml_document({"board_id": cfg.board_id, "state_dir": cfg.state_dir}, tables, header=header,
                         notes=notes).rstrip("\n")
