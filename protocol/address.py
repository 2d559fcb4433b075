"""Parsing of ``HOST:PORT`` broker addresses, shared by both commands."""

from __future__ import annotations

import os
from dataclasses import dataclass

from edgefleet.protocol.errors import ConfigError

DEFAULT_MQTT_PORT = 1883
BROKER_ENV = "EDGEFLEET_BROKER"


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(text: str, *, what: str = "--broker", default_port: int = DEFAULT_MQTT_PORT) -> HostPort:
    """Parse ``host``, ``host:port`` or ``[v6addr]:port``.

    Raises:
        ConfigError: naming ``what`` (the option or variable the text came from) and the fix.
    """
    raw = text.strip()
    if not raw:
        raise ConfigError(f"{what} is empty; give HOST or HOST:PORT, e.g. {what}=192.168.1.10:1883")
    host, port_text = raw, ""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ConfigError(f"{what}={raw!r}: missing ']' after an IPv6 address; write [ADDR]:PORT")
        host, rest = raw[1:end], raw[end + 1:]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{what}={raw!r}: expected ':PORT' after ']'")
        port_text = rest[1:]
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
    if not host:
        raise ConfigError(f"{what}={raw!r} has no host; write HOST:PORT, e.g. localhost:1883")
    if not port_text:
        return HostPort(host, default_port)
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what}={raw!r}: port {port_text!r} is not a number; write HOST:PORT") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{what}={raw!r}: port {port} is outside 1-65535")
    return HostPort(host, port)


def broker_from_env() -> HostPort | None:
    """The broker named by ``$EDGEFLEET_BROKER``, or None when it is unset or empty."""
    value = os.environ.get(BROKER_ENV, "").strip()
    return parse_host_port(value, what=BROKER_ENV) if value else None


__all__ = ["BROKER_ENV", "DEFAULT_MQTT_PORT", "HostPort", "broker_from_env", "parse_host_port"]
