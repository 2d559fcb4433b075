"""Valid credentials cannot knock a board off the broker by taking its client id.

Mosquitto keeps one client id namespace across all its listeners, and a connection that asks for an id
already connected takes that session over: the older connection is closed. On the boards' listener a
board's client id is its user name (``use_username_as_clientid``), so a board holding another board's
credentials only gets that other board's id. The coordinator's listener cannot do that (the coordinator
keeps several connections under one user), so there the coordinator's credentials (or a read-only
user's) could ask for a board's id, ``pi-1``, and disconnect the board: the shipped configurations
therefore admit only client ids that start with ``edgefleet:``, which no board id can.

Real Mosquitto run from the repo's own examples/mosquitto.conf and mosquitto.acl (only paths and ports
moved, as tests/deploy/test_mosquitto_examples.py does), real paho clients, and a real agent and
``edge-coordinator status`` logging in with their own credentials.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgefleet.brokers.ports import free_port
from edgefleet.transport.mqtt_link import agent_client_id, coordinator_client_id
from tests.conftest import AgentFactory
from tests.deploy.test_mosquitto_examples import EXAMPLES, Broker, Client, debian_layout, into_temp, passwd, start
from tests.helpers import status_json, wait_until

PREFIX = "edgefleet/v1"
SECRETS = {"pi-1": "secret-1", "pi-2": "secret-2", "coordinator": "secret-c"}


@dataclass
class Shipped:
    broker: Broker
    folder: Path
    clients: list[Client]

    def connect(self, port: int, client_id: str, user: str) -> Client:
        client = Client(self.broker, port, client_id, user, SECRETS[user])
        self.clients.append(client)
        return client

    def password_file(self, user: str) -> Path:
        path = self.folder / f"{user}.password"
        path.write_text(SECRETS[user] + "\n")
        path.chmod(0o600)
        return path


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[Shipped]:
    """examples/mosquitto.conf in a Debian-like conf.d, with its ACL and password files as its comments say."""
    ports = {1883: free_port(), 1884: free_port()}
    conf_d = debian_layout(tmp_path)
    (conf_d / "edgefleet.conf").write_text(into_temp((EXAMPLES / "mosquitto.conf").read_text(), tmp_path, ports))
    shutil.copy(EXAMPLES / "mosquitto.acl", tmp_path / "etc" / "edgefleet.acl")
    passwd(tmp_path / "etc" / "edgefleet.passwd", {u: SECRETS[u] for u in ("pi-1", "pi-2")})
    passwd(tmp_path / "etc" / "edgefleet-coordinator.passwd", {"coordinator": SECRETS["coordinator"]})
    broker = start(tmp_path, ports[1883], ports[1884])
    running = Shipped(broker, tmp_path, [])
    try:
        yield running
    finally:
        for client in running.clients:
            client.close()
        broker.stop()


@pytest.mark.parametrize("user", ["coordinator", "pi-2"])
def test_credentials_with_a_boards_client_id_do_not_disconnect_the_board(shipped: Shipped, user: str) -> None:
    broker = shipped.broker
    board = shipped.connect(broker.board_port, agent_client_id("pi-1"), "pi-1")
    watcher = shipped.connect(broker.coordinator_port, coordinator_client_id("watch"), "coordinator")
    assert board.reason == watcher.reason == "Success", broker.log
    watcher.subscribe(f"{PREFIX}/boards/pi-1/telemetry")

    # "pi-1" is the board's client id on the broker (its user name); the agent asks for agent_client_id("pi-1").
    port = broker.coordinator_port if user == "coordinator" else broker.board_port
    for client_id in ("pi-1", agent_client_id("pi-1")):
        shipped.connect(port, client_id, user)  # returns once the broker has answered (a takeover comes first)
        # The board's connection is still the one it opened: a message it sends now arrives (a closed one would
        # never deliver it, and its client waits 120 s before it reconnects).
        marker = uuid.uuid4().hex.encode()
        board.mqtt.publish(f"{PREFIX}/boards/pi-1/telemetry", marker, qos=1)
        assert watcher.wait_for(f"{PREFIX}/boards/pi-1/telemetry", marker), \
            f"{user}'s credentials with client id {client_id!r} disconnected pi-1:\n{broker.log[-3000:]}"
        assert not board.disconnected.is_set(), broker.log[-3000:]
    assert "pi-1 already connected" not in broker.log, broker.log[-3000:]


def test_the_real_agent_and_coordinator_log_in_and_the_coordinators_credentials_cannot_take_the_boards_id(
        shipped: Shipped, agents: AgentFactory) -> None:
    broker = shipped.broker
    agent = agents.start("pi-1", f"127.0.0.1:{broker.board_port}", config=(
        f'board_id = "pi-1"\n[broker]\nusername = "pi-1"\npassword_file = "{shipped.password_file("pi-1")}"\n'
        '[power]\nsource = "estimated"\n[telemetry]\ninterval_s = 0.5\n'))
    coordinator_config = shipped.folder / "coordinator.toml"
    coordinator_config.write_text(f'[broker]\nusername = "coordinator"\n'
                                  f'password_file = "{shipped.password_file("coordinator")}"\n')
    coordinator_broker = f"127.0.0.1:{broker.coordinator_port}"
    wait_until(lambda: status_json(coordinator_broker, config=coordinator_config).get("pi-1", {}).get("state") == "online",
               timeout_s=30, interval_s=0.2, what=f"pi-1 online in edge-coordinator status\n{agent.log()}\n{broker.log}")

    # The coordinator's credentials asking for the board's client id: today's takeover would have closed the
    # agent's connection (which reconnects a second later and takes it back, closing the attacker's).
    attacker = shipped.connect(broker.coordinator_port, "pi-1", "coordinator")
    assert attacker.reason == "Not authorized", broker.log[-3000:]
    assert "pi-1 already connected" not in broker.log, broker.log[-3000:]
    assert status_json(coordinator_broker, config=coordinator_config).get("pi-1", {}).get("state") == "online"
    assert agent.proc.poll() is None, agent.log()
