"""The coordinator's keys: --fleet-key and --board-keys, or the config file's [security] fleet_key_file and
board_keys_dir when the flags are not given."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edgefleet.coordinator.cli.config import load_coordinator_config
from edgefleet.coordinator.cli.shared import coordinator_keys
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.fleet_key import add_board_keys, load_fleet_key, private_key_text, public_key_text, write_new_key


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    fleet = tmp_path / "fleet.key"
    write_new_key(fleet, private_key_text())
    board_keys = tmp_path / "board-keys"
    board_keys.mkdir()
    own = tmp_path / "pi-1.key"
    write_new_key(own, private_key_text())
    (board_keys / "pi-1.pub").write_text(public_key_text(own))
    return fleet, board_keys


def test_the_config_files_board_keys_dir_stands_in_for_the_flag(tmp_path: Path) -> None:
    fleet, board_keys = _keys(tmp_path)
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[security]\nfleet_key_file = "{fleet}"\nboard_keys_dir = "{board_keys}"\n')
    cfg = load_coordinator_config(config)
    expected = add_board_keys(load_fleet_key(fleet), board_keys)
    assert coordinator_keys(argparse.Namespace(board_keys=None), cfg) == expected
    assert coordinator_keys(argparse.Namespace(board_keys=board_keys), cfg) == expected
    # Without either, events are not checked: the fleet key alone.
    plain = load_coordinator_config(None, fleet_key_file=str(fleet))
    assert coordinator_keys(argparse.Namespace(board_keys=None), plain) == load_fleet_key(fleet)


def test_a_board_keys_dir_that_is_not_there_is_named(tmp_path: Path) -> None:
    fleet, _ = _keys(tmp_path)
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[security]\nfleet_key_file = "{fleet}"\nboard_keys_dir = "{tmp_path / "nowhere"}"\n')
    with pytest.raises(ConfigError, match="nowhere"):
        coordinator_keys(argparse.Namespace(board_keys=None), load_coordinator_config(config))
