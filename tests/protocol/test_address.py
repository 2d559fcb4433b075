from __future__ import annotations

import pytest

from edgefleet.protocol.address import HostPort, broker_from_env, parse_host_port
from edgefleet.protocol.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ("localhost", HostPort("localhost", 1883)),
    ("10.0.0.2:1884", HostPort("10.0.0.2", 1884)),
    ("[::1]:8883", HostPort("::1", 8883)),
    ("[fe80::1]", HostPort("fe80::1", 1883)),
])
def test_parse(text: str, expected: HostPort) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"), (":1883", "no host"), ("host:abc", "not a number"), ("host:70000", "outside"), ("[::1", "missing ']'"),
])
def test_bad_addresses_name_the_option(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_host_port(text, what="--broker")
    assert "--broker" in str(info.value)


def test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEFLEET_BROKER", "broker.lan:1999")
    assert broker_from_env() == HostPort("broker.lan", 1999)
    monkeypatch.setenv("EDGEFLEET_BROKER", "broker.lan:x")
    with pytest.raises(ConfigError, match="EDGEFLEET_BROKER"):
        broker_from_env()
