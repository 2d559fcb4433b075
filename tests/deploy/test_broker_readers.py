"""The Ansible broker role's read-only users (``mqtt_broker_readers``) on a real Mosquitto.

The role's own templates and filter plugin are rendered with Jinja2 as Ansible's template module
renders them (``trim_blocks``, the ``comment`` filter, the password lookup that keeps generated
secrets in the credentials folder), which takes milliseconds where ``ansible-playbook`` takes
seconds; test_mosquitto_examples.py renders the same templates with Ansible itself. The broker runs
Debian's main config with the role's file in its ``conf.d``, and real clients check the promise:
a reader (each way of giving its password) reads every board's telemetry, status, caps, JSON events
and Home Assistant discovery configs, never a command, and everything it publishes is refused,
including the topics the ACL's per-user patterns would give it under its own name.
"""

from __future__ import annotations

import importlib.util
import random
import string
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import paho.mqtt.client as mqtt
import pytest
import yaml
from jinja2.nativetypes import NativeEnvironment
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.ports import free_port
from tests.deploy.test_mosquitto_examples import PREFIX, ROLE, Broker, Client, debian_layout, into_temp, start
from tests.deploy.tools import tool

HA_PREFIX = "homeassistant"
NOT_AUTHORIZED = 0x87  # MQTT 5 reason code in a PUBACK for a publish the ACL refused


# --- the role's templates, rendered as Ansible renders them ---------------------------------------


