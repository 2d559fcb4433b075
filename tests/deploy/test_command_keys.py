"""The rollout's command keys, without a host: the coordinator's Ed25519 key that ansible/site.yml makes
on the controller, what the edge_agent and coordinator roles write about keys (rendered from their own
defaults and templates by playbooks/render_security.yml), and that a command the installed private key
signs is one the boards' installed public key accepts. test_image_bake.py checks the same on a real root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgefleet.agent.config import TelemetrySettings
from edgefleet.coordinator.cli.config import CoordinatorSecurity
from edgefleet.protocol.signing import CommandVerifier, sign_command
from edgefleet.transport.fleet_key import (
    PRIVATE,
    load_board_keys,
    load_command_keys,
    load_fleet_key,
    private_key_text,
    public_key_text,
    read_key_file,
)
from edgefleet.transport.settings import build_section, read_toml
from tests.deploy.playbook import run_playbook
from tests.deploy.tools import ANSIBLE_DIR

KEY_SCRIPT = ANSIBLE_DIR / "scripts" / "coordinator_key.py"
RENDER = Path(__file__).parent / "playbooks" / "render_security.yml"


def _key_script(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(KEY_SCRIPT), str(path)], capture_output=True, text=True, timeout=60, check=False)


def test_key_script_makes_the_coordinators_key_once_and_prints_only_its_public_key(tmp_path: Path) -> None:
    key = tmp_path / "credentials" / "coordinator.key"
    first = _key_script(key)
    assert first.returncode == 0, first.stderr
    made = json.loads(first.stdout)
    # A key file edgefleet reads as the coordinator's private key, secret on disk, its seed never printed.
    assert made == {"made": True, "public": public_key_text(key).strip()}
    assert read_key_file(key).kind == PRIVATE and read_key_file(key).secret.hex() not in first.stdout
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct(key.parent.stat().st_mode & 0o777) == "0o700"

    text = key.read_text()
    again = _key_script(key)
    assert again.returncode == 0 and json.loads(again.stdout) == {**made, "made": False}
    assert key.read_text() == text  # kept, never overwritten

    # A key made by hand in the same format is taken as it is.
    by_hand = tmp_path / "by-hand.key"
    by_hand.write_text(private_key_text())
    assert json.loads(_key_script(by_hand).stdout)["public"] == public_key_text(by_hand).strip()


def test_key_script_refuses_a_file_that_is_not_an_ed25519_private_key(tmp_path: Path) -> None:
    legacy = tmp_path / "coordinator.key"
    legacy.write_text("ab" * 32 + "\n")  # a shared HMAC key: it has no public key to give the boards
    result = _key_script(legacy)
    assert result.returncode == 1 and result.stdout == ""
    assert f"{legacy} is not the coordinator's key: it should hold one line 'ed25519-private <64 hex digits>'" in result.stderr
    assert "Move it away and run the playbook again" in result.stderr


INVENTORY = """\
[boards]
board-a edge_agent_board_id=pi-1 edge_agent_board=raspberry_pi edgefleet_home_assistant=true edgefleet_home_assistant_prefix=ha/fleet
board-b edge_agent_board_id=pi-2 edge_agent_board=raspberry_pi edgefleet_legacy_hmac=true

[broker]
broker-a mqtt_broker_address=127.0.0.1

[coordinator]
coord-a
coord-b edgefleet_legacy_hmac=true edge_agent_board_keys_dir=/nonexistent/board-keys

