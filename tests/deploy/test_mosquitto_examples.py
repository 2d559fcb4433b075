"""The shipped Mosquitto configurations start on a stock Debian Mosquitto, and do what they say.

Debian (and Raspberry Pi OS) run ``/etc/mosquitto/mosquitto.conf``, which sets the pid file,
persistence, its location and the log, then includes every ``conf.d/*.conf``. Both
``examples/mosquitto.conf`` and the Ansible broker role's ``edgefleet.conf.j2`` go in that
``conf.d``. Here the real ``/usr/sbin/mosquitto`` runs Debian's main file (its paths moved to a
temporary folder) with our file in its ``conf.d``; only paths and ports are rewritten, never
anything else, so a setting Mosquitto rejects (a duplicate, a comment after a value) fails here
as it would on a board.

Then real clients check what the files promise: nothing anonymous; a board's credentials work on
the boards' listener only, where its client id is its user name (so it cannot knock another board
off by taking its client id); every client id asked for must start with ``edgefleet:``, so the
coordinator's credentials cannot take a board's client id either; the coordinator can hold several
connections at once; a board writes only under its own id; a packet over ``max_packet_size`` is
refused. (tests/hostile/test_client_id_takeover.py attacks the example with a real agent.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.ports import free_port, wait_for_port
from edgefleet.transport.mqtt_link import CLIENT_ID_PREFIX, agent_client_id, coordinator_client_id
from tests.deploy.tools import ANSIBLE_DIR, REPO, tool

EXAMPLES = REPO / "examples"
ROLE = ANSIBLE_DIR / "roles" / "mqtt_broker"
PREFIX = "edgefleet/v1"
MAX_PACKET = 1048576
DEBIAN_MAIN_CONF = Path("/etc/mosquitto/mosquitto.conf")

# /etc/mosquitto/mosquitto.conf as Debian 12's mosquitto 2.0.11 ships it, its paths in ``{d}``.
DEBIAN_MAIN = """\
# Place your local configuration in /etc/mosquitto/conf.d/
#
# A full description of the configuration file is at
# /usr/share/doc/mosquitto/examples/mosquitto.conf.example

pid_file {d}/run/mosquitto.pid

persistence true
persistence_location {d}/lib/

log_dest file {d}/log/mosquitto.log

include_dir {d}/conf.d
"""
# Not Debian's: started by root, Mosquitto would drop to the "mosquitto" user, which cannot read
# pytest's private temporary folders. Ignored when not started by root.
TEST_ONLY = "user root\n"


def _directives(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_replica_of_debians_main_config_sets_what_debians_does() -> None:
    if not DEBIAN_MAIN_CONF.exists():
        pytest.skip(f"{DEBIAN_MAIN_CONF} is not here to compare with (not a Debian Mosquitto)")
    assert _directives(DEBIAN_MAIN.format(d="/x")) == _directives(DEBIAN_MAIN_CONF.read_text())


# --- a broker laid out as Debian lays it out -----------------------------------------------------


@dataclass
class Broker:
    """A real Mosquitto run from a Debian-like main config, with ``conf`` in its conf.d."""

    folder: Path
    proc: subprocess.Popen[bytes]
    board_port: int
    coordinator_port: int
    ca: Path | None = None

    @property
    def log(self) -> str:
        path = self.folder / "log" / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _mosquitto() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if found is None:
        pytest.fail("mosquitto is not installed: apt-get install mosquitto")
    return found


def debian_layout(folder: Path) -> Path:
    """The main config and its folders under ``folder``; returns the conf.d folder."""
    for sub in ("run", "lib", "log", "conf.d", "etc"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    main = DEBIAN_MAIN.format(d=folder)
    (folder / "mosquitto.conf").write_text(main.replace("\ninclude_dir", f"\n{TEST_ONLY}include_dir"))
    return folder / "conf.d"


def into_temp(conf: str, folder: Path, ports: dict[int, int]) -> str:
    """``conf`` with ``/etc/mosquitto/`` moved to ``folder/etc/`` and each ``listener PORT`` to a free loopback port.

    Nothing else changes, comments and values included. Every port the file listens on must be in ``ports``.
    """
    lines = []
    for line in conf.splitlines():
        moved = line
        if not line.startswith("#"):
            moved = line.replace("/etc/mosquitto/", f"{folder}/etc/")
            listener = re.fullmatch(r"listener (\d+)(?: \S+)?", moved)
            if listener:
                moved = f"listener {ports[int(listener[1])]} 127.0.0.1"
        lines.append(moved)
    return "\n".join(lines) + "\n"


def start(folder: Path, board_port: int, coordinator_port: int, ca: Path | None = None) -> Broker:
    """Run Mosquitto on ``folder/mosquitto.conf`` until both listeners accept connections (or fail with its log)."""
    log_file = folder / "stderr.log"
    with log_file.open("wb") as out:
        proc = subprocess.Popen([_mosquitto(), "-c", str(folder / "mosquitto.conf")], stdout=out, stderr=subprocess.STDOUT)
    broker = Broker(folder, proc, board_port, coordinator_port, ca)
    try:
        for port in (board_port, coordinator_port):
            try:
                wait_for_port("127.0.0.1", port, timeout_s=15, proc=proc, log_path=log_file)
            except Exception as exc:
                raise AssertionError(f"Mosquitto did not start: {exc}\n{broker.log[-3000:]}") from None
    except BaseException:
        broker.stop()
        raise
    return broker


def passwd(path: Path, users: dict[str, str]) -> None:
    """A Mosquitto password file made by mosquitto_passwd, as the example's comments say."""
    for i, (user, secret) in enumerate(users.items()):
        flags = ["-c"] if i == 0 else []
        subprocess.run([tool("mosquitto_passwd"), *flags, "-b", str(path), user, secret], check=True, capture_output=True,
                       timeout=30)


