"""A ResNet with BatchNorm trains and converges on the emulated fleet, with DDP's meaning.

Three boards of unequal CPU quotas train ``examples/my_fleet_job/resnet.py`` (used unchanged) on
scikit-learn's digits with batches proportional to their quotas: each board normalises with its
own slice (the split is fixed: --no-rebalance), and after every step every replica holds the first
board's running statistics, which the coordinator's replica then validates with (eval mode). The
user's package reaches the boards as it would with ``pip install`` on each: here through
PYTHONPATH. On this machine the accuracy by epoch went 0.13, 0.32, 0.54, 0.85, 0.74, 0.91, 0.93, 0.95.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edgefleet.lab.fleet_file import FleetError, parse_fleet
from edgefleet.lab.lab import Lab, agent_supports_fleet_key
from tests.helpers import train_command, write_fleet_key
from tests.lab.quota_fleet import quota_fleet_toml

pytestmark = pytest.mark.untimed  # it times nothing: it runs beside the other worker's tests (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
QUOTAS = {"big": 0.70, "mid": 0.50, "small": 0.25}
BATCHES = {"big": 30, "mid": 22, "small": 12}
EPOCHS = 8
LR = 0.02
MIN_ACCURACY = 0.9


def test_a_resnet_with_batchnorm_converges_on_the_lab(tmp_path: Path, no_lab: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if not agent_supports_fleet_key():
        pytest.skip("this edge-agent has no [security] section: it can't verify training commands")
    try:
        fleet = parse_fleet(quota_fleet_toml("batchnorm", QUOTAS), source="batchnorm fleet")
    except FleetError as exc:
        pytest.skip(f"the fleet does not fit this machine: {exc}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the boards' copy of the user's package
    key = write_fleet_key(tmp_path / "fleet.key")
    run_dir = tmp_path / "run"
    with Lab(fleet, fleet_key_file=key, logs_dir=tmp_path / "logs") as lab:
        lab.wait_online(timeout_s=60)
        done = subprocess.run(
            train_command(broker=lab.broker_address, fleet_key=key, boards=list(QUOTAS), batch=[BATCHES[b] for b in QUOTAS],
                          model="examples.my_fleet_job.resnet:TinyResNet", model_options=f"lr={LR}", dataset="digits",
                          epochs=EPOCHS, threads=1, seed=1, no_rebalance=True, run_dir=run_dir),
            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_loss, last_loss = steps[0]["loss"], steps[-1]["loss"]
    epochs = [round(line["val_accuracy"], 3) for line in steps if "val_accuracy" in line]
    print(f"\nTinyResNet (BatchNorm) on digits, {len(steps)} steps on {len(QUOTAS)} boards: loss {first_loss:.3f} -> "
          f"{last_loss:.3f}, val accuracy by epoch {epochs} (with the first board's running statistics)")
    assert all(line["boards"] == list(QUOTAS) for line in steps)
    # The curve moves by several points from one epoch to the next (a small set, a high learning rate): the last
    # two epochs' mean is judged, not one epoch's figure. The run itself does not depend on the host's load
    # (tests/conformance/test_fleet_host_load.py): the same seed and split give the same bits.
    assert len(epochs) == EPOCHS and (epochs[-1] + epochs[-2]) / 2 >= MIN_ACCURACY and last_loss < first_loss / 4, epochs
