"""``edge-coordinator``'s everyday habits: broker URLs (TLS from ``mqtts://``), a default config file,
no traceback into a closed pipe, shell completion, and ``forget`` for a retired board."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.coordinator.cli.config import default_config_path, load_coordinator_config
from edgefleet.coordinator.cli.main import build_parser, main
from edgefleet.protocol.address import HostPort, parse_broker
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import BoardStatus
from edgefleet.transport.mqtt_link import MqttLink

PREFIX = "edgefleet/v1"
CLI = [sys.executable, "-m", "edgefleet.coordinator.cli"]

# --- broker URLs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("mqtt://broker.lan", HostPort("broker.lan", 1883, tls=False)),
    ("mqtts://broker.lan", HostPort("broker.lan", 8883, tls=True)),
    ("MQTTS://broker.lan:9883/", HostPort("broker.lan", 9883, tls=True)),
    ("mqtt://[::1]:1884", HostPort("::1", 1884, tls=False)),
    ("10.0.0.2:1884", HostPort("10.0.0.2", 1884)),
])
def test_broker_urls_say_host_port_and_tls(text: str, expected: HostPort) -> None:
    assert parse_broker(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("ws://broker.lan", "scheme 'ws' is not supported"), ("mqtt://broker.lan/fleet", "no path"),
    ("mqtt://", "no host"), ("mqtts://broker.lan:x", "not a number"),
])
def test_bad_broker_urls_name_the_option_and_the_fix(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_broker(text, what="--broker")
    assert "--broker" in str(info.value)


@pytest.mark.parametrize("text", ["mqtts://pi:hunter2@broker.lan", "pi:hunter2@broker.lan:1883"])
def test_credentials_in_the_address_are_refused_without_echoing_them(text: str) -> None:
    with pytest.raises(ConfigError, match="config file's \\[broker\\] section") as info:
        parse_broker(text)
    assert "hunter2" not in str(info.value)


def test_mqtts_uses_the_system_ca_bundle_unless_the_file_names_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system_ca, own_ca = tmp_path / "system.pem", tmp_path / "own.pem"
    system_ca.write_text("x")
    own_ca.write_text("x")
    monkeypatch.setenv("SSL_CERT_FILE", str(system_ca))  # where OpenSSL, and so Python, finds the system bundle
    monkeypatch.delenv("EDGEFLEET_BROKER", raising=False)
    assert load_coordinator_config(None, broker=parse_broker("mqtts://b.lan")).broker.tls_ca_file == str(system_ca)
    conf = tmp_path / "c.toml"
    conf.write_text(f'[broker]\ntls_ca_file = "{own_ca}"\n')
    assert load_coordinator_config(conf, broker=parse_broker("mqtts://b.lan")).broker.tls_ca_file == str(own_ca)
    with pytest.raises(ConfigError, match="mqtt:// \\(no TLS\\)"):  # never a quiet downgrade to clear text
        load_coordinator_config(conf, broker=parse_broker("mqtt://b.lan"))


def test_an_mqtts_url_reaches_a_real_tls_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.deploy.certs import make_broker_certificate

    files = make_broker_certificate(tmp_path / "tls")
    tls = f"cafile {files.ca}\ncertfile {files.cert}\nkeyfile {files.key}\n"
    monkeypatch.setenv("SSL_CERT_FILE", str(files.ca))  # the test CA stands in for the system's bundle
    monkeypatch.delenv("EDGEFLEET_BROKER", raising=False)
    with start_mosquitto(extra_config=tls) as broker:
        settings = load_coordinator_config(None, broker=parse_broker(f"mqtts://127.0.0.1:{broker.port}")).broker
        link = MqttLink(settings, client_id=f"tls-{uuid.uuid4().hex[:8]}")
        link.start()
        try:
            assert link.wait_connected(10), broker.log_path.read_text()
        finally:
            link.close()


# --- the default config file ------------------------------------------------------------------------


def test_the_default_config_is_the_variables_else_the_users_else_the_systems(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    system, user = tmp_path / "etc" / "coordinator.toml", tmp_path / "xdg" / "edgefleet" / "coordinator.toml"
    monkeypatch.setattr("edgefleet.coordinator.cli.config.SYSTEM_CONFIG", system)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert default_config_path(env) is None
    system.parent.mkdir()
    system.write_text("[broker]\n")
    assert default_config_path(env) == (system, "the system default")
    user.parent.mkdir(parents=True)
    user.write_text("[broker]\n")
    assert default_config_path(env) == (user, "the user's default")
    named = tmp_path / "fleet.toml"
    named.write_text("[broker]\n")
    assert default_config_path({**env, "EDGEFLEET_CONFIG": str(named)}) == (named, "$EDGEFLEET_CONFIG")
    with pytest.raises(ConfigError, match="EDGEFLEET_CONFIG=.*does not exist"):  # a typo never falls back to another file
        default_config_path({**env, "EDGEFLEET_CONFIG": str(tmp_path / "typo.toml")})


def test_help_names_the_file_and_verbose_logs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from edgefleet.coordinator.cli.shared import load_config

    conf = tmp_path / "coordinator.toml"
    conf.write_text('[broker]\nhost = "from-the-file"\n')
    monkeypatch.setenv("EDGEFLEET_CONFIG", str(conf))
    monkeypatch.delenv("EDGEFLEET_BROKER", raising=False)
    assert f"(now{conf};" in "".join(build_parser().format_help().split())  # wrapped lines, even at a hyphen
    with caplog.at_level(logging.INFO, logger="edgefleet.coordinator.cli.shared"):
        cfg = load_config(argparse.Namespace(config=None, broker=None))
    assert cfg.broker.host == "from-the-file" and cfg.source == str(conf)
    assert f"config file {conf} ($EDGEFLEET_CONFIG)" in caplog.text


# --- a closed pipe ------------------------------------------------------------------------------------


def test_status_json_into_a_closed_pipe_ends_quietly(mosquitto: LocalBroker) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head -c 10` after its ten bytes: the command's write fails with EPIPE
    try:
        done = subprocess.run([*CLI, "--broker", mosquitto.address, "status", "--json", "--wait", "0"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


# --- shell completion -----------------------------------------------------------------------------------


def test_bash_accepts_the_completion_script_and_completes_commands_flags_and_choices() -> None:
    command = " ".join(CLI) + " completion bash"

    def complete(function: str, *words: str) -> str:
        array = " ".join(f"'{w}'" for w in words)
        return f'COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; {function}; echo "${{COMPREPLY[*]}}"'

    script = "; ".join([
        f"source <({command})", "complete -p edge-coordinator edge-agent",
        complete("_edgefleet_edge_coordinator", "edge-coordinator", "tr"),
        complete("_edgefleet_edge_coordinator", "edge-coordinator", "--broker", "h", "train", "--objective", "e"),
        complete("_edgefleet_edge_coordinator", "edge-coordinator", "forget", "--"),
        complete("_edgefleet_edge_agent", "edge-agent", "--che"),
    ])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["complete -F _edgefleet_edge_coordinator edge-coordinator", "complete -F _edgefleet_edge_agent edge-agent"]
    assert lines[2:] == ["train", "energy edp", "--help --yes --force", "--check-config"]


def test_the_zsh_script_runs_the_bash_functions_through_bashcompinit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", "zsh"]) == 0
    script = capsys.readouterr().out
    assert "bashcompinit" in script.splitlines()[1]
    assert "complete -F _edgefleet_edge_coordinator edge-coordinator" in script and "_edgefleet_edge_agent()" in script


# --- forget -----------------------------------------------------------------------------------------------


class Retained:
    """A plain MQTT client on the test broker that publishes and reads back retained messages."""

    def __init__(self, broker: LocalBroker) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"retained-{uuid.uuid4().hex[:8]}")
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def put(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)

    def under(self, board: str) -> list[str]:
        """The retained topics under ``board``, read after a marker proves the broker sent them all."""
        found: list[str] = []
        done = threading.Event()
        marker = f"{PREFIX}/boards/_marker-{uuid.uuid4().hex}/cmd"
        self.client.on_message = lambda c, u, m: done.set() if m.topic == marker else found.append(m.topic) if m.retain else None
        self.client.subscribe([(f"{PREFIX}/boards/{board}/#", 1), (marker, 1)])
        self.client.publish(marker, b"", qos=1)
        assert done.wait(10)
        self.client.unsubscribe(f"{PREFIX}/boards/{board}/#")
        return sorted(found)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def retained(mosquitto: LocalBroker) -> Iterator[Retained]:
    client = Retained(mosquitto)
    yield client
    client.close()


def _status(state: str) -> bytes:
    return BoardStatus(state=state, ts=1.0 if state != "offline" else None).to_json()


def test_forget_clears_every_retained_topic_of_a_retired_board(mosquitto: LocalBroker, retained: Retained,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    board, neighbour = f"retired-{uuid.uuid4().hex[:6]}", f"kept-{uuid.uuid4().hex[:6]}"
    for kind, payload in (("status", _status("offline")), ("caps", b'{"cores": 4}'), ("events/json", b'{"kind": "done"}')):
        retained.put(f"{PREFIX}/boards/{board}/{kind}", payload)
    retained.put(f"{PREFIX}/boards/{neighbour}/status", _status("offline"))

    assert main(["--broker", mosquitto.address, "forget", board, "--yes"]) == 0

    assert retained.under(board) == []
    assert retained.under(neighbour) == [f"{PREFIX}/boards/{neighbour}/status"]
    out = capsys.readouterr().out
    assert f"cleared 3 retained topic(s) of board {board}: caps, events/json, status" in out


def test_forget_refuses_an_online_board_without_force_and_asks_before_clearing(mosquitto: LocalBroker, retained: Retained,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    board = f"busy-{uuid.uuid4().hex[:6]}"
    retained.put(f"{PREFIX}/boards/{board}/status", _status("online"))

    assert main(["--broker", mosquitto.address, "forget", board, "--yes"]) == 1
    assert f"board {board} is online: stop its agent first" in capsys.readouterr().err
    assert main(["--broker", mosquitto.address, "forget", board, "--force"]) == 1  # stdin is no terminal to ask on
    assert "add --yes" in capsys.readouterr().err
    assert retained.under(board) == [f"{PREFIX}/boards/{board}/status"]

    assert main(["--broker", mosquitto.address, "forget", board, "--force", "--yes"]) == 0
    assert retained.under(board) == []
    assert main(["--broker", mosquitto.address, "forget", board, "--yes"]) == 1  # nothing left: says so
    assert "nothing to clear" in capsys.readouterr().err


def test_forget_says_so_when_the_brokers_acl_keeps_the_topics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acl, passwords = tmp_path / "acl", tmp_path / "passwd"
    acl.write_text(f"user coordinator\ntopic read {PREFIX}/boards/#\ntopic write {PREFIX}/boards/+/cmd\n"
                   f"user pi\ntopic readwrite {PREFIX}/#\n")  # a coordinator that may not clear anything
    for i, (user, secret) in enumerate((("coordinator", "c-secret"), ("pi", "p-secret"))):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwords), user, secret], check=True, timeout=30)
    conf = tmp_path / "coordinator.toml"
    conf.write_text('[broker]\nusername = "coordinator"\npassword = "c-secret"\n')
    with start_mosquitto(anonymous=False, extra_config=f"password_file {passwords}\nacl_file {acl}\n") as broker:
        board = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pi")
        board.username_pw_set("pi", "p-secret")
        board.connect(broker.host, broker.port)
        board.loop_start()
        try:
            board.publish(f"{PREFIX}/boards/old/caps", b"{}", qos=1, retain=True).wait_for_publish(10)
        finally:
            board.disconnect()
            board.loop_stop()

        assert main(["--config", str(conf), "--broker", broker.address, "forget", "old", "--yes"]) == 1

    err = capsys.readouterr().err
    assert f"the broker kept {PREFIX}/boards/old/caps: its ACL does not let user 'coordinator' write there" in err
