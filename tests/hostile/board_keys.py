"""Keys for tests that run ``train --board-keys``: the coordinator's key, the boards' copy of its public half,
each board's own key and the ``--board-keys`` directory; an agent's config with them; the train command."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.transport.fleet_key import private_key_text, public_key_text, write_new_key
from tests.helpers import train_command


@dataclass(frozen=True)
class FleetKeys:
    """Where a test fleet's keys are: ``own[board]`` is the key the coordinator holds the public half of."""

    fleet_key: Path
    fleet_pub: Path
    own: dict[str, Path]
    board_keys: Path


def make_keys(tmp_path: Path, boards: list[str]) -> FleetKeys:
    """A new coordinator key and a key per board, each board's public key in the ``--board-keys`` directory."""
    fleet_key, fleet_pub, board_keys = tmp_path / "fleet.key", tmp_path / "fleet.pub", tmp_path / "board-keys"
    write_new_key(fleet_key, private_key_text())
    fleet_pub.write_text(public_key_text(fleet_key))
    board_keys.mkdir()
    own = {}
    for board in boards:
        own[board] = new_key(tmp_path / f"{board}.key")
        (board_keys / f"{board}.pub").write_text(public_key_text(own[board]))
    return FleetKeys(fleet_key, fleet_pub, own, board_keys)


def new_key(path: Path) -> Path:
    """A new Ed25519 private key at ``path`` (as a board makes its own at install time); ``path``."""
    write_new_key(path, private_key_text())
    return path


def agent_config(board: str, keys: FleetKeys, own: Path | None) -> str:
    """An agent config trusting the coordinator's key and signing its events with ``own`` (None: unsigned)."""
    board_key = f'board_key_file = "{own}"\n' if own is not None else ""
    return (f'board_id = "{board}"\n[power]\nsource = "estimated"\n[security]\nfleet_key_file = "{keys.fleet_pub}"\n'
            f"{board_key}")


def start_train(broker: LocalBroker, keys: FleetKeys, run_dir: Path, boards: str, steps: int = 12) -> subprocess.Popen[str]:
    """``edge-coordinator train --board-keys`` on LeNet-5 and digits, running."""
    cmd = train_command("--board-keys", str(keys.board_keys), broker=broker, fleet_key=keys.fleet_key, boards=boards,
                        model="lenet5", dataset="digits", steps=steps, batch=8, threads=1, run_dir=run_dir)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    """Wait for ``proc``: (exit code, stdout, stderr); kills it and fails the test after ``timeout_s``."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"train still running after {timeout_s:.0f} s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return proc.returncode, out, err
