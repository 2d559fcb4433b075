"""The config the lab writes for each board's agent is one the real agent accepts, with the
board's power model labelled as an estimate and the board's own /sys. No root needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.agent.caps import read_board_model
from edgefleet.agent.config import load_agent_config
from edgefleet.lab.cgroups import Cgroup
from edgefleet.lab.fixtures import MIXED4
from edgefleet.lab.fleet_file import load_fleet
from edgefleet.lab.lab import (
    Board,
    Lab,
    agent_supports_cpu_scope,
    agent_supports_fleet_key,
    emulated_model,
    write_board_sysfs,
)
from edgefleet.lab.naming import board_address

pytestmark = pytest.mark.untimed  # it times nothing: it runs beside the other worker's tests (tests/conftest.py)


def _board(lab: Lab, tmp_path: Path, index: int = 0) -> Board:
    spec = lab.fleet.boards[index]
    return Board(spec=spec, index=index + 1, netns=f"efl-{spec.id}", address=board_address(index + 1), host_if="efl-v1",
                 cgroup=Cgroup("efl-lab/efl-x", {}), home=tmp_path / spec.id)


def test_the_agent_accepts_the_lab_s_config(tmp_path: Path) -> None:
    lab = Lab(load_fleet(MIXED4, host_cores=2), interval_s=0.5, keepalive_s=2)
    board = _board(lab, tmp_path)
    path = tmp_path / "agent.toml"
    path.write_text(lab.agent_config(board))

    cfg = load_agent_config(path)

    assert cfg.board_id == board.spec.id
    assert (cfg.power.source, cfg.power.idle_w, cfg.power.max_w) == ("estimated", board.spec.idle_w, board.spec.max_w)
    assert cfg.telemetry.interval_s == 0.5 and cfg.broker.keepalive_s == 2
    assert Path(cfg.telemetry.sysfs_root) == board.home / "sys"
    if agent_supports_cpu_scope():
        assert cfg.telemetry.cpu_scope == "cgroup"  # type: ignore[attr-defined]


def test_a_fleet_key_reaches_every_agent(tmp_path: Path) -> None:
    if not agent_supports_fleet_key():
        pytest.skip("this agent has no [security] section yet")
    key = tmp_path / "fleet.key"
    key.write_text("0" * 64 + "\n")
    lab = Lab(load_fleet(MIXED4, host_cores=2), fleet_key_file=key)
    path = tmp_path / "agent.toml"
    path.write_text(lab.agent_config(_board(lab, tmp_path, 2)))
    assert Path(load_agent_config(path).security.fleet_key_file) == key.resolve()  # type: ignore[attr-defined]


def test_each_board_publishes_what_it_imitates(tmp_path: Path) -> None:
    if Path("/proc/device-tree/model").exists():
        pytest.skip("this host has a device tree of its own, which the agent reads first")
    fleet = load_fleet(MIXED4, host_cores=2)
    for spec in fleet.boards:
        write_board_sysfs(tmp_path / spec.id / "sys", spec)
        model = read_board_model(tmp_path / spec.id / "sys")
        assert model == emulated_model(spec)
        assert spec.model in model and f"{spec.cpu:.2f} CPU" in model
