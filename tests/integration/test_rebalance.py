"""Re-splitting the global batch during a run, through real agents, a real broker and the real CLI.

The global batch of every step stays the same samples however it is divided, so a run whose split
changes at step 8 trains the same model as one process on the whole batch (fp32 wire, SGD,
relative error <= 1e-5 after 20 steps, as in test_training.py). The split is forced with the
train command's test hook ``--force-split STEP:B,B,…`` and ``--no-rebalance`` keeps the timing-driven
re-balancer out, so that the schedule is known in advance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.coordinator.exchange.server import SPLIT_LEAD_STEPS
from edgefleet.transport.fleet_key import generate_key_hex
from tests.conftest import AgentFactory
from tests.helpers import interrupt_after
from tests.integration.test_training import (
    MODEL_OPTIONS,
    SEED,
    _max_relative_error,
    _plain_training,
)

BOARDS = ("r1", "r2", "r3")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalBroker, Path]]:
    """A broker, a fleet key and three training boards."""
    tmp = tmp_path_factory.mktemp("rebalance")
    key = tmp / "fleet.key"
    key.write_text(generate_key_hex() + "\n")
    key.chmod(0o600)
    factory = AgentFactory(tmp)
    with start_mosquitto() as broker:
        for board in BOARDS:
            config = f'board_id = "{board}"\n[security]\nfleet_key_file = "{key}"\n[power]\nsource = "estimated"\n'
            factory.start(board, broker.address, config=config)
        try:
            yield broker, key
        finally:
            factory.stop_all()


def _train_cmd(broker: LocalBroker, key: Path, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", broker.address, "train", "--fleet-key", str(key),
            "--model", "lenet5", "--model-options", MODEL_OPTIONS, "--dataset", "digits", "--seed", str(SEED),
            "--threads", "1", "--run-dir", str(run_dir), *args]


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_a_forced_resplit_at_step_8_trains_the_same_model_as_one_process(fleet, tmp_path: Path) -> None:
    broker, key = fleet
    run_dir = tmp_path / "resplit"

    done = subprocess.run(_train_cmd(broker, key, run_dir, "--boards", ",".join(BOARDS), "--batch", "8,16,24",
                                     "--steps", "20", "--no-rebalance", "--force-split", "8:20,20,8"),
                          capture_output=True, text=True, timeout=240, check=False)

    assert done.returncode == 0, done.stderr + done.stdout
    reference = _plain_training(20, 48)
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert _max_relative_error(model, reference) <= 1e-5
    lines = _lines(run_dir)
    assert [line["step"] for line in lines] == list(range(20))      # still one line per step
    announced_at = 8 - SPLIT_LEAD_STEPS - 1                          # the result of step 6 carried it
    assert [line["step"] for line in lines if "rebalance" in line] == [announced_at]
    rebalance = lines[announced_at]["rebalance"]
    assert rebalance["from_step"] == 8
    assert rebalance["old_batch_sizes"] == {"r1": 8, "r2": 16, "r3": 24}
    assert rebalance["new_batch_sizes"] == {"r1": 20, "r2": 20, "r3": 8}
    for line in lines:   # every board switched exactly at step 8, and every step had all 48 samples
        expected = {"r1": 8, "r2": 16, "r3": 24} if line["step"] < 8 else {"r1": 20, "r2": 20, "r3": 8}
        assert line["batch_sizes"] == expected and line["n"] == 48, line
    assert "step 5: re-balancing from step 8: forced re-split" in done.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert {b: r["batch_size"] for b, r in result["boards"].items()} == {"r1": 20, "r2": 20, "r3": 8}
    assert [r["from_step"] for r in result["rebalances"]] == [8]


def test_a_resumed_run_continues_with_the_split_in_force_at_its_checkpoint(fleet, tmp_path: Path) -> None:
    broker, key = fleet
    run_dir = tmp_path / "interrupted"
    args = ("--boards", "r1,r2", "--batch", "16,32", "--steps", "30", "--checkpoint-every", "5", "--no-rebalance",
            "--force-split", "6:40,8")
    code, out, err = interrupt_after(_train_cmd(broker, key, run_dir, *args), lambda: len(_lines(run_dir)), 10,
                                     what="10 steps of the interrupted run")
    assert code == 130, err + out
    stopped_at = json.loads((run_dir / "result.json").read_text())["steps"]
    assert 10 <= stopped_at < 30

    resumed = subprocess.run(_train_cmd(broker, key, run_dir, "--resume", str(run_dir)), capture_output=True, text=True,
                             timeout=240, check=False)

    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert "continuing with batch sizes 40,8" in resumed.stdout
    lines = _lines(run_dir)
    assert [line["step"] for line in lines] == list(range(30))
    assert all(line["batch_sizes"] == ({"r1": 16, "r2": 32} if line["step"] < 6 else {"r1": 40, "r2": 8})
               for line in lines), [line["batch_sizes"] for line in lines]
    assert [line["step"] for line in lines if "rebalance" in line] == [6 - SPLIT_LEAD_STEPS - 1]  # not announced twice
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert _max_relative_error(model, _plain_training(30, 48)) <= 1e-5
