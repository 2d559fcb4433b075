"""``train --auto`` with gradient accumulation, mixed precision and a DataModule: real agents and a real
Mosquitto. The boards profile the job's own steps (the DataModule's batches through its transfer hooks,
bf16 autocast, two batches per step), the plan counts two global batches per step, the run trains with
the user's settings, and the saved profile is reused only for a job with the same ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from edgefleet.coordinator.cli.auto import run_auto
from edgefleet.coordinator.planning import load_profiles
from edgefleet.coordinator.planning.profiles import load_profile_meta
from tests.conftest import Fleet
from tests.coordinator.test_plan_cli import _planned_boards
from tests.integration.test_auto_train import _args

MODEL = "tests.conformance.modules:SgdNet"
SENSOR = "tests.conformance.data:SensorDataModule"  # its batches reach the model only through its three transfer hooks


def test_auto_profiles_plans_and_trains_with_accumulation_bf16_and_a_datamodule(
        tmp_path: Path, make_fleet: Callable[..., Fleet], capsys: pytest.CaptureFixture[str]) -> None:
    ids = ("as-a", "as-b")
    fleet = _planned_boards(make_fleet, ids)
    profile = tmp_path / "edgefleet-profile.json"  # none yet: the first run profiles

    def auto(run: str, *flags: str) -> tuple[int, str]:
        code = run_auto(_args(fleet.broker, "--fleet-key", str(fleet.key), "--profile", str(profile), "--model", MODEL,
                              "--datamodule", SENSOR, "--datamodule-options", "n=240", "--objective", "time",
                              "--batch", "16,32", "--steps", "8", "--threads", "1", "--run-dir", str(tmp_path / run),
                              *flags))
        return code, capsys.readouterr().out

    code, out = auto("run", "--accumulate-grad-batches", "2", "--precision", "bf16-mixed")

    assert code == 0, out
    assert "profiling as-a, as-b: no profile at" in out
    assert f"on datamodule {SENSOR!r}, bf16-mixed, 2 batches per step" in out   # the boards' own words
    meta = load_profile_meta(profile)
    assert meta is not None
    assert (meta.dataset, meta.datamodule, meta.datamodule_options) == ("", SENSOR, {"n": 240})
    assert (meta.precision, meta.accumulate_grad_batches) == ("bf16-mixed", 2)
    assert load_profiles(profile)["default"].accumulate == 2
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["datamodule"], config["precision"], config["accumulate_grad_batches"]) == (SENSOR, "bf16-mixed", 2)
    assert sum(config["batch_sizes"]) in (16, 32)  # per batch: the job keeps its two batches per step
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 8
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    predicted, measured = plan["predicted"], plan["measured"]
    assert predicted["samples_per_s"] == pytest.approx(2 * sum(config["batch_sizes"]) / predicted["step_time_s"])
    assert measured["samples_per_s"] == pytest.approx(2 * sum(config["batch_sizes"]) / measured["step_time_s"])

    code, out = auto("again", "--accumulate-grad-batches", "2", "--precision", "bf16-mixed")

    assert code == 0, out
    assert f"reusing the profile {profile} (it fits this model, DataModule, --precision bf16-mixed " \
           "--accumulate-grad-batches 2 and the agents' versions)" in out

    code, out = auto("other", "--accumulate-grad-batches", "2")  # fp32 now: the bf16 profile is not reused

    assert code == 0, out
    assert ("profiling as-a, as-b: its steps were timed with --precision bf16-mixed --accumulate-grad-batches 2, "
            "this job trains with --accumulate-grad-batches 2") in out
    meta = load_profile_meta(profile)
    assert meta is not None and meta.precision == "32-true"
