"""The coordinator's services called as functions, without the command line: a :class:`JobSpec` in, an outcome out.

The training test runs a real job through a real Mosquitto and real agent processes, as
``edge-coordinator train`` does, but from Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import TrainObserver, load_job, resolve_job, train
from edgefleet.coordinator.run.training import StepView
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.fleet_key import load_fleet_key
from edgefleet.transport.settings import BrokerSettings
from tests.conftest import Fleet

DIGITS_TRAIN = 1438  # samples in the digits training split


class _Recorder(TrainObserver):
    """Keeps what a run reports."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.steps: list[int] = []
        self.notes: list[str] = []

    def started(self, spec: JobSpec, run_dir: Path, first_step: int) -> None:
        self.events.append(f"started {spec.run_id} at {first_step}")

    def step(self, view: StepView) -> None:
        self.steps.append(view.step)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def stopped(self) -> None:
        self.events.append("stopped")


def test_train_runs_a_job_spec_on_real_agents_without_the_command_line(tmp_path: Path,
                                                                       make_fleet: Callable[..., Fleet]) -> None:
    ids = ("svc-a", "svc-b")
    fleet = make_fleet(ids, agent_args=("--interval", "0.2"), wait="online")
    mosquitto, key_file = fleet.broker, fleet.key
    spec = JobSpec(model="lenet5", model_options={"optimizer": "sgd", "lr": 0.05}, dataset="digits", boards=ids,
                   batch_sizes=(8, 16), steps=6, seed=3, threads=1, rebalance=False)
    recorder = _Recorder()

    outcome = train(spec, broker=BrokerSettings(host=mosquitto.host, port=mosquitto.port),
                    fleet_key=load_fleet_key(key_file), run_dir=tmp_path / "run", observer=recorder)

    assert not outcome.interrupted and outcome.run_dir == tmp_path / "run"
    assert outcome.result["steps"] == 6 and outcome.result["total_steps"] == 6
    assert {b: info["batch_size"] for b, info in outcome.result["boards"].items()} == {"svc-a": 8, "svc-b": 16}
    assert recorder.steps == list(range(6))
    assert recorder.events[0].startswith("started lenet5-digits-") and recorder.events[0].endswith(" at 0")
    assert recorder.events[-1] == "stopped"
    assert any("waiting for 2 boards" in note for note in recorder.notes)
    records = [json.loads(line) for line in (outcome.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == list(range(6)) and all(r["n"] == 24 for r in records)
    assert torch.load(outcome.run_dir / "model.pt", weights_only=True)
    # config.json holds the spec as resolved for the run: what a resume reads back
    saved = load_job(outcome.run_dir)
    assert saved.resolved and saved.run_id == outcome.result["run_id"] and saved.total_steps == 6
    assert replace(saved, run_id="", total_steps=0, steps_per_epoch=0, batches_per_epoch=0) == spec


def test_resolve_job_fixes_the_boards_batches_and_length() -> None:
    spec = JobSpec(model="lenet5", dataset="digits", boards=("a", "b", "c"), batch_sizes=(16,), epochs=2)

    resolved = resolve_job(spec, dataset_len=DIGITS_TRAIN)

    assert resolved.batch_sizes == (16, 16, 16)
    assert resolved.batches_per_epoch == resolved.steps_per_epoch == DIGITS_TRAIN // 48  # global batches of 48
    assert resolved.total_steps == 2 * resolved.steps_per_epoch
    assert resolved.run_id.startswith("lenet5-digits-") and resolve_job(resolved) is resolved


@pytest.mark.parametrize(("spec", "fragment"), [
    (JobSpec(model="lenet5", dataset="digits", boards=("a", "b"), batch_sizes=(8, 8, 8)), "--batch has 3 values for 2 boards"),
    (JobSpec(model="lenet5", dataset="digits"), "no boards: none is online"),
    (JobSpec(model="lenet5", dataset="digits", boards=("a", "b"), batch_sizes=(8, 8),
             force_split={"from_step": 8, "batch_sizes": [4, 4]}), "16 in all (the global batch)"),
    (JobSpec(model="lenet5", dataset="digits", boards=("a", "b"), batch_sizes=(8, 8),
             force_split={"from_step": 1, "batch_sizes": [4, 12]}), "a re-split can start at step 3 at the earliest"),
])
def test_resolve_job_refuses_a_job_no_run_could_take(spec: JobSpec, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        resolve_job(spec, dataset_len=DIGITS_TRAIN)


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"dataset": ""}, "give a dataset or a DataModule"),
    ({"boards": ("a", "a")}, "--boards names a board twice: a,a"),
    ({"epochs": 2.0, "steps": 5}, "give epochs or steps, not both"),
    ({"wire_dtype": "int8"}, "--wire-dtype 'int8' is not one of float32, float16, bfloat16"),
    ({"rebalance_threshold": 0.0}, "--rebalance-threshold 0.0: use a fraction above 0"),
    ({"precision": "8-mixed"}, "precision '8-mixed' is not one of 32-true, bf16-mixed, 16-mixed"),
    ({"precision": "16-mixed", "aggregate": "median"}, "--precision 16-mixed cannot be combined with --aggregate median"),
])
def test_a_job_spec_refuses_values_no_run_could_take(fields: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        JobSpec(**{"model": "lenet5", "dataset": "digits", **fields})


def test_a_config_json_written_before_the_job_spec_is_read_back() -> None:
    old = {"run_id": "lenet5-digits-1", "boards": ["t1", "t2"], "batch_sizes": [16, 32], "model": "lenet5",
           "dataset": "digits", "total_steps": 60, "steps_per_epoch": 30, "model_options": {"lr": 0.05},
           "dataset_options": {}, "datamodule": "", "datamodule_options": {}, "batches_per_epoch": 30,
           "accumulate_grad_batches": 1, "gradient_clip_val": None, "gradient_clip_algorithm": "norm",
           "deterministic": False, "precision": "32-true", "logger": "none", "sync_buffers": "broadcast",
           "log_every_n_steps": 50, "seed": 7, "lr": None, "wire_dtype": "float32", "data_mode": "global", "threads": 1,
           "checkpoint_every": 5, "step_timeout_s": 10.0, "exchange_host": "", "exchange_port": 0, "rebalance": False,
           "rebalance_threshold": 0.15, "force_split": None}

    spec = JobSpec.from_json(old)

    assert spec.resolved and spec.boards == ("t1", "t2") and spec.batch_sizes == (16, 32)
    assert JobSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ConfigError, match="unknown keys"):
        JobSpec.from_json({**old, "from_the_future": 1})
