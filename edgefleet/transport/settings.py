"""Loading TOML configuration into frozen dataclasses, with errors that name key, file and fix.

Both commands read the same ``[broker]`` section, so it lives here with the loader.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.topics import DEFAULT_PREFIX, valid_prefix

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 boards
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # typeshed's protocol of a dataclass: no runtime module

log = logging.getLogger(__name__)

T = TypeVar("T", bound="DataclassInstance")  # a settings section is a dataclass

_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "tuple[str, ...]": "a list of strings"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BrokerSettings:
    """How to reach the MQTT broker (the ``[broker]`` section)."""

    host: str = "localhost"
    port: int = 1883
    username: str = ""
    password: str = ""
    password_file: str = ""         # read at start; wins over ``password``
    tls_ca_file: str = ""           # set to use TLS; the broker's CA certificate (an mqtts:// address: the system's bundle)
    tls_cert_file: str = ""         # client certificate, for brokers that require one
    tls_key_file: str = ""
    protocol: str = "3.1.1"         # "3.1.1" works with every broker; "5" for MQTT 5
    keepalive_s: int = 10           # an unplugged board is marked offline after 1.5x this
    topic_prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port = {self.port} is outside 1-65535")
        if self.protocol not in ("3.1.1", "5"):
            raise ValueError(f'protocol = "{self.protocol}" is not "3.1.1" or "5"')
        if not 2 <= self.keepalive_s <= 3600:
            raise ValueError(f"keepalive_s = {self.keepalive_s} is outside 2-3600 seconds")
        if not valid_prefix(self.topic_prefix):
            raise ValueError(f"topic_prefix = {self.topic_prefix!r} must be non-empty levels without + or # or a leading/trailing /")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca_file)

    def address(self) -> str:
        return f"{self.host}:{self.port}"


def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file.

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8, not valid TOML or nested beyond reason.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; create it (see the README's configuration "
                          "reference) or drop --config") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    try:
        data: dict[str, Any] = tomllib.loads(text)
        return data
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise ConfigError(f"config file {path} nests arrays or tables too deeply to be a configuration") from None


def _type_ok(value: Any, annotation: str) -> tuple[bool, Any]:
    """Check a TOML value against a field annotation; return (ok, converted value)."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        return optional, None
    if base == "bool":
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if base == "str":
        return isinstance(value, str), value
    if base == "int":
        return isinstance(value, int), value
    if base == "float":
        return isinstance(value, (int, float)), float(value) if isinstance(value, (int, float)) else value
    if base == "tuple[str, ...]":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return ok, tuple(value) if ok else value
    raise TypeError(f"config field type {annotation!r} is not supported")


def _describe(value: Any) -> str:
    kinds = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "table"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})"


def build_section(cls: type[T], data: Any, *, section: str, source: str, overrides: dict[str, Any] | None = None) -> T:
    """Build the dataclass ``cls`` from one TOML table, rejecting unknown keys and wrong types.

    Args:
        cls: a frozen dataclass whose fields are the section's keys.
        data: the table read from the file (``{}`` when absent).
        section: its dotted name for messages, e.g. ``"broker"``; ``""`` for the top level.
        source: the file name for messages.
        overrides: values from the command line or environment, already typed; they win.
    """
    where = f"[{section}]" if section else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {section} should be a table ([{section}]), got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{section}.{key}" if section else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {dotted!r} in {where}.{hint} Known keys: {', '.join(sorted(fields))}.")
        annotation = str(fields[key].type)
        ok, converted = _type_ok(value, annotation)
        if not ok:
            want = _TYPE_NAMES.get(annotation.removesuffix(" | None"), annotation)
            raise ConfigError(f"{source}: {dotted} should be {want}, got {_describe(value)}. Fix the value in the file.")
        kwargs[key] = converted
    kwargs.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from None


def resolve_password(settings: BrokerSettings, *, source: str) -> BrokerSettings:
    """Read ``password_file`` (when set) into ``password``.

    Raises:
        ConfigError: the password file is missing, unreadable or not UTF-8.
    """
    if not settings.password_file:
        return settings
    path = Path(settings.password_file)
    try:
        password = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{source}: broker.password_file = {str(path)!r} cannot be read ({exc.strerror}); "
                          "create it or remove the key") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: broker.password_file = {str(path)!r} is not UTF-8 text: write the password "
                          "as plain UTF-8 (one line)") from None
    return dataclasses.replace(settings, password=password)


def load_broker_settings(data: dict[str, Any], *, source: str, address: Any = None) -> BrokerSettings:
    """The ``[broker]`` section of a config file, with ``address`` (a ``HostPort`` from the command
    line or ``$EDGEFLEET_BROKER``) overriding host and port (and TLS, for an ``mqtts://`` or
    ``mqtt://`` URL), the password file read and the TLS files checked.

    Raises:
        ConfigError: naming the key, the file and the fix.
    """
    overrides = {"host": address.host, "port": address.port} if address is not None else {}
    settings = build_section(BrokerSettings, data.get("broker", {}), section="broker", source=source, overrides=overrides)
    settings = apply_url_tls(settings, getattr(address, "tls", None), source=source)
    settings = resolve_password(settings, source=source)
    check_tls_files(settings, source=source)
    return settings


def system_ca_file() -> str:
    """The CA bundle OpenSSL verifies servers with by default (``$SSL_CERT_FILE`` if set).

    Raises:
        ConfigError: this system has no such file.
    """
    paths = ssl.get_default_verify_paths()
    if not paths.cafile:
        raise ConfigError(f"mqtts:// uses the system's CA bundle, and there is none at {paths.openssl_cafile} "
                          "(install the ca-certificates package); or set broker.tls_ca_file to the broker's CA certificate")
    return paths.cafile


def apply_url_tls(settings: BrokerSettings, tls: bool | None, *, source: str) -> BrokerSettings:
    """Apply what a broker URL says about TLS (``HostPort.tls``: None for a plain ``HOST:PORT``).

    ``mqtts://`` turns TLS on, verifying the broker against the configured ``tls_ca_file`` or else
    the system's CA bundle (a broker with a certificate from a public CA). ``mqtt://`` with a
    configured CA file is refused rather than quietly sending the password in clear.

    Raises:
        ConfigError: the URL and the file disagree, or there is no CA bundle to use.
    """
    if tls is None:
        return settings
    if not tls:
        if settings.uses_tls:
            raise ConfigError(f"the broker address says mqtt:// (no TLS) but {source} sets broker.tls_ca_file = "
                              f"{settings.tls_ca_file!r}; write mqtts://HOST[:PORT] for TLS, or HOST:PORT to do what the file says")
        return settings
    if settings.tls_ca_file:
        return settings
    ca_file = system_ca_file()
    log.debug("mqtts://: verifying the broker with the system's CA bundle %s", ca_file)
    return dataclasses.replace(settings, tls_ca_file=ca_file)


def check_tls_files(settings: BrokerSettings, *, source: str) -> None:
    """Raise ConfigError if a configured TLS file does not exist."""
    for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        value = getattr(settings, key)
        if value and not Path(value).is_file():
            raise ConfigError(f"{source}: broker.{key} = {value!r} does not exist; fix the path or remove the key to connect without TLS")


__all__ = ["BrokerSettings", "apply_url_tls", "build_section", "check_tls_files", "load_broker_settings", "read_toml",
           "resolve_password", "system_ca_file"]
