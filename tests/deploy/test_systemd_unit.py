"""systemd/edge-agent.service: what the issue asks of it, checked by systemd's own tools.

`systemd-analyze verify` exits 0 on unknown keys and bad values (it only prints them), so these
tests read its output. It also checks that ExecStart exists, so it runs against a scratch root
holding the host's units, the unit and a stand-in for the agent's executable.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import ANSIBLE_DIR, UNIT_FILE, run, tool

MAX_EXPOSURE = 4.0
AGENT = "opt/edge-agent/venv/bin/edge-agent"


def unit_settings(text: str) -> dict[str, list[str]]:
    """``{"Section.Key": [values…]}``; systemd keys may repeat, so every value is kept."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def verify_output(unit_text: str, scratch: Path) -> str:
    """What ``systemd-analyze verify`` prints about ``unit_text`` installed in a scratch root."""
    units = scratch / "usr/lib/systemd/system"
    if not units.exists():
        shutil.copytree("/usr/lib/systemd/system", units, symlinks=True)
        agent = scratch / AGENT
        agent.parent.mkdir(parents=True)
        agent.write_text("#!/bin/sh\n")
        agent.chmod(0o755)
    (scratch / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    (scratch / "etc/systemd/system/edge-agent.service").write_text(unit_text)
    result = run([tool("systemd-analyze"), "verify", f"--root={scratch}", "edge-agent.service"], timeout_s=60, check=False)
    return (result.stdout + result.stderr).strip()


def test_verify_prints_no_warning(tmp_path: Path) -> None:
    assert verify_output(UNIT_FILE.read_text(), tmp_path) == ""


def test_verify_check_catches_a_misspelt_key(tmp_path: Path) -> None:
    # The check above can fail: the same tool on a unit with a typo prints it.
    broken = UNIT_FILE.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict")
    assert "Unknown key 'ProtectSytem'" in verify_output(broken, tmp_path)


def test_security_exposure_is_at_most_4() -> None:
    result = run([tool("systemd-analyze"), "security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}",
                  str(UNIT_FILE)], timeout_s=60, check=False)
    match = re.search(r"Overall exposure level for edge-agent\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= MAX_EXPOSURE, result.stdout
    assert result.returncode == 0, result.stdout  # --threshold agrees


def test_unit_has_what_a_board_needs() -> None:
    s = unit_settings(UNIT_FILE.read_text())
    # The agent notifies READY=1 and pings WATCHDOG=1; a config error (78) is not worth a restart.
    assert s["Service.Type"] == ["notify"] and s["Service.WatchdogSec"]
    assert s["Service.Restart"] == ["on-failure"] and s["Service.RestartPreventExitStatus"] == ["78"]
    assert int(s["Service.RestartSec"][0].rstrip("s")) >= 5  # a back-off, not systemd's 100 ms loop
    assert s["Service.User"] == ["edge-agent"] and "Service.DynamicUser" not in s
    assert s["Service.StateDirectory"] == ["edge-agent"] and s["Service.ConfigurationDirectory"] == ["edge-agent"]
    assert s["Service.ExecStart"][0].startswith(f"/{AGENT} --config ")
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "CapabilityBoundingSet": "", "DevicePolicy": "closed"}.items():
        assert s[f"Service.{key}"] == [value], key
    assert set(s["Service.RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    # Sensor access is per board type, in the role's drop-in, not in the shared unit.
    assert "Service.SupplementaryGroups" not in s and "Service.PrivateDevices" not in s


@pytest.mark.parametrize("board", ["raspberry_pi", "jetson"])
def test_board_drop_in_grants_the_sensor_groups(board: str) -> None:
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/edge_agent/defaults/main.yml").read_text())
    access = defaults["edge_agent_board_access"][board]
    expected = {"raspberry_pi": ({"video", "i2c"}, {"/dev/vcio rw", "char-i2c rw"}), "jetson": ({"jtop"}, set())}[board]
    assert (set(access["groups"]), set(access["devices"])) == expected


def test_the_role_installs_this_very_unit() -> None:
    installed = ANSIBLE_DIR / "roles/edge_agent/files/edge-agent.service"
    assert installed.resolve() == UNIT_FILE.resolve()