[all:vars]
ansible_python_interpreter={python}
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered files by host, after one run of playbooks/render_security.yml."""
    workdir = tmp_path_factory.mktemp("render")
    (workdir / "credentials" / "board-keys").mkdir(parents=True)  # as the edge_agent role fetches a board's key
    board_key = workdir / "pi-1.key"
    board_key.write_text(private_key_text())
    (workdir / "credentials" / "board-keys" / "pi-1.pub").write_text(public_key_text(board_key))
    wheel = workdir / "edgefleet-0.0.0-py3-none-any.whl"
    wheel.touch()  # the preflight checks only that it is there
    inventory = workdir / "inventory.ini"
    inventory.write_text(INVENTORY.format(python=sys.executable))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"}
    result = run_playbook(inventory, playbook=RENDER, env=env, timeout_s=180,
                          extra_vars={"edgefleet_wheel": str(wheel), "roles_dir": str(ANSIBLE_DIR / "roles"),
                                      "out_dir": str(workdir / "out")})
    assert result.returncode == 0, result.summary()
    return workdir


def _toml(path: Path) -> dict[str, Any]:
    return read_toml(path)


def _security(path: Path) -> CoordinatorSecurity:
    """coordinator.toml's [security] as edge-coordinator reads it (coordinator/cli/config.py; the [broker]
    section's password file is on the coordinator host only)."""
    data = _toml(path)
    assert set(data) == {"broker", "security"}
    return build_section(CoordinatorSecurity, data["security"], section="security", source=str(path))


def test_boards_get_the_coordinators_public_key_by_default_and_verify_its_commands(rendered: Path) -> None:
    key = rendered / "credentials" / "coordinator.key"
    assert read_key_file(key).kind == PRIVATE
    public_keys = json.loads((rendered / "out" / "board-a" / "command_public_keys.json").read_text())
    assert public_keys == [public_key_text(key).strip()]
    agent = _toml(rendered / "out" / "board-a" / "agent.toml")
    assert agent["security"]["fleet_key_file"] == "/etc/edge-agent/fleet.pub"
    assert not (rendered / "credentials" / "fleet.key").exists()  # no shared key is made

    # fleet.pub as the role writes it, and the coordinator's fleet.key as it is copied: they agree.
    fleet_pub = rendered / "fleet.pub"
    fleet_pub.write_text("\n".join(public_keys) + "\n")
    verifier = CommandVerifier(load_command_keys(fleet_pub))
    command = {"type": "ping", "run_id": "r1"}
    assert verifier.verify(sign_command(command, key=load_fleet_key(key))).items() >= command.items()
    assert not load_command_keys(fleet_pub).legacy


def test_boards_get_home_assistant_settings_from_the_fleet_wide_names(rendered: Path) -> None:
    on = _toml(rendered / "out" / "board-a" / "agent.toml")["telemetry"]
    off = _toml(rendered / "out" / "board-b" / "agent.toml")["telemetry"]
    assert (on["home_assistant"], on["home_assistant_prefix"]) == (True, "ha/fleet")
    assert (off["home_assistant"], off["home_assistant_prefix"]) == (False, "homeassistant")
    build_section(TelemetrySettings, on, section="telemetry", source="agent.toml")  # keys and values the agent takes


def test_legacy_hmac_only_when_asked_for(rendered: Path) -> None:
    assert json.loads((rendered / "out" / "board-b" / "command_public_keys.json").read_text()) == []
    assert _toml(rendered / "out" / "board-b" / "agent.toml")["security"]["fleet_key_file"] == "/etc/edge-agent/fleet.key"
    legacy = rendered / "out" / "coord-b" / "coordinator.toml"
    assert "legacy" in legacy.read_text()
    # No board keys on the controller there: job events go unchecked rather than every job refused.
    assert _security(legacy) == CoordinatorSecurity(fleet_key_file="/etc/edge-coordinator/fleet.key")
    assert json.loads((rendered / "out" / "coord-b" / "board_key_files.json").read_text()) == []


def test_coordinator_toml_names_its_key_and_the_boards_keys(rendered: Path) -> None:
    toml = rendered / "out" / "coord-a" / "coordinator.toml"
    assert _security(toml) == CoordinatorSecurity(
        fleet_key_file="/etc/edge-coordinator/fleet.key", board_keys_dir="/etc/edge-coordinator/board-keys")
    # The files the role copies there: one <board_id>.pub per board, as --board-keys reads them.
    assert json.loads((rendered / "out" / "coord-a" / "board_key_files.json").read_text()) == ["pi-1.pub"]
    assert set(load_board_keys(rendered / "credentials" / "board-keys")) == {"pi-1"}
