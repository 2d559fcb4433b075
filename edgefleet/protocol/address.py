"""Parsing of broker addresses, shared by both commands: ``HOST:PORT``, ``mqtt://HOST[:PORT]`` and
``mqtts://HOST[:PORT]`` (TLS)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from edgefleet.protocol.errors import ConfigError

DEFAULT_MQTT_PORT = 1883
DEFAULT_MQTTS_PORT = 8883
BROKER_ENV = "EDGEFLEET_BROKER"
BROKER_FORMS = "HOST:PORT, mqtt://HOST[:PORT] or mqtts://HOST[:PORT] (TLS)"
_SCHEMES = {"mqtt": False, "mqtts": True}  # scheme -> TLS


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int
    tls: bool | None = None  # a broker URL's say: True for mqtts://, False for mqtt://, None for plain HOST:PORT

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


def parse_broker(text: str, *, what: str = "--broker") -> HostPort:
    """Parse a broker address: ``HOST[:PORT]``, ``mqtt://HOST[:PORT]`` or ``mqtts://HOST[:PORT]``.

    A URL says whether to use TLS (``HostPort.tls``); its default port is 1883 for ``mqtt`` and
    8883 for ``mqtts``. Credentials in the address are refused without echoing it: a command line
    shows in ``ps`` and in shell history, so the password belongs in the config file.

    Raises:
        ConfigError: naming ``what`` and the fix.
    """
    raw = text.strip()
    if "@" in raw:
        raise ConfigError(f"{what}: a user name or password in the broker address is refused (a command line shows in ps and "
                          "shell history); put username and password_file in the config file's [broker] section")
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return parse_host_port(raw, what=what)
    tls = _SCHEMES.get(scheme.lower())
    if tls is None:
        raise ConfigError(f"{what}={raw!r}: scheme {scheme!r} is not supported; write {BROKER_FORMS}")
    netloc = rest[:-1] if rest.endswith("/") else rest
    if any(c in netloc for c in "/?#"):
        raise ConfigError(f"{what}={raw!r}: a broker URL has no path or query; write {scheme}://HOST[:PORT]")
    if not netloc:
        raise ConfigError(f"{what}={raw!r} has no host; write {scheme}://HOST[:PORT], e.g. {scheme}://192.168.1.10")
    address = parse_host_port(netloc, what=what, default_port=DEFAULT_MQTTS_PORT if tls else DEFAULT_MQTT_PORT)
    return HostPort(address.host, address.port, tls=tls)


def broker_from_env() -> HostPort | None:
    """The broker named by ``$EDGEFLEET_BROKER`` (any form :func:`parse_broker` takes), or None when it is unset or empty."""
    value = os.environ.get(BROKER_ENV, "").strip()
    return parse_broker(value, what=BROKER_ENV) if value else None


__all__ = ["BROKER_ENV", "BROKER_FORMS", "DEFAULT_MQTTS_PORT", "DEFAULT_MQTT_PORT", "HostPort", "broker_from_env",
           "parse_broker", "parse_host_port"]
