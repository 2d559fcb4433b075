"""``edge-coordinator forget`` against a real agent that announced itself to Home Assistant: afterwards the
broker holds no retained topic of the board's at all, its discovery configs included (else Home Assistant
keeps a ghost device), and another integration's config under the same node_id is left alone."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.coordinator.cli.main import main
from edgefleet.protocol.topics import discovery_node_id
from tests.conftest import AgentFactory
from tests.helpers import wait_until

PREFIX = "edgefleet/v1"
EXAMPLE_ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto.acl"


def every_retained(broker: LocalBroker, user: tuple[str, str] | None = None) -> dict[str, bytes]:
    """Every retained message the broker holds (subscribed to ``#``), read until a marker proves it sent them all."""
    found: dict[str, bytes] = {}
    done = threading.Event()
    marker = f"{PREFIX}/boards/_marker-{uuid.uuid4().hex}/cmd"

    def on_message(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == marker:
            done.set()
        elif message.retain and message.payload:
            found[message.topic] = bytes(message.payload)

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"every-retained-{uuid.uuid4().hex[:8]}")
    client.on_message = on_message
    if user is not None:
        client.username_pw_set(*user)
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        # One connection's packets in order: the marker comes back after every retained message of the subscription.
        client.subscribe([("#", 1)])
        client.publish(marker, b"", qos=1)
        assert done.wait(10), "the marker did not come back"
    finally:
        client.disconnect()
        client.loop_stop()
    return found


def of_board(retained: dict[str, bytes], board: str) -> list[str]:
    node = discovery_node_id(board)
    return sorted(t for t in retained if f"/boards/{board}/" in t or f"/{node}/" in t)


@pytest.mark.parametrize("name", ["ha-gone", "ha.gone"])  # a '.' makes the node_id another string than the id
def test_forget_leaves_no_retained_topic_of_the_board_discovery_included(mosquitto: LocalBroker, agents: AgentFactory,
                                                                         capsys: pytest.CaptureFixture[str],
                                                                         name: str) -> None:
    board = f"{name}-{uuid.uuid4().hex[:6]}"
    node = discovery_node_id(board)
    agent = agents.start(board, mosquitto.address, config=(f'board_id = "{board}"\n[power]\nsource = "estimated"\n'
                                                           '[telemetry]\ninterval_s = 0.2\nhome_assistant = true\n'))
    wanted = {f"homeassistant/sensor/{node}/{o}/config" for o in ("state", "energy_wh", "cpu_percent", "net_rx_bytes_per_s")}
    wait_until(lambda: wanted <= set(every_retained(mosquitto)), timeout_s=20, what=f"{board}'s discovery configs")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=20) == 0
    # Another integration's device that happens to use the same node_id: not the board's, so it stays.
    foreign = f"homeassistant/sensor/{node}/other/config"
    stranger = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"stranger-{uuid.uuid4().hex[:8]}")
    stranger.connect(mosquitto.host, mosquitto.port)
    stranger.loop_start()
    try:
        stranger.publish(foreign, json.dumps({"name": "x", "state_topic": "s", "device": {"identifiers": ["zigbee_1"]}}),
                         qos=1, retain=True).wait_for_publish(10)
        before = of_board(every_retained(mosquitto), board)
        assert {f"{PREFIX}/boards/{board}/status", f"{PREFIX}/boards/{board}/caps", *wanted, foreign} <= set(before)
        discovery = [t for t in before if t.startswith("homeassistant/") and t != foreign]

        assert main(["--broker", mosquitto.address, "forget", board, "--yes"]) == 0

        assert of_board(every_retained(mosquitto), board) == [foreign]
        out = capsys.readouterr().out
        assert (f"cleared {len(discovery) + 2} retained topic(s) of board {board}: caps, status; {len(discovery)} Home "
                f"Assistant discovery config(s) under homeassistant/+/{node}/") in out
    finally:
        stranger.publish(foreign, b"", qos=1, retain=True).wait_for_publish(10)
        stranger.disconnect()
        stranger.loop_stop()


def test_the_example_acl_lets_the_coordinator_forget_a_boards_discovery_configs(tmp_path: Path) -> None:
    # examples/mosquitto.acl as shipped, plus an inspector that may read everything (to see what is left).
    acl, passwords = tmp_path / "acl", tmp_path / "passwd"
    acl.write_text(EXAMPLE_ACL.read_text() + "\nuser inspector\ntopic readwrite #\n")
    users = {"coordinator": "c-secret", "pi-9": "p-secret", "inspector": "i-secret"}
    for i, (user, secret) in enumerate(users.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwords), user, secret], check=True,
                       timeout=30)
    conf = tmp_path / "coordinator.toml"
    conf.write_text('[broker]\nusername = "coordinator"\npassword = "c-secret"\n')
    with start_mosquitto(anonymous=False, extra_config=f"password_file {passwords}\nacl_file {acl}\n") as broker:
        board = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pi-9")
        board.username_pw_set("pi-9", "p-secret")
        board.connect(broker.host, broker.port)
        board.loop_start()
        config = {"name": "CPU", "state_topic": f"{PREFIX}/boards/pi-9/telemetry", "device": {"identifiers": ["edgefleet_pi-9"]}}
        try:
            for topic, payload in ((f"{PREFIX}/boards/pi-9/status", b'{"state": "offline"}'),
                                   ("homeassistant/sensor/pi-9/cpu_percent/config", json.dumps(config).encode()),
                                   ("homeassistant/binary_sensor/pi-9/throttled_now/config", json.dumps(config).encode())):
                board.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        finally:
            board.disconnect()
            board.loop_stop()
        assert len(every_retained(broker, ("inspector", "i-secret"))) == 3  # the board's ACL let it write all three

        assert main(["--config", str(conf), "--broker", broker.address, "forget", "pi-9", "--yes"]) == 0

        assert every_retained(broker, ("inspector", "i-secret")) == {}
