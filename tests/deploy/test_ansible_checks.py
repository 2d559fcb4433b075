"""The playbook before any real host: syntax, ansible-lint's production profile, the inventory
checks that stop a bad rollout early, and board detection. None of these touch a host: the
inventories point at a chroot that does not exist, so a check that let a run through would fail
on the connection, never reach the network.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from tests.deploy.playbook import run_playbook
from tests.deploy.tools import ANSIBLE_DIR, REPO, run, tool

NOWHERE = "ansible_connection=community.general.chroot ansible_host=/nonexistent/edgefleet-root"


def ansible_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0", **extra}


def test_syntax_check_passes_on_the_example_inventory() -> None:
    result = run([tool("ansible-playbook"), "--syntax-check", "-i", str(ANSIBLE_DIR / "inventory.example.ini"),
                  str(ANSIBLE_DIR / "site.yml")], timeout_s=120, check=False, env=ansible_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "playbook: " in result.stdout


@pytest.mark.slow
def test_ansible_lint_production_profile_passes() -> None:
    result = run([tool("ansible-lint"), "--offline", "--profile", "production", "--nocolor", str(ANSIBLE_DIR)],
                 timeout_s=300, check=False, cwd=REPO, env=ansible_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Profile 'production' was required, and it passed" in output


BAD_INVENTORIES = {
    "no broker": (
        f"[raspberry_pi]\nboard-a edge_agent_board_id=pi-1 {NOWHERE}\n[boards:children]\nraspberry_pi\n",
        {},
        ["The inventory has no [broker] group.", "Add a [broker] group with the one host that runs Mosquitto"]),
    "board without id": (
        (f"[raspberry_pi]\nboard-a edge_agent_board_id=pi-1 {NOWHERE}\nboard-b {NOWHERE}\n[boards:children]\nraspberry_pi\n"
         f"[broker]\nbroker-a {NOWHERE}\n"),
        {},
        ["Board board-b has no id. Add edge_agent_board_id=<id> to its line in the inventory"]),
    "missing wheel": (
        f"[x86]\nboard-a edge_agent_board_id=nuc-1 {NOWHERE}\n[boards:children]\nx86\n[broker]\nbroker-a {NOWHERE}\n",
        {"edgefleet_wheel": "/nonexistent/edgefleet-9.9.9-py3-none-any.whl"},
        ["There is no wheel at edgefleet_wheel=/nonexistent/edgefleet-9.9.9-py3-none-any.whl",
         'Build it at the repository root with "python3 -m pip wheel --no-deps -w dist ."']),
}


@pytest.mark.parametrize("case", list(BAD_INVENTORIES))
def test_bad_input_stops_before_any_host_with_what_to_add(case: str, tmp_path: Path, wheel: Path) -> None:
    inventory_text, extra_vars, messages = BAD_INVENTORIES[case]
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(inventory_text)
    result = run_playbook(inventory, extra_vars={"edgefleet_wheel": str(wheel), **extra_vars}, env=ansible_env(),
                          timeout_s=180)
    assert result.returncode != 0, result.summary()
    flat = " ".join(result.output.split())  # Ansible wraps long messages
    for message in messages:
        assert message in flat, result.summary()
    assert "PLAY [Set up the MQTT broker]" not in result.output, result.summary()
    assert result.recap.keys() == {"localhost"}, result.summary()


def test_board_type_is_detected_from_the_board_files_or_taken_from_the_inventory(tmp_path: Path) -> None:
    tegra = tmp_path / "nv_tegra_release"
    tegra.write_text("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64\n")
    pi_model = tmp_path / "model"
    pi_model.write_bytes(b"Raspberry Pi 5 Model B Rev 1.0\0")  # as in /proc/device-tree: NUL-terminated
    missing = tmp_path / "missing"
    native = "x86" if platform.machine() in ("x86_64", "i386", "i686") else "generic"
    hosts = {
        "jetson-board": (tegra, missing, "auto", "jetson"),
        "pi-board": (missing, pi_model, "auto", "raspberry_pi"),
        "plain-board": (missing, missing, "auto", native),
        "overridden-board": (missing, pi_model, "jetson", "jetson"),
    }
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("".join(
        f"{name} edge_agent_tegra_release_file={t} edge_agent_device_tree_model_file={m} edge_agent_board_type={kind} "
        f"expected_board={expected} ansible_python_interpreter={sys.executable}\n"
        for name, (t, m, kind, expected) in hosts.items()))
    result = run_playbook(inventory, playbook=Path(__file__).parent / "playbooks/detect_board.yml", timeout_s=180,
                          env=ansible_env(ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles")))
    assert result.returncode == 0, result.summary()
    assert set(result.recap) == set(hosts) and all(r["failed"] == 0 for r in result.recap.values()), result.summary()
    assert "pi-board is a raspberry_pi board (detected)" in result.output
    assert "overridden-board is a jetson board (from the inventory)" in result.output