# --- clients ---------------------------------------------------------------------------------------


@dataclass
class Client:
    """One MQTT connection that records its CONNACK, disconnection and messages; never reconnects by itself."""

    broker: Broker
    port: int
    client_id: str
    username: str = ""
    password: str = ""
    connack: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)
    subscribed: threading.Event = field(default_factory=threading.Event)
    published: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    messages: list[tuple[str, bytes]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.mqtt = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id)
        if self.username:
            self.mqtt.username_pw_set(self.username, self.password)
        if self.broker.ca is not None:
            self.mqtt.tls_set(ca_certs=str(self.broker.ca), tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self.mqtt.reconnect_delay_set(120, 240)  # a kicked client stays off: the test sees it
        self.mqtt.on_connect = self._on_connect
        self.mqtt.on_disconnect = lambda *args: self.disconnected.set()
        self.mqtt.on_subscribe = lambda *args: self.subscribed.set()
        self.mqtt.on_publish = lambda *args: self.published.set()
        self.mqtt.on_message = self._on_message
        self.mqtt.connect("127.0.0.1", self.port, keepalive=30)
        self.mqtt.loop_start()
        assert self.connack.wait(15), f"no CONNACK for {self.username or 'anonymous'} on {self.port}:\n{self.broker.log}"

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object,
                    properties: object) -> None:
        self.reason = str(reason_code)
        self.connack.set()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self.arrived:
            self.messages.append((message.topic, message.payload))
            self.arrived.notify_all()

    def subscribe(self, topic: str) -> None:
        self.mqtt.subscribe(topic, qos=1)
        assert self.subscribed.wait(10), f"{self.username} could not subscribe to {topic}"

    def wait_for(self, topic: str, payload: bytes, timeout_s: float = 10) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: (topic, payload) in self.messages, timeout=timeout_s)

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


