"""The demo's fleet (``edge-coordinator demo``): a private broker, local agents, and the job they train.

Everything stays on 127.0.0.1: a private Mosquitto (or the in-process broker when Mosquitto is not
installed), ``edge-agent`` processes with their own power models, fresh keys, and the real training
path (signed commands, the TCP exchange, Lightning on every board).

The keys are made as a real fleet's are: the coordinator's Ed25519 key signs the commands and the
boards hold only its public key (``fleet.pub``); every board has a key of its own that signs its
job events, and the coordinator checks each event against that board's public key (``board-keys/``).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgefleet.brokers.local_broker import start_local_broker
from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import resolve_job
from edgefleet.launch import module_command
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.fleet_key import (
    BOARD_KEY_SUFFIX,
    add_board_keys,
    load_fleet_key,
    private_key_text,
    public_key_text,
    write_new_key,
)
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

# Power models of the demo's boards (estimated, and labelled so): idle and full-load watts.
_DEMO_BOARDS = [("demo-pi4", 2.7, 6.4), ("demo-pi5", 3.0, 9.5), ("demo-nano", 1.9, 10.0), ("demo-x86", 8.0, 35.0)]
DEMO_EPOCHS = 8        # at this rate LeNet-5 on digits passes 95% validation accuracy after 3 epochs
DEMO_BATCH = 16        # per board
DEMO_LR = 5e-3         # Adam; measured on 8 epochs at global batch 48: 96-98% from epoch 3 on


def _board_ids(count: int) -> list[tuple[str, float, float]]:
    boards = []
    for i in range(count):
        board_id, idle_w, max_w = _DEMO_BOARDS[i % len(_DEMO_BOARDS)]
        suffix = f"-{i // len(_DEMO_BOARDS) + 1}" if i >= len(_DEMO_BOARDS) else ""
        boards.append((board_id + suffix, idle_w, max_w))
    return boards


def make_board_key(workdir: Path, board_id: str, board_keys_dir: Path) -> Path:
    """A board's own key (``workdir/<id>.key``, mode 600) and its public key in ``board_keys_dir/<id>.pub``."""
    key_file = workdir / f"{board_id}.key"
    key_file.unlink(missing_ok=True)
    write_new_key(key_file, private_key_text())
    board_keys_dir.mkdir(parents=True, exist_ok=True)
    (board_keys_dir / f"{board_id}{BOARD_KEY_SUFFIX}").write_text(public_key_text(key_file))
    return key_file


@contextmanager
def local_fleet(count: int, workdir: Path, broker_address: str, key_file: Path,
                board_keys_dir: Path | None = None) -> Iterator[list[str]]:
    """Start ``count`` agents that verify commands with ``key_file``; stop them all at the end, whatever happens.

    With ``board_keys_dir``, each board gets a key of its own, which signs its events, and its public key there.
    """
    procs, ids = [], []
    try:
        for board_id, idle_w, max_w in _board_ids(count):
            conf = workdir / f"{board_id}.toml"
            board_key = ("" if board_keys_dir is None else
                         f'board_key_file = "{make_board_key(workdir, board_id, board_keys_dir)}"\n')
            conf.write_text(f'board_id = "{board_id}"\n[power]\nsource = "estimated"\nidle_w = {idle_w}\nmax_w = {max_w}\n'
                            f'[security]\nfleet_key_file = "{key_file}"\n{board_key}')
            agent_log = (workdir / f"{board_id}.log").open("wb")
            procs.append(subprocess.Popen(module_command("edgefleet.agent", "--config", str(conf), "--broker", broker_address),
                                          stdout=agent_log, stderr=subprocess.STDOUT))
            ids.append(board_id)
        yield ids
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoFleet:
    """A running demo fleet: its private broker and the agents on it."""

    broker: BrokerSettings
    address: str                 # host:port of the broker
    kind: str                    # which broker: Mosquitto or the in-process one
    boards: list[str]
    fleet_key: bytes             # the coordinator's key, with every board's public key (events are checked)


@contextmanager
def demo_fleet(boards: int) -> Iterator[DemoFleet]:
    """Start a private broker and ``boards`` agents with fresh keys; stop everything at the end."""
    if boards < 1:
        raise EdgeTrainError("--boards must be at least 1")
    with start_local_broker() as broker:
        key_file, public_file = broker.workdir / "fleet.key", broker.workdir / "fleet.pub"
        key_file.unlink(missing_ok=True)
        write_new_key(key_file, private_key_text())  # the coordinator's: it signs the commands
        public_file.write_text(public_key_text(key_file))  # what the boards verify them with
        board_keys = broker.workdir / "board-keys"
        settings = BrokerSettings(host=broker.host, port=broker.port)
        with local_fleet(boards, broker.workdir, broker.address, public_file, board_keys) as ids:
            yield DemoFleet(broker=settings, address=broker.address, kind=broker.kind, boards=ids,
                            fleet_key=add_board_keys(load_fleet_key(key_file), board_keys))


def wait_online(fleet: DemoFleet, timeout_s: float = 60.0) -> None:
    """Wait until every demo agent says it is online. Raises EdgeTrainError after ``timeout_s``."""
    with monitor_fleet(fleet.broker) as view:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            online = {r.board_id for r in view.rows() if r.state == "online"}
            if set(fleet.boards) <= online:
                return
            time.sleep(0.1)
    raise EdgeTrainError(f"the demo's agents did not come online within {timeout_s:.0f} s")


def demo_job(boards: list[str]) -> JobSpec:
    """LeNet-5 on digits for :data:`DEMO_EPOCHS` epochs, :data:`DEMO_BATCH` samples per board per step."""
    # On a small machine the local boards share the cores: one torch thread each keeps them from fighting.
    threads = 1 if (os.cpu_count() or 1) <= len(boards) else 0
    spec = JobSpec(run_id=f"demo-lenet5-digits-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}",
                   model="lenet5", dataset="digits", boards=tuple(boards), batch_sizes=(DEMO_BATCH,), epochs=DEMO_EPOCHS,
                   seed=0, lr=DEMO_LR, threads=threads, checkpoint_every=100)
    return resolve_job(spec)


__all__ = ["DEMO_BATCH", "DEMO_EPOCHS", "DEMO_LR", "DemoFleet", "demo_fleet", "demo_job", "local_fleet", "make_board_key", "wait_online"]
