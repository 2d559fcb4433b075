"""The audits' parts without a fleet: when boards are audited, what passes, who is left after a rollback,
and which runs cannot be audited (each said, not silently skipped)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgefleet.coordinator.audit.audit_scope import why_not_audited
from edgefleet.coordinator.audit.auditor import Auditor
from edgefleet.coordinator.audit.recompute import AuditData
from edgefleet.coordinator.audit.rollback import RollbackError, without_boards
from edgefleet.coordinator.audit.schedule import AuditSchedule
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.workloads.models import LeNet5
from edgefleet.workloads.sharding import GlobalBatchPlan

SPEC = JobSpec(model="lenet5", dataset="digits", boards=("a", "b", "c"), batch_sizes=(8, 8, 16))


def test_each_board_is_audited_within_every_window_of_steps() -> None:
    schedule = AuditSchedule(["a", "b"], share=0.25, start_step=10, every=3)
    audited: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(10, 310):
        for board in audited:
            if schedule.due(board, step):
                audited[board].append(step)
                schedule.done(board, step)
    for steps in audited.values():
        gaps = np.diff([9, *steps, 310])
        assert gaps.max() <= 3, steps  # never 3 steps in a row without an audit
        assert len(set(np.diff(steps))) > 1  # and not at a fixed stride a board could count on


def test_the_audit_rate_is_fitted_to_the_share_of_time_given() -> None:
    schedule = AuditSchedule(["a", "b"], share=0.25, start_step=0)
    for _ in range(5):
        schedule.fit(0.010, 0.020)  # 2 boards x 10 ms per audit, 20 ms steps: 25% allows an audit every 2 steps
    assert schedule.every == 7  # each board's audits 1-7 steps apart, 4 on average: 0.5 audits a step
    # Over a long run the audits take the share asked, not up to twice it (gaps drawn 1..every average (every+1)/2).
    steps = 20_000
    audits = 0
    for step in range(steps):
        for board in ("a", "b"):
            if schedule.due(board, step):
                schedule.done(board, step)
                audits += 1
    assert 0.22 <= audits * 0.010 / (steps * 0.020) <= 0.26
    schedule.fit(None, 0.2)
    for _ in range(30):
        schedule.fit(0.001, 0.2)
    assert schedule.every == 1


def test_the_audits_fit_takes_the_exchanges_step_period_not_the_gap_between_checks() -> None:
    """The replica may trail the exchange and then checks queued steps back to back: the gap between two checks says
    nothing of the fleet's step period. The step's own wall time (``StepResult.wall_s``) does."""
    schedule = AuditSchedule(["a", "b"], share=0.25, start_step=0)
    data = AuditData(dataset=[], collate_fn=list, plan=GlobalBatchPlan(64, [8, 8], 0), seed=0, batches_per_epoch=8)
    auditor = Auditor(["a", "b"], data, schedule, wire_dtype="float32", grad_elements=100, float_buffer_elements=0,
                      sizes_at=lambda step: [8, 8])
    schedule.fit(0.010, None)  # one audit timed: 10 ms
    for step in range(5):  # checked back to back, microseconds apart, for steps the exchange ran 20 ms each
        auditor.check(step, None, [], [], period_s=0.020)
    assert schedule.every == 7  # as fitted on 20 ms steps (test above), not on the checks' microsecond gaps


def test_a_lagging_replica_does_not_make_every_step_an_audit() -> None:
    """The exchange taps step after step while the replica trails: a board's next audit is drawn when its due vector is
    copied, not when the replica checks it (else every step until the check was copied and audited: twice the share)."""
    schedule = AuditSchedule(["a"], share=0.25, start_step=0, every=4)
    data = AuditData(dataset=[], collate_fn=list, plan=GlobalBatchPlan(64, [8], 0), seed=0, batches_per_epoch=8)
    auditor = Auditor(["a"], data, schedule, wire_dtype="float32", grad_elements=4, float_buffer_elements=0,
                      sizes_at=lambda step: [8])
    for step in range(40):  # the replica checks none of them yet
        auditor.tap("a", step, np.zeros(4, dtype=np.float32))
    copied = len(auditor._copies)
    assert 10 <= copied <= 30  # gaps of 1-4 steps: 16 on average; all 37 or so steps after the first one before the fix


def _auditor(wire: str = "float32", floats: int = 0) -> Auditor:
    schedule = AuditSchedule(["a"], share=1.0, start_step=0, every=1)
    data = AuditData(dataset=[], collate_fn=list, plan=GlobalBatchPlan(64, [8], 0), seed=0, batches_per_epoch=8)
    return Auditor(["a"], data, schedule, wire_dtype=wire, grad_elements=100, float_buffer_elements=floats,
                   sizes_at=lambda step: [8])  # only comparing: the data is never read


def test_an_honest_vector_passes_and_a_scaled_flipped_or_made_up_one_does_not() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(100).astype(np.float32)
    auditor = _auditor()
    noise = (ref * (1 + 1e-6 * rng.standard_normal(100))).astype(np.float32)  # another CPU's order of summing
    assert auditor._compare("a", 0, noise, ref) is None
    for lie, part in ((ref * 2000, "gradient"), (-ref, "gradient"), (rng.standard_normal(100).astype(np.float32), "gradient")):
        failure = auditor._compare("a", 0, lie, ref)
        assert failure is not None and failure.part == part
    assert auditor._compare("a", 0, np.zeros(100, np.float32), np.zeros(100, np.float32)) is None
    broken = ref.copy()
    broken[3] = np.nan
    assert auditor._compare("a", 0, broken, ref) is not None  # a NaN where the slice gives a number
    assert auditor._compare("a", 0, broken, broken) is None  # the model diverged on every board alike: no judgement
    half = _auditor("float16")
    assert half._compare("a", 0, ref.astype(np.float16).astype(np.float32), ref) is None  # the wire's rounding passes


def test_buffers_are_audited_too() -> None:
    ref = np.ones(110, dtype=np.float32)
    ints = np.array([7], dtype=np.int64).view(np.float32)  # an integer buffer's bytes, as the vector carries them
    ref = np.concatenate([ref, ints])
    auditor = _auditor(floats=10)
    stats = ref.copy()
    stats[100:110] = 5.0  # made-up running statistics
    failure = auditor._compare("a", 0, stats, ref)
    assert failure is not None and failure.part == "buffers"
    count = ref.copy()
    count[110:] = np.array([8], dtype=np.int64).view(np.float32)
    failure = auditor._compare("a", 0, count, ref)
    assert failure is not None and failure.part == "integer buffers"


def test_a_rollback_divides_the_boards_share_among_the_others_keeping_the_global_batch() -> None:
    assert without_boards(SPEC, {"c"}).batch_sizes == (16, 16)
    odd = dataclasses.replace(SPEC, batch_sizes=(5, 7, 9))
    left = without_boards(odd, {"b"})
    assert left.boards == ("a", "c") and sum(left.batch_sizes) == 21 and left.batch_sizes in ((8, 13), (9, 12))
    with pytest.raises(RollbackError, match="no board is left"):
        without_boards(SPEC, {"a", "b", "c"})


class _AfterBackward(LeNet5):
    def on_after_backward(self) -> None:
        pass


class _Keeps(LeNet5):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.last = super().training_step(batch, batch_idx)
        return self.last


@pytest.mark.parametrize(("change", "model", "says"), [
    ({}, LeNet5, ""),
    ({"audit_share": 0.0}, LeNet5, "audits are off"),
    ({"data_mode": "local"}, LeNet5, "--data-mode local"),
    ({"sync_every": 4}, LeNet5, "--sync-every 4"),
    ({"accumulate_grad_batches": 2}, LeNet5, "--accumulate-grad-batches 2"),
    ({"precision": "bf16-mixed"}, LeNet5, "--precision bf16-mixed"),
    ({}, _AfterBackward, "_AfterBackward.on_after_backward runs on the boards"),
    ({}, _Keeps, "_Keeps.training_step keeps values on the module"),
])
def test_a_run_that_cannot_be_audited_says_why(change: dict, model: type, says: str) -> None:
    spec = dataclasses.replace(SPEC, **change)
    why = why_not_audited(spec, model((1, 32, 32), 10))
    assert (says in why) if says else why == "", why