def _filter_plugin() -> Any:
    spec = importlib.util.spec_from_file_location("mosquitto_passwd", ROLE / "filter_plugins" / "mosquitto_passwd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _password_lookup(name: str, path: str, *, length: int, chars: list[str]) -> str:
    """ansible.builtin.password: the secret kept in ``path``, generated there on first use."""
    assert name == "ansible.builtin.password"
    file = Path(path)
    if not file.exists():
        alphabet = "".join(getattr(string, c) for c in chars)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("".join(random.SystemRandom().choice(alphabet) for _ in range(length)) + "\n")
    return file.read_text().split()[0]


def _to_bool(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _holds_undefined(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_undefined(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_undefined(v) for v in value.values())
    return isinstance(value, jinja2.Undefined)


def role_vars(settings: dict[str, Any]) -> dict[str, Any]:
    """The role's defaults and vars with ``settings`` as extra vars, every template in them resolved."""
    raw = {**yaml.safe_load((ROLE / "defaults" / "main.yml").read_text()),
           **yaml.safe_load((ROLE / "vars" / "main.yml").read_text()), **settings}
    env = NativeEnvironment(undefined=jinja2.StrictUndefined)
    env.filters["bool"] = _to_bool
    resolved: dict[str, Any] = {"groups": {}, "hostvars": {}, "inventory_dir": "/nonexistent"}

    def render(value: Any) -> Any:
        if isinstance(value, str) and "{{" in value:
            out = env.from_string(value).render(resolved)
            if _holds_undefined(out):  # native rendering hands back an undefined name instead of raising
                raise jinja2.UndefinedError(value)
            return out
        if isinstance(value, list):
            return [render(v) for v in value]
        if isinstance(value, dict):
            return {k: render(v) for k, v in value.items()}
        return value

    pending = dict(raw)
    while pending:  # a value that names one not resolved yet waits for the next pass
        done = {}
        for key, value in pending.items():
            try:
                done[key] = render(value)
            except jinja2.UndefinedError:
                continue
        assert done, f"role variables that never resolve: {sorted(pending)}"
        resolved.update(done)
        pending = {k: v for k, v in pending.items() if k not in done}
    return resolved


def render_role(folder: Path, settings: dict[str, Any]) -> None:
    """The password files, the ACL and the conf.d file where test_mosquitto_examples.render_role puts them."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"), trim_blocks=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["mosquitto_passwd_hash"] = _filter_plugin().mosquitto_passwd_hash
    env.filters["comment"] = lambda text: f"#\n# {text}\n#"
    env.filters["bool"] = _to_bool
    env.globals["lookup"] = _password_lookup
    context = {**role_vars(settings), "ansible_managed": "Ansible managed"}
    for item in context["mqtt_broker_password_files"]:
        (folder / "etc" / item["file"]).write_text(env.get_template("edgefleet.passwd.j2").render(context, item=item))
    (folder / "etc" / "edgefleet.acl").write_text(env.get_template("edgefleet.acl.j2").render(context))
    (folder / "conf.d" / "edgefleet.conf").write_text(env.get_template("edgefleet.conf.j2").render(context))


# --- an MQTT 5 client, which hears the broker refuse a publish --------------------------------------


@dataclass
class Reader:
    """An MQTT 5 connection that records messages and each publish's PUBACK reason code."""

    port: int
    username: str
    password: str
    connected: threading.Event = field(default_factory=threading.Event)
    subscribed: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    acks: dict[int, int] = field(default_factory=dict)
    messages: list[tuple[str, bytes]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.mqtt = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"edgefleet:reader-{uuid.uuid4().hex[:8]}",
                                protocol=mqtt.MQTTv5)
        self.mqtt.username_pw_set(self.username, self.password)
        self.mqtt.reconnect_delay_set(120, 240)
        self.mqtt.on_connect = self._on_connect
        self.mqtt.on_publish = self._on_publish
        self.mqtt.on_subscribe = lambda *args: self.subscribed.set()
        self.mqtt.on_message = self._on_message
        self.mqtt.connect("127.0.0.1", self.port, keepalive=30)
        self.mqtt.loop_start()
        assert self.connected.wait(15), f"no CONNACK for {self.username}"

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: Any, properties: object) -> None:
        self.reason = str(reason_code)
        self.connected.set()

    def _on_publish(self, client: mqtt.Client, userdata: object, mid: int, reason_code: Any, properties: object) -> None:
        with self.changed:
            self.acks[mid] = reason_code.value
            self.changed.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self.changed:
            self.messages.append((message.topic, message.payload))
            self.changed.notify_all()

    def subscribe(self, *filters: str) -> None:
        self.mqtt.subscribe([(f, 1) for f in filters])
        assert self.subscribed.wait(10), f"{self.username} could not subscribe"

    def publish_qos1(self, topic: str, payload: bytes) -> int:
        """The reason code of the broker's PUBACK."""
        mid = self.mqtt.publish(topic, payload, qos=1).mid
        with self.changed:
            assert self.changed.wait_for(lambda: mid in self.acks, timeout=10), f"no PUBACK for {topic}"
            return self.acks[mid]

    def wait_for(self, topic: str, payload: bytes) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: (topic, payload) in self.messages, timeout=10)

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


# --- the test -----------------------------------------------------------------------------------------


def _hash_by_mosquitto_passwd(folder: Path, user: str, password: str) -> str:
    file = folder / "made-by-mosquitto_passwd"
    subprocess.run([tool("mosquitto_passwd"), "-c", "-b", str(file), user, password], check=True, capture_output=True, timeout=30)
    return file.read_text().strip().split(":", 1)[1]


@pytest.fixture
def broker(tmp_path: Path) -> Any:
    conf_d = debian_layout(tmp_path)
    board_port, coordinator_port = free_port(), free_port()
    readers = [{"name": "grafana"},  # password generated into credentials/mqtt/, like the boards'
               {"name": "homeassistant", "password": "ha-secret"},
               {"name": "telegraf", "password_hash": _hash_by_mosquitto_passwd(tmp_path, "telegraf", "tg-secret")}]
    render_role(tmp_path, {"mqtt_broker_board_ids": ["pi-1"], "mqtt_broker_port": board_port,
                           "mqtt_broker_coordinator_port": coordinator_port, "mqtt_broker_listen_address": "127.0.0.1",
                           "mqtt_broker_credentials_dir": str(tmp_path / "credentials"), "mqtt_broker_readers": readers,
                           "mqtt_broker_home_assistant": True})
    conf = conf_d / "edgefleet.conf"
    conf.write_text(into_temp(conf.read_text(), tmp_path, {board_port: board_port, coordinator_port: coordinator_port}))
    running = start(tmp_path, board_port, coordinator_port)
    yield running
    running.stop()
    assert "Error" not in running.log, running.log


def test_a_read_only_user_reads_the_fleet_and_is_refused_when_it_publishes(broker: Broker, tmp_path: Path) -> None:
    secret = {user: (tmp_path / "credentials" / "mqtt" / f"{user}.password").read_text().strip()
              for user in ("pi-1", "coordinator", "grafana")}
    board = Client(broker, broker.board_port, "edgefleet:agent:pi-1", "pi-1", secret["pi-1"])
    coordinator = Client(broker, broker.coordinator_port, "edgefleet:coordinator-test", "coordinator", secret["coordinator"])
    readers = [Reader(broker.coordinator_port, "grafana", secret["grafana"]),
               Reader(broker.coordinator_port, "homeassistant", "ha-secret"),
               Reader(broker.coordinator_port, "telegraf", "tg-secret")]
    outsider = Client(broker, broker.board_port, "edgefleet:reader-on-boards-port", "grafana", secret["grafana"])
    try:
        # Each way of giving a reader's password logs in, on the coordinator's listener only.
        assert [r.reason for r in readers] == ["Success"] * 3, broker.log
        assert outsider.reason == "Not authorized"
        grafana = readers[0]
        board.subscribe(f"{PREFIX}/boards/pi-1/cmd")
        coordinator.subscribe(f"{PREFIX}/boards/#")
        for reader in readers:
            reader.subscribe(f"{PREFIX}/#", f"{HA_PREFIX}/#")

        # Execute: the board publishes everything a reader may read; the coordinator commands it.
        command = uuid.uuid4().hex.encode()
        coordinator.mqtt.publish(f"{PREFIX}/boards/pi-1/cmd", command, qos=1)
        assert board.wait_for(f"{PREFIX}/boards/pi-1/cmd", command), broker.log
        published = {f"{PREFIX}/boards/pi-1/status": b'{"state": "busy"}', f"{PREFIX}/boards/pi-1/caps": b'{"cores": 4}',
                     f"{PREFIX}/boards/pi-1/events/json": b'{"kind": "progress"}',
                     f"{HA_PREFIX}/sensor/pi-1/cpu_percent/config": b'{"name": "CPU"}',
                     f"{PREFIX}/boards/pi-1/telemetry": b'{"cpu_percent": 12.5}'}
        for topic, payload in published.items():
            board.mqtt.publish(topic, payload, qos=1, retain=not topic.endswith(("telemetry", "json")))

        # Assert: every reader reads them all (telemetry last), and never the command before them.
        for reader in readers:
            for topic, payload in published.items():
                assert reader.wait_for(topic, payload), f"{reader.username} did not receive {topic}: {reader.messages}"
            assert not [t for t, _ in reader.messages if t.endswith("/cmd")], reader.messages

        # Everything a reader publishes is refused: MQTT 5 answers 0x87, QoS 0 is dropped silently.
        spoofs = [f"{PREFIX}/boards/pi-1/cmd", f"{PREFIX}/boards/pi-1/telemetry", f"{PREFIX}/boards/pi-1/status",
                  f"{PREFIX}/boards/grafana/telemetry",  # what the boards' pattern gives user "grafana"
                  f"{HA_PREFIX}/sensor/grafana/x/config", f"{HA_PREFIX}/sensor/pi-1/cpu_percent/config"]
        grafana.mqtt.publish(f"{PREFIX}/boards/pi-1/cmd", b"spoof-qos0", qos=0)
        assert [grafana.publish_qos1(topic, b"spoof") for topic in spoofs] == [NOT_AUTHORIZED] * len(spoofs)

        # ...and reaches no one: the broker handles one connection's packets in order, so these
        # fresh messages arrive after anything the reader's would have become.
        again = uuid.uuid4().hex.encode()
        coordinator.mqtt.publish(f"{PREFIX}/boards/pi-1/cmd", again, qos=1)
        assert board.wait_for(f"{PREFIX}/boards/pi-1/cmd", again)
        board.mqtt.publish(f"{PREFIX}/boards/pi-1/telemetry", again, qos=1)
        assert coordinator.wait_for(f"{PREFIX}/boards/pi-1/telemetry", again)
        assert grafana.wait_for(f"{PREFIX}/boards/pi-1/telemetry", again)
        heard = board.messages + coordinator.messages + [m for r in readers for m in r.messages]
        assert not [m for m in heard if m[1].startswith(b"spoof")], heard
        assert not [t for t, _ in grafana.messages if "grafana" in t]
    finally:
        for client in (board, coordinator, outsider):
            client.close()
        for reader in readers:
            reader.close()
