"""``edge-coordinator demo``: a local fleet on an embedded broker, training LeNet-5 on digits.

Everything stays on 127.0.0.1: a private Mosquitto (or the in-process broker when Mosquitto is not
installed), three ``edge-agent`` processes with their own power models, a fresh fleet key, and the
real training path (signed commands, the TCP exchange, Lightning on every board).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edgefleet.coordinator.local_broker import start_local_broker
from edgefleet.coordinator.monitor import monitor_fleet
from edgefleet.launch import module_command
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.fleet_key import generate_key_hex
from edgefleet.transport.settings import BrokerSettings

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


@contextmanager
def local_fleet(count: int, workdir: Path, broker_address: str, key_file: Path) -> Iterator[list[str]]:
    """Start ``count`` agents; stop them all at the end, whatever happens."""
    procs, ids = [], []
    try:
        for board_id, idle_w, max_w in _board_ids(count):
            conf = workdir / f"{board_id}.toml"
            conf.write_text(f'board_id = "{board_id}"\n[power]\nsource = "estimated"\nidle_w = {idle_w}\nmax_w = {max_w}\n'
                            f'[security]\nfleet_key_file = "{key_file}"\n')
            log = (workdir / f"{board_id}.log").open("wb")
            procs.append(subprocess.Popen(module_command("edgefleet.agent", "--config", str(conf), "--broker", broker_address),
                                          stdout=log, stderr=subprocess.STDOUT))
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


def _wait_online(settings: BrokerSettings, ids: list[str], timeout_s: float = 60.0) -> None:
    with monitor_fleet(settings) as view:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            online = {r.board_id for r in view.rows() if r.state == "online"}
            if set(ids) <= online:
                return
            time.sleep(0.1)
    raise EdgeTrainError(f"the demo's agents did not come online within {timeout_s:.0f} s")


def run_demo(*, boards: int, seconds: float, fleet_only: bool, watch: Callable[..., None],
             run_root: Path = Path("runs")) -> int:
    from edgefleet.coordinator.train_cli import run_training_ui

    with start_local_broker() as broker:
        key_file = broker.workdir / "fleet.key"
        key_file.write_text(generate_key_hex() + "\n")
        os.chmod(key_file, 0o600)
        settings = BrokerSettings(host=broker.host, port=broker.port)
        print(f"broker={broker.address}  ({broker.kind}; in another terminal: "
              f"EDGEFLEET_BROKER={broker.address} edge-coordinator status --watch)")
        with local_fleet(boards, broker.workdir, broker.address, key_file) as ids:
            if fleet_only:
                with monitor_fleet(settings) as view:
                    watch(view, title=f"edgefleet demo @ {broker.address}  (Ctrl-C to stop)", seconds=seconds)
                return 0
            _wait_online(settings, ids)
            spec = _demo_spec(ids)
            print(f"training LeNet-5 on scikit-learn's digits on {len(ids)} local boards "
                  f"({DEMO_BATCH} samples each per step, {spec.total_steps} steps)")
            return run_training_ui(spec, run_root / spec.run_id, broker=settings,
                                   fleet_key=bytes.fromhex(key_file.read_text().strip()), resume=False)


def _demo_spec(ids: list[str]):  # type: ignore[no-untyped-def]
    import secrets

    from edgefleet.coordinator.training import TrainSpec
    from edgefleet.workloads.registry import build_dataset
    from edgefleet.workloads.sharding import GlobalBatchPlan

    batches = [DEMO_BATCH] * len(ids)
    steps_per_epoch = GlobalBatchPlan(len(build_dataset("digits", "train", {})), batches, 0).steps_per_epoch  # type: ignore[arg-type]
    # On a small machine the local boards share the cores: one torch thread each keeps them from fighting.
    threads = 1 if (os.cpu_count() or 1) <= len(ids) else 0
    return TrainSpec(run_id=f"demo-lenet5-digits-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}", boards=ids,
                     batch_sizes=batches, model="lenet5", dataset="digits", total_steps=DEMO_EPOCHS * steps_per_epoch,
                     steps_per_epoch=steps_per_epoch, batches_per_epoch=steps_per_epoch, seed=0, lr=DEMO_LR, threads=threads, checkpoint_every=100)