def check_broker(broker: Broker, secrets: dict[str, str], clients: list[Client], coordinator: str = "coordinator") -> None:
    """What the shipped configurations promise, checked with real clients (boards pi-1 and pi-2)."""
    def connect(port: int, client_id: str, user: str = "") -> Client:
        client = Client(broker, port, client_id, user, secrets.get(user, ""))
        clients.append(client)
        return client

    board_port, coordinator_port = broker.board_port, broker.coordinator_port
    # Nothing anonymous, on either listener.
    assert connect(board_port, f"{CLIENT_ID_PREFIX}anon-1").reason == "Not authorized"
    assert connect(coordinator_port, f"{CLIENT_ID_PREFIX}anon-2").reason == "Not authorized"
    # A board's credentials do not work on the coordinator's listener (so there, no board can take any client id).
    assert connect(coordinator_port, agent_client_id("pi-1"), "pi-2").reason == "Not authorized"

    pi1 = connect(board_port, agent_client_id("pi-1"), "pi-1")
    watcher = connect(coordinator_port, coordinator_client_id("watch"), coordinator)
    commander = connect(coordinator_port, coordinator_client_id("train"), coordinator)
    assert pi1.reason == watcher.reason == commander.reason == "Success"
    watcher.subscribe(f"{PREFIX}/boards/#")
    pi1.subscribe(f"{PREFIX}/boards/pi-1/cmd")

    def pi1_still_connected() -> None:
        marker = uuid.uuid4().hex.encode()
        pi1.mqtt.publish(f"{PREFIX}/boards/pi-1/telemetry", marker, qos=1)
        assert watcher.wait_for(f"{PREFIX}/boards/pi-1/telemetry", marker), broker.log
        assert not pi1.disconnected.is_set(), broker.log

    # pi-2's credentials with pi-1's client id: its client id becomes "pi-2", and pi-1 stays connected.
    pi2 = connect(board_port, agent_client_id("pi-1"), "pi-2")
    assert pi2.reason == "Success"
    pi1_still_connected()
    # The coordinator's credentials with pi-1's client id on the broker ("pi-1", its user name): refused, as is
    # any client id that does not start with the prefix, on either listener; pi-1 stays connected.
    assert connect(coordinator_port, "pi-1", coordinator).reason == "Not authorized"
    assert connect(board_port, "pi-2", "pi-2").reason == "Not authorized"
    pi1_still_connected()

    # Two coordinator connections at once, each kept: one watches, the other commands a board.
    command = uuid.uuid4().hex.encode()
    commander.mqtt.publish(f"{PREFIX}/boards/pi-1/cmd", command, qos=1)
    assert pi1.wait_for(f"{PREFIX}/boards/pi-1/cmd", command), broker.log
    assert not watcher.disconnected.is_set() and not commander.disconnected.is_set()

    # A board writes under its own id only (in order on one connection: the spoof would have come first).
    own = uuid.uuid4().hex.encode()
    pi2.mqtt.publish(f"{PREFIX}/boards/pi-1/telemetry", b"spoof", qos=1)
    pi2.mqtt.publish(f"{PREFIX}/boards/pi-2/events", own, qos=1)
    assert watcher.wait_for(f"{PREFIX}/boards/pi-2/events", own), broker.log
    assert (f"{PREFIX}/boards/pi-1/telemetry", b"spoof") not in watcher.messages

    # A packet over max_packet_size: the sender is disconnected and nothing reaches the coordinator.
    pi2.mqtt.publish(f"{PREFIX}/boards/pi-2/telemetry", b"x" * MAX_PACKET, qos=1)
    assert pi2.disconnected.wait(15), broker.log
    assert not [t for t, p in watcher.messages if len(p) >= MAX_PACKET]
    assert broker.proc.poll() is None, broker.log


# --- examples/mosquitto.conf -----------------------------------------------------------------------


def test_the_example_config_starts_on_debians_mosquitto_and_ties_client_ids_to_users(tmp_path: Path) -> None:
    example = (EXAMPLES / "mosquitto.conf").read_text()
    ports = {1883: free_port(), 1884: free_port()}
    assert {int(p) for p in re.findall(r"^listener (\d+)", example, re.MULTILINE)} == set(ports)
    assert re.search(rf"^max_packet_size {MAX_PACKET}$", example, re.MULTILINE)
    assert re.search(rf"^clientid_prefixes {CLIENT_ID_PREFIX}$", example, re.MULTILINE)
    conf_d = debian_layout(tmp_path)
    (conf_d / "edgefleet.conf").write_text(into_temp(example, tmp_path, ports))
    shutil.copy(EXAMPLES / "mosquitto.acl", tmp_path / "etc" / "edgefleet.acl")
    secrets = {"pi-1": "secret-1", "pi-2": "secret-2", "coordinator": "secret-c"}
    passwd(tmp_path / "etc" / "edgefleet.passwd", {u: secrets[u] for u in ("pi-1", "pi-2")})
    passwd(tmp_path / "etc" / "edgefleet-coordinator.passwd", {"coordinator": secrets["coordinator"]})

    broker = start(tmp_path, ports[1883], ports[1884])
    clients: list[Client] = []
    try:
        check_broker(broker, secrets, clients)
    finally:
        for client in clients:
            client.close()
        broker.stop()
    assert "Error" not in broker.log, broker.log


