"""A real rollout: ansible/site.yml applied to a Debian root over the chroot connection, the way an
SD-card image is baked, then the root booted with systemd-nspawn to see the fleet run.

One root plays every part (board, broker with TLS, coordinator), so one playbook run covers the
three roles. Services are not started during the build (edgefleet_image_build); the boot starts
them, and a rollout to the booted system (community.docker.nsenter, standing in for SSH to a
board) takes the path a running board takes. The tests run in file order: bake, inspect, boot,
roll out a change to the running system, then bake again with the same settings expecting no change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edgefleet.brokers.ports import free_port
from edgefleet.protocol.signing import CommandVerifier, sign_command
from edgefleet.transport.fleet_key import PRIVATE, load_board_keys, load_command_keys, load_fleet_key, public_key_text, read_key_file
from edgefleet.transport.settings import read_toml
from tests.deploy.certs import TlsFiles, make_broker_certificate
from tests.deploy.mqtt_probe import Probe, connack_reason
from tests.deploy.playbook import PlaybookRun, run_playbook
from tests.deploy.rootfs import (
    BootedImage,
    booted,
    chroot_env,
    copy_root,
    prepare_for_build,
)
from tests.deploy.tools import UNIT_FILE, require_root, run, tool
from tests.helpers import status_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BOARD_ID = "img-1"
PREFIX = "edgefleet/v1"


@dataclass
class Image:
    root: Path
    workdir: Path
    inventory: Path
    port: int  # the boards' listener; the coordinator's is the next port
    tls: TlsFiles
    first_run: PlaybookRun
    # What the root was last rolled out with: a later run with the same settings must change nothing.
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def credentials(self) -> Path:
        return self.workdir / "credentials"  # next to the inventory: the playbook's default

    @property
    def coordinator_port(self) -> int:
        return self.port + 1

    def secret(self, name: str) -> str:
        return (self.credentials / name).read_text().strip()

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def mode_owner(self, inside: str) -> tuple[str, str, str]:
        """Mode, user and group of a file, the names as the image's own passwd and group files say."""
        st = self.path(inside).stat()
        return oct(st.st_mode & 0o7777), self._name(st.st_uid, "passwd"), self._name(st.st_gid, "group")

    def _name(self, ident: int, table: str) -> str:
        for line in self.path(f"/etc/{table}").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[2] == str(ident):
                return fields[0]
        return str(ident)

    def require_baked(self) -> None:
        assert self.first_run.returncode == 0, "the first playbook run failed:\n" + self.first_run.summary()


CHROOT = "ansible_connection=community.general.chroot\nedgefleet_image_build=true"


def _two_free_ports() -> int:
    """A free port whose successor is free too (the broker's boards' and coordinator's listeners)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.create_server(("127.0.0.1", port + 1)):
                return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _inventory(root: Path, port: int, tls: TlsFiles, connection: str = CHROOT) -> str:
    return f"""\
[boards]
image edge_agent_board_id={BOARD_ID} edge_agent_board_type=raspberry_pi

[broker]
image mqtt_broker_address=127.0.0.1 mqtt_broker_listen_address=127.0.0.1

[coordinator]
image

[all:vars]
ansible_host={root}
{connection}
ansible_python_interpreter=/usr/bin/python3
ansible_become=false
edgefleet_broker_port={port}
edgefleet_coordinator_broker_port={port + 1}
edgefleet_tls_ca_file={tls.ca}
edgefleet_tls_cert_file={tls.cert}
edgefleet_tls_key_file={tls.key}
"""


@pytest.fixture(scope="module")
def image(base_root: Path, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    """The root after the playbook's first run (which the first test checks)."""
    require_root()
    for name in ("systemd-nspawn", "nsenter", "systemd-analyze", "openssl"):
        tool(name)
    workdir = tmp_path_factory.mktemp("image")
    root = copy_root(base_root, workdir / "root")
    try:
        prepare_for_build(root)
        tls = make_broker_certificate(workdir / "tls")
        port = _two_free_ports()
        inventory = workdir / "inventory.ini"
        inventory.write_text(_inventory(root, port, tls))
        settings: dict[str, object] = {"edgefleet_wheel": str(wheel)}
        first = run_playbook(inventory, extra_vars=settings, env=chroot_env(), log_path=workdir / "run1.log")
        yield Image(root, workdir, inventory, port, tls, first, settings)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 300 MB; the logs and credentials stay for a look


