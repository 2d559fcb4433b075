"""Home Assistant discovery under the Ansible role's ACL for a board whose id holds a '.': its node_id is the
id made valid plus a short hash, which the ACL's ``%u`` pattern does not match, so the role gives such a
board its own line. The role rendered by Ansible itself, Debian's Mosquitto, a real agent logging in with
the role's password, and Home Assistant's read-only user reading the retained discovery configs. Then
``edge-coordinator forget`` with the role's coordinator credentials clears them all, discovery included."""

from __future__ import annotations

import importlib.util
import signal
import uuid
from pathlib import Path
from typing import Any

from edgefleet.agent.home_assistant import node_id_for
from edgefleet.brokers.ports import free_port
from edgefleet.coordinator.cli.main import main
from edgefleet.transport.mqtt_link import CLIENT_ID_PREFIX
from tests.conftest import AgentFactory
from tests.deploy.test_mosquitto_examples import ROLE, Broker, Client, debian_layout, into_temp, render_role, start
from tests.helpers import wait_until

BOARD = "pi.1"


def _role_filters() -> Any:
    spec = importlib.util.spec_from_file_location("mosquitto_passwd", ROLE / "filter_plugins" / "mosquitto_passwd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_roles_node_id_is_the_agents() -> None:
    ids = ["pi-1", "pi.1", "pi_1", "a.b.c", "x" * 63, "Orin.Nano-2"]
    assert [_role_filters().edgefleet_ha_node_id(i) for i in ids] == [node_id_for(i) for i in ids]


def test_a_board_with_a_dot_in_its_id_announces_itself_to_home_assistant(tmp_path: Path, agents: AgentFactory) -> None:
    conf_d = debian_layout(tmp_path)
    board_port, coordinator_port = free_port(), free_port()
    render_role(tmp_path, {"mqtt_broker_board_ids": [BOARD, "pi-2"], "mqtt_broker_port": board_port,
                           "mqtt_broker_coordinator_port": coordinator_port, "mqtt_broker_listen_address": "127.0.0.1",
                           "mqtt_broker_credentials_dir": str(tmp_path / "credentials"),
                           "mqtt_broker_home_assistant": True,
                           "mqtt_broker_readers": [{"name": "homeassistant", "password": "ha-secret"}]})
    conf = conf_d / "edgefleet.conf"
    conf.write_text(into_temp(conf.read_text(), tmp_path, {board_port: board_port, coordinator_port: coordinator_port}))
    broker = start(tmp_path, board_port, coordinator_port)
    secret = (tmp_path / "credentials" / "mqtt" / f"{BOARD}.password").read_text().strip()
    reader = Client(broker, coordinator_port, "edgefleet:homeassistant", "homeassistant", "ha-secret")
    try:
        reader.subscribe("homeassistant/#")
        password = tmp_path / "mqtt-password"
        password.write_text(secret + "\n")
        password.chmod(0o600)
        agent = agents.start(BOARD, f"127.0.0.1:{board_port}", config=(
            f'board_id = "{BOARD}"\n[broker]\nusername = "{BOARD}"\npassword_file = "{password}"\n'
            '[power]\nsource = "estimated"\n[telemetry]\ninterval_s = 0.5\nhome_assistant = true\n'))
        node = node_id_for(BOARD)
        found = wait_until(lambda: [t for t, _ in list(reader.messages) if t.startswith(f"homeassistant/sensor/{node}/")],
                           timeout_s=20, what=f"{BOARD}'s discovery configs under node_id {node}")
        assert found and all(t.endswith("/config") for t in found)
        assert f"topic write homeassistant/+/{node}/+/config" in (tmp_path / "etc" / "edgefleet.acl").read_text()
        assert node in agent.log()

        # Retired: its agent stopped, forget with the coordinator's credentials leaves nothing of it on the broker.
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=20) == 0
        coordinator_secret = (tmp_path / "credentials" / "mqtt" / "coordinator.password").read_text().strip()
        conf = tmp_path / "coordinator.toml"
        conf.write_text(f'[broker]\nusername = "coordinator"\npassword = "{coordinator_secret}"\n')
        assert main(["--config", str(conf), "--broker", f"127.0.0.1:{coordinator_port}", "forget", BOARD, "--yes"]) == 0
        left = _retained(broker, coordinator_port, coordinator_secret)  # as Home Assistant's user sees the broker
        assert [t for t in left if f"/{BOARD}/" in t or f"/{node}/" in t] == []
    finally:
        reader.close()
        broker.stop()


def _retained(broker: Broker, port: int, coordinator_secret: str) -> list[str]:
    """Every retained topic Home Assistant's read-only user sees (``#``: the boards and the discovery configs), read
    until a marker the coordinator publishes on a status topic comes back after them (the broker queues a
    subscription's retained messages before anything published later)."""
    reader = Client(broker, port, f"{CLIENT_ID_PREFIX}ha-{uuid.uuid4().hex[:6]}", "homeassistant", "ha-secret")
    coordinator = Client(broker, port, f"{CLIENT_ID_PREFIX}check-{uuid.uuid4().hex[:6]}", "coordinator", coordinator_secret)
    marker = f"edgefleet/v1/boards/_marker-{uuid.uuid4().hex[:8]}/status"
    try:
        reader.subscribe("#")
        coordinator.mqtt.publish(marker, b"m", qos=1)
        assert reader.wait_for(marker, b"m"), broker.log[-2000:]
        return [t for t, _ in reader.messages if t != marker]
    finally:
        reader.close()
        coordinator.close()