# --- the Ansible broker role's templates ---------------------------------------------------------


RENDER = """\
- name: Render the mqtt_broker role's files
  hosts: localhost
  connection: local
  gather_facts: false
  vars_files:
    - {role}/defaults/main.yml
    - {role}/vars/main.yml
  tasks:
    - name: Password files
      ansible.builtin.template:
        src: {role}/templates/edgefleet.passwd.j2
        dest: "{out}/etc/{{{{ item.file }}}}"
        mode: "0600"
      loop: "{{{{ mqtt_broker_password_files }}}}"
    - name: ACL
      ansible.builtin.template:
        src: {role}/templates/edgefleet.acl.j2
        dest: "{out}/etc/edgefleet.acl"
        mode: "0600"
    - name: Listeners
      ansible.builtin.template:
        src: {role}/templates/edgefleet.conf.j2
        dest: "{out}/conf.d/edgefleet.conf"
        mode: "0644"
"""


def render_role(folder: Path, settings: dict[str, object]) -> None:
    """The role's password files, ACL and conf.d file, rendered by Ansible itself with ``settings``."""
    playbook = folder / "render.yml"
    playbook.write_text(RENDER.format(role=ROLE, out=folder))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FILTER_PLUGINS": str(ROLE / "filter_plugins"),
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    done = subprocess.run([tool("ansible-playbook"), str(playbook), "-e", json.dumps(settings)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=folder, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_the_ansible_role_config_starts_on_debians_mosquitto_and_ties_client_ids_to_users(tmp_path: Path,
                                                                                         tls: bool) -> None:
    conf_d = debian_layout(tmp_path)
    board_port, coordinator_port = free_port(), free_port()
    settings: dict[str, object] = {
        "mqtt_broker_board_ids": ["pi-1", "pi-2"], "mqtt_broker_port": board_port,
        "mqtt_broker_coordinator_port": coordinator_port, "mqtt_broker_listen_address": "127.0.0.1",
        "mqtt_broker_credentials_dir": str(tmp_path / "credentials")}
    ca = None
    if tls:
        from tests.deploy.certs import make_broker_certificate

        files = make_broker_certificate(tmp_path / "tls")
        settings |= {"mqtt_broker_tls_ca_file": str(files.ca), "mqtt_broker_tls_cert_file": str(files.cert),
                     "mqtt_broker_tls_key_file": str(files.key)}
        certs = tmp_path / "etc" / "certs"  # where the role's tasks copy them
        certs.mkdir(parents=True)
        for source, name in ((files.ca, "ca.crt"), (files.cert, "broker.crt"), (files.key, "broker.key")):
            shutil.copy(source, certs / name)
        ca = files.ca
    render_role(tmp_path, settings)
    rendered = (conf_d / "edgefleet.conf").read_text()
    assert f"max_packet_size {MAX_PACKET}" in rendered and rendered.count("use_username_as_clientid true") == 1
    assert re.search(rf"^clientid_prefixes {CLIENT_ID_PREFIX}$", rendered, re.MULTILINE)
    assert rendered.count("cafile ") == (2 if tls else 0)  # TLS on both listeners, or on neither
    (conf_d / "edgefleet.conf").write_text(into_temp(rendered, tmp_path, {board_port: board_port,
                                                                         coordinator_port: coordinator_port}))
    secrets = {user: (tmp_path / "credentials" / "mqtt" / f"{user}.password").read_text().strip()
               for user in ("pi-1", "pi-2", "coordinator")}

    broker = start(tmp_path, board_port, coordinator_port, ca)
    clients: list[Client] = []
    try:
        check_broker(broker, secrets, clients)
    finally:
        for client in clients:
            client.close()
        broker.stop()
    assert "Error" not in broker.log, broker.log