def test_first_run_installs_broker_agent_and_coordinator(image: Image) -> None:
    image.require_baked()
    recap = image.first_run.recap
    assert recap["image"]["failed"] == 0 and recap["image"]["unreachable"] == 0 and recap["image"]["changed"] > 0

    # The agent: its config from the template, with the board id from the inventory, and TLS on.
    toml = image.path("/etc/edge-agent/agent.toml").read_text()
    assert f'board_id = "{BOARD_ID}"' in toml and f'username = "{BOARD_ID}"' in toml
    assert f"port = {image.port}" in toml and 'tls_ca_file = "/etc/edge-agent/ca.crt"' in toml
    for name in ("agent.toml", "mqtt-password", "fleet.pub", "ca.crt"):
        assert image.mode_owner(f"/etc/edge-agent/{name}") == ("0o640", "root", "edge-agent"), name
    assert image.mode_owner("/etc/edge-agent") == ("0o750", "root", "edge-agent")
    # Secrets generated once on the controller and installed as they are kept there.
    assert image.path("/etc/edge-agent/mqtt-password").read_text().strip() == image.secret(f"mqtt/{BOARD_ID}.password")
    assert oct((image.credentials / "coordinator.key").stat().st_mode & 0o777) == "0o600"
    _check_command_keys(image)

    # The unit as shipped, the Raspberry Pi drop-in, enabled for boot.
    assert image.path("/etc/systemd/system/edge-agent.service").read_text() == UNIT_FILE.read_text()
    drop_in = image.path("/etc/systemd/system/edge-agent.service.d/board.conf").read_text()
    assert "SupplementaryGroups=video i2c" in drop_in and "DeviceAllow=/dev/vcio rw" in drop_in
    assert image.path("/etc/systemd/system/multi-user.target.wants/edge-agent.service").is_symlink()
    passwd = {line.split(":")[0]: line.split(":") for line in image.path("/etc/passwd").read_text().splitlines()}
    assert int(passwd["edge-agent"][2]) < 1000 and passwd["edge-agent"][6] == "/usr/sbin/nologin"
    assert image.path("/opt/edge-agent/venv/bin/edge-agent").exists()

    # The broker: hashed users for the board and the coordinator, its ACL, TLS only.
    users = dict(line.split(":", 1) for line in image.path("/etc/mosquitto/edgefleet.passwd").read_text().splitlines()
                 if line and not line.startswith("#"))
    assert set(users) == {BOARD_ID} and all(h.startswith("$7$101$") for h in users.values())
    coordinators = [line.split(":", 1)[0] for line in
                    image.path("/etc/mosquitto/edgefleet-coordinator.passwd").read_text().splitlines()
                    if line and not line.startswith("#")]
    assert coordinators == ["coordinator"]  # on a listener of its own: board users cannot log in there
    assert image.secret(f"mqtt/{BOARD_ID}.password") not in image.path("/etc/mosquitto/edgefleet.passwd").read_text()
    acl = image.path("/etc/mosquitto/edgefleet.acl").read_text()
    assert f"pattern write {PREFIX}/boards/%u/telemetry" in acl and f"topic write {PREFIX}/boards/+/cmd" in acl
    conf = image.path("/etc/mosquitto/conf.d/edgefleet.conf").read_text()
    assert "allow_anonymous false" in conf and f"listener {image.port} 127.0.0.1" in conf
    assert "certfile /etc/mosquitto/certs/broker.crt" in conf

    # The coordinator: its own MQTT user, its keys (so that train needs no key flags) and the command on the PATH.
    coordinator_toml = read_toml(image.path("/etc/edge-coordinator/coordinator.toml"))
    assert coordinator_toml["broker"]["username"] == "coordinator"
    assert coordinator_toml["security"] == {"fleet_key_file": "/etc/edge-coordinator/fleet.key",
                                            "board_keys_dir": "/etc/edge-coordinator/board-keys"}
    assert os.access(image.path("/usr/local/bin/edge-coordinator"), os.X_OK)


def _check_command_keys(image: Image) -> None:
    """By default the coordinator alone holds the key that signs commands; the board holds its public key."""
    # The board: ed25519-public lines only, no shared key (none is even made on the controller).
    fleet_pub = image.path("/etc/edge-agent/fleet.pub")
    lines = fleet_pub.read_text().split()
    assert lines[::2] == ["ed25519-public"] and not image.path("/etc/edge-agent/fleet.key").exists()
    assert not (image.credentials / "fleet.key").exists()
    agent_toml = read_toml(image.path("/etc/edge-agent/agent.toml"))
    assert agent_toml["security"]["fleet_key_file"] == "/etc/edge-agent/fleet.pub"
    # The coordinator: the private key made on the controller, readable by its group alone.
    fleet_key = image.path("/etc/edge-coordinator/fleet.key")
    assert image.mode_owner("/etc/edge-coordinator/fleet.key") == ("0o640", "root", "edge-coordinator")
    assert read_key_file(fleet_key).kind == PRIVATE and fleet_key.read_text() == image.secret("coordinator.key") + "\n"
    assert fleet_pub.read_text() == public_key_text(fleet_key)
    # What it signs, the board verifies.
    command = {"type": "ping", "run_id": "img"}
    body = CommandVerifier(load_command_keys(fleet_pub)).verify(sign_command(command, key=load_fleet_key(fleet_key)))
    assert body.items() >= command.items()
    # The board's own key stays on the board; its public key is on the controller and the coordinator.
    board_pub = public_key_text(image.path("/etc/edge-agent/board.key"))
    assert (image.credentials / "board-keys" / f"{BOARD_ID}.pub").read_text() == board_pub
    assert image.path(f"/etc/edge-coordinator/board-keys/{BOARD_ID}.pub").read_text() == board_pub
    assert load_board_keys(image.path("/etc/edge-coordinator/board-keys")) == \
        {BOARD_ID: (bytes.fromhex(board_pub.split()[1]),)}


