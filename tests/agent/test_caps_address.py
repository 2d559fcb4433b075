"""Where other boards reach this one (issue 35's stage links): the config's address, else the broker connection's."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.agent.caps import reachable_address
from edgefleet.agent.config import load_agent_config
from edgefleet.agent.daemon import Agent
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.address import HostPort
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import BoardCaps
from edgefleet.transport.mqtt_link import MqttLink, agent_client_id
from tests.helpers import wait_until


def _agent(tmp_path: Path, training: str) -> Agent:
    path = tmp_path / "agent.toml"
    path.write_text(f'board_id = "pi-7"\n[power]\nsource = "estimated"\n[training]\n{training}')
    return Agent(load_agent_config(path))


def test_the_configured_address_wins_over_the_connection(tmp_path: Path) -> None:
    agent = _agent(tmp_path, 'address = "pi-7.lab"\n')
    try:
        assert agent.caps.address == ""  # not known before the broker connection exists
        agent._update_address("127.0.0.1")
        assert agent.caps.address == "pi-7.lab"
        assert BoardCaps.from_json(agent.caps.to_json()).address == "pi-7.lab"
    finally:
        agent.sampler.close()


def test_without_one_the_connection_says_and_a_reconnect_renews_it(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "")
    try:
        agent._update_address("192.168.1.21")
        assert agent.caps.address == "192.168.1.21"
        agent._update_address("192.168.1.40")  # a new lease
        assert agent.caps.address == "192.168.1.40"
    finally:
        agent.sampler.close()


@pytest.mark.parametrize(("configured", "local", "expected"), [
    ("10.0.0.7", "127.0.0.1", "10.0.0.7"),
    ("", "192.168.1.21", "192.168.1.21"),
    ("", "::ffff:192.168.1.21", "192.168.1.21"),  # a dual-stack socket's IPv4 connection
    ("", "fe80::1%eth0", "fe80::1%eth0"),
    ("", "", ""),  # not connected: nothing to say
])
def test_reachable_address(configured: str, local: str, expected: str) -> None:
    assert reachable_address(configured, local) == expected


@pytest.mark.parametrize("address", ["192.168.1.21", "fe80::1%eth0", "::1", "pi-7", "pi-7.lab.example.", "localhost"])
def test_an_address_or_host_name_is_taken(tmp_path: Path, address: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[training]\naddress = "{address}"\n')
    assert load_agent_config(path).training.address == address


@pytest.mark.parametrize("address", ["pi 7", "-pi7", "pi_7.lab", "a..b", "1.2.3", "300.1.1.1", "x" * 64, "10.0.0.1:7000"])
def test_anything_else_is_refused_in_one_line_naming_the_key(tmp_path: Path, address: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[training]\naddress = "{address}"\n')
    with pytest.raises(ConfigError, match=r"\[training\]: address = .* is not an IP address or a host name") as caught:
        load_agent_config(path)
    assert "\n" not in str(caught.value)


def test_the_links_local_address_is_its_sockets(mosquitto: LocalBroker) -> None:
    cfg = load_agent_config(None, board_id="addr-1", broker=HostPort(mosquitto.host, mosquitto.port))
    link = MqttLink(cfg.broker, client_id=agent_client_id("addr-1"))
    assert link.local_address() == ""
    link.start()
    try:
        assert link.wait_connected(10)
        assert wait_until(link.local_address, timeout_s=5, what="the connection's local address") == "127.0.0.1"
    finally:
        link.close()
