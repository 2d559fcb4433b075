"""Planning a job with gradient accumulation, mixed precision or a DataModule: the cost model counts K x the
global batch per step, the profile file keeps what it was measured with, and a profile measured otherwise
is not reused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from edgefleet.coordinator.planning import load_profiles, plan
from edgefleet.coordinator.planning.cost_model import Candidate, estimate
from edgefleet.coordinator.planning.plan_fleet import load_profile_file, select_variants
from edgefleet.coordinator.planning.plan_job import PlanRequest, job_to_verify
from edgefleet.coordinator.planning.profiles import ProfileMeta, check_settings, load_profile_meta, save_profiles
from edgefleet.coordinator.planning.verify import measure
from edgefleet.coordinator.run.auto_train import _modes_for
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.protocol.errors import ConfigError, PlanError
from tests.planning import MB, board, fleet

KEY = "tests.conformance.modules:SgdNet{}[]"
SENSOR = "tests.conformance.data:SensorDataModule"


def _fleet(accumulate: int = 1):
    boards = (board("a", a=0.1, c=0.01, key=KEY), board("b", a=0.1, c=0.02, key=KEY, link=5 * MB))
    return dataclasses.replace(fleet(*boards, key=KEY, dataset_len=6000), accumulate=accumulate)


def test_with_accumulation_a_step_counts_k_global_batches_in_samples_per_s_and_epoch_time() -> None:
    candidate = Candidate(boards=("a", "b"), batch_sizes=(20, 12), variant={})

    once = estimate(candidate, _fleet(1))
    twice = estimate(candidate, _fleet(2))

    # the same timed step (K batches and one exchange, as the profile measured it) trains 2 x 32 samples
    assert twice.step_time_s == pytest.approx(once.step_time_s)
    assert twice.samples_per_s == pytest.approx(2 * 32 / twice.step_time_s)
    assert twice.samples_per_s == pytest.approx(2 * once.samples_per_s)
    assert twice.epoch_time_s == pytest.approx(6000 / twice.samples_per_s) == pytest.approx(once.epoch_time_s / 2)
    assert twice.peak_memory_bytes == once.peak_memory_bytes  # memory is one batch's
    assert twice.energy_per_epoch_j == pytest.approx(once.energy_per_epoch_j / 2)


def test_the_search_counts_accumulation_as_the_single_estimate_does() -> None:
    result = plan({"default": _fleet(3)}, objective="time", global_batches=(32,))

    chosen = result.chosen
    again = estimate(chosen.candidate, _fleet(3))
    assert chosen.samples_per_s == pytest.approx(3 * chosen.candidate.global_batch / chosen.step_time_s)
    assert chosen.epoch_time_s == pytest.approx(again.epoch_time_s)


def test_a_measured_run_counts_k_global_batches_per_step() -> None:
    measured = measure([0.5, 0.5, 0.5], {}, boards=("a",), global_batch=32, dataset_len=640, accumulate=4)

    assert measured.samples_per_s == pytest.approx(4 * 32 / 0.5)
    assert measured.epoch_time_s == pytest.approx(640 / 256)


def test_the_profile_file_keeps_the_accumulation_and_the_job_settings(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    meta = ProfileMeta(model="tests.conformance.modules:SgdNet", dataset="", datamodule=SENSOR,
                       datamodule_options={"n": 64}, precision="bf16-mixed", accumulate_grad_batches=2)

    save_profiles(path, {"default": _fleet(2)}, meta)

    assert load_profiles(path)["default"].accumulate == 2
    assert load_profile_meta(path) == meta
    doc = json.loads(path.read_text())
    assert doc["meta"]["precision"] == "bf16-mixed" and doc["variants"]["default"]["accumulate"] == 2


def test_a_plain_profile_file_is_written_as_before_and_an_old_file_reads_as_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    save_profiles(path, {"default": _fleet(1)}, ProfileMeta(model="lenet5", dataset="digits"))
    doc = json.loads(path.read_text())
    # what an edgefleet before these settings writes (and reads: it refuses unknown keys)
    assert set(doc["meta"]) == {"model", "dataset", "dataset_options", "wire_dtype", "batch_sizes", "created"}
    assert "accumulate" not in doc["variants"]["default"]

    profiles, meta = load_profile_file(path)

    assert profiles["default"].accumulate == 1
    assert meta is not None and (meta.precision, meta.accumulate_grad_batches, meta.datamodule) == ("32-true", 1, "")


@pytest.mark.parametrize(("precision", "accumulate", "fragment"), [
    ("32-true", 1, "timed with --precision bf16-mixed --accumulate-grad-batches 2, this job trains with fp32 "
                   "without accumulation"),
    ("bf16-mixed", 4, "this job trains with --precision bf16-mixed --accumulate-grad-batches 4"),
    ("16-mixed", 2, "this job trains with --precision 16-mixed --accumulate-grad-batches 2"),
])
def test_a_profile_timed_with_other_settings_is_not_reused(precision: str, accumulate: int, fragment: str) -> None:
    meta = ProfileMeta(model="m", dataset="", datamodule=SENSOR, precision="bf16-mixed", accumulate_grad_batches=2)

    with pytest.raises(PlanError, match="run `edge-coordinator profile` again") as info:
        check_settings(meta, precision=precision, accumulate_grad_batches=accumulate)

    assert fragment in str(info.value)
    check_settings(meta, precision="bf16-mixed", accumulate_grad_batches=2)   # the same settings: reused
    check_settings(None, precision="32-true", accumulate_grad_batches=1)      # no meta: measured with the defaults
    with pytest.raises(PlanError, match="timed with fp32 without accumulation"):
        check_settings(None, precision="32-true", accumulate_grad_batches=2)


def test_a_profile_of_another_dataset_or_datamodule_is_not_reused() -> None:
    profiles = {"default": _fleet(1)}
    on_module = ProfileMeta(model="tests.conformance.modules:SgdNet", dataset="", datamodule=SENSOR,
                            datamodule_options={"n": 64})
    model = "tests.conformance.modules:SgdNet"

    kept = select_variants(profiles, meta=on_module, model=model, variants=[{}], dataset="", datamodule=SENSOR,
                           datamodule_options={"n": 64})
    assert list(kept) == ["default"]
    with pytest.raises(PlanError, match=r"measured on DataModule .*SensorDataModule \(n=64\), this job uses "
                                        r"tests.*SensorDataModule \(n=128\)"):
        select_variants(profiles, meta=on_module, model=model, variants=[{}], dataset="", datamodule=SENSOR,
                        datamodule_options={"n": 128})
    with pytest.raises(PlanError, match="measured on DataModule .*, this job uses dataset digits"):
        select_variants(profiles, meta=on_module, model=model, variants=[{}], dataset="digits", datamodule="")
    on_dataset = ProfileMeta(model=model, dataset="digits")
    with pytest.raises(PlanError, match="measured on dataset digits, this job uses DataModule"):
        select_variants(profiles, meta=on_dataset, model=model, variants=[{}], dataset="", datamodule=SENSOR)


def test_plan_verify_pretrains_the_job_the_profile_measured() -> None:
    meta = ProfileMeta(model="tests.conformance.modules:SgdNet", dataset="", datamodule=SENSOR,
                       datamodule_options={"n": 64}, precision="bf16-mixed", accumulate_grad_batches=2)

    job = job_to_verify(meta, model=None, model_options=None, dataset=None, dataset_options=None)

    assert (job.model, job.dataset, job.datamodule, job.datamodule_options) == (meta.model, "", SENSOR, {"n": 64})
    assert (job.precision, job.accumulate_grad_batches) == ("bf16-mixed", 2)


def test_auto_leaves_out_the_modes_train_refuses_with_the_jobs_settings() -> None:
    request = PlanRequest(objective="time", max_power_w=None, deadline_s=None, global_batches=(32,), count_idle=False,
                          max_memory_fraction=0.9, top=5, allow_inexact=True)
    spec = JobSpec(model="lenet5", dataset="digits", accumulate_grad_batches=2, precision="bf16-mixed")
    notes: list[str] = []

    planned, placement = _modes_for(spec, request, "auto", notes.append)

    assert (planned.allow_inexact, placement) == (False, "none")
    assert notes == ["layer placement not weighed: it does not train with --precision bf16-mixed "
                     "--accumulate-grad-batches 2 yet",
                     "local SGD not weighed (--allow-inexact): it does not train with --accumulate-grad-batches 2"]
    bf16 = dataclasses.replace(spec, accumulate_grad_batches=1)
    assert _modes_for(bf16, request, "none", notes.append) == (request, "none")  # bf16 local SGD trains
    with pytest.raises(ConfigError, match="--placement net.6 cannot be combined with --precision bf16-mixed"):
        _modes_for(bf16, request, "net.6", notes.append)
    plain = JobSpec(model="lenet5", dataset="digits")
    assert _modes_for(plain, request, "auto", notes.append) == (request, "auto")