def test_agent_config_checks_out_inside_the_image_as_the_service_user(image: Image) -> None:
    image.require_baked()
    result = run(["chroot", "--userspec=edge-agent:edge-agent", str(image.root), "/opt/edge-agent/venv/bin/edge-agent",
                  "--config", "/etc/edge-agent/agent.toml", "--check-config"], timeout_s=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("# config OK") and f'board_id = "{BOARD_ID}"' in result.stdout
    assert image.secret(f"mqtt/{BOARD_ID}.password") not in result.stdout  # shown as ***


def test_installed_unit_verifies_and_its_exposure_stays_at_most_4(image: Image) -> None:
    image.require_baked()
    analyze = tool("systemd-analyze")
    verify = run([analyze, "verify", f"--root={image.root}", "edge-agent.service"], timeout_s=60, check=False)
    assert (verify.stdout + verify.stderr).strip() == ""
    # With the Raspberry Pi drop-in (groups and devices) applied.
    security = run([analyze, "security", "--offline=yes", f"--root={image.root}", "--threshold=40", "edge-agent.service"],
                   timeout_s=60, check=False)
    assert security.returncode == 0, security.stdout + security.stderr


def test_booted_image_runs_the_fleet(image: Image) -> None:
    image.require_baked()
    with booted(image.root, image.workdir / "boot-fleet.log") as system:
        # The agent is up under its unit (Type=notify: active means it sent READY=1).
        wait_until(lambda: _agent_pid(system), timeout_s=60, what="edge-agent.service active")
        # Running as edge-agent, with the Raspberry Pi drop-in's sensor groups.
        status = system.run("cat", f"/proc/{_agent_pid(system)}/status").stdout
        sensor_gids = {system.run("getent", "group", name).stdout.split(":")[2] for name in ("video", "i2c")}
        assert re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)[1] == system.run("id", "-u", "edge-agent").stdout.strip()
        assert set(re.search(r"^Groups:\s*(.*)$", status, re.MULTILINE)[1].split()) >= sensor_gids

        # The coordinator on the image sees the board, through the broker, with its own credentials.
        row = _wait_for_board(system, lambda row: row.get("health") == "ok")
        assert row["state"] == "online"

        # And so does the controller, with the coordinator's generated password.
        password_file = image.workdir / "coordinator-password"
        password_file.write_text(image.secret("mqtt/coordinator.password"))
        host_config = image.workdir / "coordinator.toml"
        host_config.write_text(f'[broker]\nusername = "coordinator"\npassword_file = "{password_file}"\n'
                               f'tls_ca_file = "{image.tls.ca}"\n')
        assert status_json(f"127.0.0.1:{image.coordinator_port}", config=host_config).get(BOARD_ID, {}).get("state") == "online"

        # Nothing anonymous; a board may write under its own id only.
        assert connack_reason(image.port, image.tls.ca) == "Not authorized"
        # The probe below logs in as the board, whose client id is its user name there: the agent steps aside.
        system.run("systemctl", "stop", "edge-agent.service", check=True)
        _check_board_cannot_write_under_another_id(image)
        system.run("systemctl", "start", "edge-agent.service", check=True)


