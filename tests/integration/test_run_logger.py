"""What a real run writes for the people who look at it: TensorBoard's event file, ``metrics.jsonl``'s learning
rates, ``power.jsonl``'s CPU and temperature, and the report drawn from them.

Two real boards train the README's example model (a StepLR that multiplies the learning rate by 0.8 at
every epoch's end) on 256 samples, 4 steps an epoch, for 3 epochs: the learning-rate curve has three levels.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from edgefleet.coordinator.cli.main import main
from tests.conftest import Fleet

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"   # one thermal zone per board (its SOURCES.md)
pytestmark = pytest.mark.fleet(boards={"g1": {"config_extra": f'[telemetry]\nsysfs_root = "{SYSFS / "pi5"}"\n'},
                                       "g2": {"config_extra": f'[telemetry]\nsysfs_root = "{SYSFS / "orin"}"\n'}},
                               keep_worker=True)  # the second job skips the worker's start

BOARDS = ("g1", "g2")
LR = 0.05
JOB: dict[str, Any] = {"boards": ",".join(BOARDS), "model": "examples.my_fleet_job.model:LitClassifier",
                       "model_options": f"hidden=16,lr={LR}", "dataset": "examples.my_fleet_job.data:make_dataset",
                       "dataset_options": "n=256", "batch": "32,32", "epochs": 3, "threads": 1, "seed": 3}
STEPS = 12  # 256 samples / 64 a step, 3 epochs
LR_CURVE = [LR] * 4 + [LR * 0.8] * 4 + [LR * 0.64] * 4  # StepLR(step_size=1 epoch, gamma=0.8)


@pytest.fixture(scope="module")
def tensorboard_run(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("tb") / "run"
    done = fleet.train("--logger", "tensorboard", "--log-every-n-steps", "1", run_dir=run_dir, **JOB)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return run_dir


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def test_one_event_file_holds_the_fleet_the_boards_and_the_learning_rate(tensorboard_run: Path) -> None:
    events = sorted((tensorboard_run / "logs").rglob("events.out.tfevents.*"))

    assert len(events) == 1, f"one event file per run, not {[e.name for e in events]}"
    scalars = EventAccumulator(str(events[0].parent)).Reload()
    tags = set(scalars.Tags()["scalars"])
    per_board = {f"{name}/{board}" for name in ("compute_s", "samples_per_s", "power_w", "cpu_percent", "temp_c")
                 for board in BOARDS}
    assert {"fleet_loss", "fleet_samples_per_s", "lr-SGD", "val_loss", *per_board} <= tags, sorted(tags)
    assert [e.step for e in scalars.Scalars("fleet_loss")] == list(range(STEPS))  # every step, in one file
    assert len(scalars.Scalars("compute_s/g1")) == STEPS
    lrs = [e.value for e in scalars.Scalars("lr-SGD")]
    assert lrs == pytest.approx(LR_CURVE, rel=1e-6)
    assert all(0 <= e.value <= 100 for e in scalars.Scalars("cpu_percent/g2"))
    assert [e.value for e in scalars.Scalars("temp_c/g1")] == pytest.approx([51.35] * len(scalars.Scalars("temp_c/g1")))


def test_metrics_lines_carry_each_steps_learning_rate(tensorboard_run: Path) -> None:
    steps = _steps(tensorboard_run)

    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [len(s["lr"]) for s in steps] == [1] * STEPS  # one param group
    assert [s["lr"][0] for s in steps] == pytest.approx(LR_CURVE, rel=1e-6)


def test_metrics_lines_carry_the_learning_rate_when_the_replica_lags(fleet: Fleet, tmp_path: Path) -> None:
    # no logger: the replica may trail the exchange by a few steps, and each line waits for its step's rates
    done = fleet.train(run_dir=tmp_path / "run", **JOB)

    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["lr"][0] for s in _steps(tmp_path / "run")] == pytest.approx(LR_CURVE, rel=1e-6)


def test_power_log_holds_each_boards_cpu_and_temperature(tensorboard_run: Path) -> None:
    lines = [json.loads(line) for line in (tensorboard_run / "power.jsonl").read_text().splitlines()]

    assert {line["board_id"] for line in lines} == set(BOARDS)
    assert all({"cpu_percent", "temp_c", "power_w"} <= set(line) for line in lines)
    assert all(isinstance(line["cpu_percent"], float) and 0 <= line["cpu_percent"] <= 100 for line in lines)
    assert {line["board_id"]: line["temp_c"] for line in lines} == {"g1": 51.35, "g2": 47.531}


def test_the_report_of_a_real_run_shows_hyperparameters_learning_rate_and_board_load(tensorboard_run: Path) -> None:
    assert main(["report", str(tensorboard_run)]) == 0

    text = (tensorboard_run / "report.html").read_text()
    table = re.search(r'<section id="sec-hyperparameters">(.*?)</section>', text, re.S)
    assert table, "no hyperparameters table"
    for cell in ("examples.my_fleet_job.model:LitClassifier", "hidden=16", "lr=0.05", "64 (g1 32, g2 32)", "32-true"):
        assert cell in table[1], cell
    assert 'id="plot-lr"' in text and 'id="plot-board_load"' in text
