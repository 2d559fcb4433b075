"""The board's profile of a job as it will train: its DataModule (collate and batch-transfer hooks), its
precision and its gradient accumulation, whose timed step is a whole optimizer step of K batches."""

from __future__ import annotations

from typing import Any

import pytest

from edgefleet.agent.board_resources import PowerMeter
from edgefleet.agent.job_runner import WorkerContext
from edgefleet.agent.profile_worker import StepClock, _Measured, run_profile
from edgefleet.protocol.jobs import ProfileCommand, profile_schema_version
from edgefleet.protocol.profile_report import ProfileReport
from tests.conformance.modules import SgdNet

TOKEN = "s" * 32
SENSOR = "tests.conformance.data:SensorDataModule"   # a batch the model can take only after all three transfer hooks
CONTEXT = WorkerContext(power_source="estimated", idle_w=2.0, max_w=6.0)


class Events:
    """Collects what the worker would write to the agent."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def emit(self, phase: str, message: str = "", **fields: Any) -> None:
        self.lines.append({"phase": phase, "message": message, **fields})


def _job(*, precision: str, accumulate: int) -> ProfileCommand:
    return ProfileCommand(job_id="p-0", board_id="b1", model="tests.conformance.modules:SgdNet", dataset="",
                          datamodule=SENSOR, datamodule_options={"n": 64}, batch_sizes=[4, 8], warmup_steps=1,
                          timed_steps=3, threads=1, probe_host="127.0.0.1", probe_port=9, probe_token=TOKEN,
                          probe_bytes=0, precision=precision, accumulate_grad_batches=accumulate,
                          schema_version=profile_schema_version(datamodule=SENSOR, precision=precision,
                                                                accumulate_grad_batches=accumulate))


def test_with_accumulation_the_clock_times_whole_windows_of_k_batches() -> None:
    meter = PowerMeter(CONTEXT)
    clock = StepClock(1, 2, meter, accumulate=3)
    module = SgdNet()
    try:
        for batch_idx in range(9):  # one warm-up and two timed windows of 3 batches
            clock.on_train_batch_start(None, module, None, batch_idx)
        assert len(clock.starts) == 3  # the windows' first batches: 0, 3, 6

        with pytest.raises(_Measured):  # the batch that opens the next window ends the last timed step
            clock.on_train_batch_start(None, module, None, 9)
    finally:
        meter.close()

    assert len(clock.starts) == 4 and len(clock.periods_s) == 2 and clock.power_w is not None


@pytest.mark.parametrize(("precision", "accumulate"), [("bf16-mixed", 2), ("16-mixed", 3)])
def test_a_profile_trains_the_datamodules_batches_at_the_jobs_precision_and_accumulation(
        precision: str, accumulate: int) -> None:
    events = Events()

    assert run_profile(_job(precision=precision, accumulate=accumulate), events, CONTEXT) == 0  # type: ignore[arg-type]

    # a line per batch size, then the per-layer timing's (its units, or why there are none)
    assert [e["phase"] for e in events.lines] == ["running", "progress", "progress", "progress", "finished"]
    running = events.lines[0]["message"]
    assert f"on datamodule {SENSOR!r}, {precision}, {accumulate} batches per step" in running
    assert events.lines[1]["message"].startswith(f"batch 4 x {accumulate}: ")
    report = ProfileReport.from_wire(events.lines[-1]["data"])
    assert [p.batch_size for p in report.points] == [4, 8]
    for point in report.points:  # a step is K batches: its samples are K x the batch
        assert point.samples_per_s == pytest.approx(accumulate * point.batch_size / point.step_time_s)