def test_rollout_to_the_running_board_changes_and_restarts_only_the_agent(image: Image) -> None:
    # The same playbook against the booted system (as over SSH to a board): services are really
    # started and restarted. The operator changes one setting; only agent.toml changes, and the
    # agent restarts with it.
    image.require_baked()
    with booted(image.root, image.workdir / "boot-rollout.log") as system:
        pid_before = wait_until(lambda: _agent_pid(system), timeout_s=60, what="edge-agent.service active")
        live = image.workdir / "inventory-live.ini"
        live.write_text(_inventory(image.root, image.port, image.tls,
                                   f"ansible_connection=community.docker.nsenter\nansible_nsenter_pid={system.init_pid}"))
        settings = {**image.settings, "edge_agent_telemetry_interval_s": 2.0}
        rollout = run_playbook(live, extra_vars=settings, env=chroot_env(), log_path=image.workdir / "run-live.log")
        image.settings = settings
        assert rollout.returncode == 0 and rollout.recap["image"]["failed"] == 0, rollout.summary()
        assert sorted(rollout.changed_tasks()) == ["edge_agent : Restart edge-agent", "edge_agent : Write agent.toml"], \
            rollout.summary()
        pid_after = wait_until(lambda: _agent_pid(system), timeout_s=60, what="edge-agent.service active again")
        assert pid_after != pid_before
        assert system.run("systemctl", "is-active", "mosquitto.service").stdout.strip() == "active"
        _wait_for_board(system, lambda row: row.get("interval_s") == 2.0 and row.get("health") == "ok")


def test_agent_rides_out_a_broker_outage(image: Image) -> None:
    image.require_baked()
    with booted(image.root, image.workdir / "boot-outage.log") as system:
        _wait_for_board(system, lambda row: row.get("health") == "ok")
        # The broker goes away: the unit stays up, the agent retries, the journal says why in one line.
        system.run("systemctl", "stop", "mosquitto.service", check=True)
        journal = wait_until(lambda: _cannot_connect_lines(system), timeout_s=60, what="a 'cannot connect' line in the journal")
        assert len(journal) == 1, journal  # one line per attempt window, not one per retry
        assert "check that the broker runs" in journal[0] and "Retrying" in journal[0]
        assert system.run("systemctl", "is-active", "edge-agent.service").stdout.strip() == "active"
        assert system.run("systemctl", "show", "-p", "NRestarts", "--value", "edge-agent.service").stdout.strip() == "0"


def _agent_pid(system: BootedImage) -> str:
    """The agent's PID once its unit is active (after READY=1), else empty."""
    if system.run("systemctl", "is-active", "edge-agent.service").stdout.strip() != "active":
        return ""
    return system.run("systemctl", "show", "-p", "MainPID", "--value", "edge-agent.service").stdout.strip()


def _wait_for_board(system: BootedImage, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The board's row in the image's own `edge-coordinator status --json`, once ``ready`` holds."""
    def row() -> dict[str, Any] | None:
        out = system.run("edge-coordinator", "status", "--json", "--wait", "2").stdout
        found = {r["board_id"]: r for r in json.loads(out or "[]")}.get(BOARD_ID)
        return found if found and ready(found) else None

    return wait_until(row, timeout_s=90, interval_s=0.5, what=f"{BOARD_ID} in edge-coordinator status")


def _cannot_connect_lines(system: BootedImage) -> list[str]:
    out = system.run("journalctl", "-u", "edge-agent.service", "--no-pager", "-o", "cat").stdout
    return [line for line in out.splitlines() if "cannot connect" in line]


def _check_board_cannot_write_under_another_id(image: Image) -> None:
    coordinator = Probe(image.coordinator_port, image.tls.ca, client_id="edgefleet:acl-watcher", username="coordinator",
                        password=image.secret("mqtt/coordinator.password"))
    board = Probe(image.port, image.tls.ca, client_id="edgefleet:acl-board", username=BOARD_ID,
                  password=image.secret(f"mqtt/{BOARD_ID}.password"))
    try:
        assert coordinator.connack.wait(10) and board.connack.wait(10)
        assert coordinator.reason == board.reason == "Success"
        coordinator.client.subscribe(f"{PREFIX}/boards/#", qos=1)
        assert coordinator.subscribed.wait(10)
        marker = uuid.uuid4().hex.encode()
        # In order on one connection: once the marker has arrived, the spoof would have too.
        board.client.publish(f"{PREFIX}/boards/someone-else/telemetry", b"spoof", qos=1)
        board.client.publish(f"{PREFIX}/boards/{BOARD_ID}/events", marker, qos=1)
        assert coordinator.wait_for(f"{PREFIX}/boards/{BOARD_ID}/events", marker, timeout_s=10)
        assert not [t for t, _ in coordinator.messages if "/someone-else/" in t]
    finally:
        board.close()
        coordinator.close()


def test_second_run_changes_nothing(image: Image) -> None:
    image.require_baked()
    second = run_playbook(image.inventory, extra_vars=image.settings, env=chroot_env(), log_path=image.workdir / "run2.log")
    assert second.returncode == 0, second.summary()
    assert second.recap["image"]["changed"] == 0, f"changed: {second.changed_tasks()}\n{second.summary()}"
    assert second.recap["image"]["failed"] == 0
