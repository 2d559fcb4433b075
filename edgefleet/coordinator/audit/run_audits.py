"""A run's audits, as the training driver (``coordinator.run.training``) uses them.

:func:`run_audits` decides, before any board starts, whether the run's boards can be audited
(``coordinator.audit.audit_scope``) and says so in one note; :meth:`RunAudits.attach` puts the
auditor between the exchange (it sees each kept vector) and the replica (it checks before each
step is applied); :meth:`RunAudits.keep_start` keeps the state a failure rolls back to; the run
asks :meth:`RunAudits.failures` after every step and ends for a rollback when there are any.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefleet.coordinator.audit.audit_scope import why_not_audited
from edgefleet.coordinator.audit.auditor import AuditFailure, Auditor
from edgefleet.coordinator.audit.recompute import AuditData
from edgefleet.coordinator.audit.rollback import START, audit_record, save_start
from edgefleet.coordinator.audit.schedule import AuditSchedule
from edgefleet.coordinator.exchange.server import ExchangeServer
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.replica import Replica
from edgefleet.workloads.sharding import GlobalBatchPlan

log = logging.getLogger(__name__)


@dataclass
class RunAudits:
    """One run's audits: ``auditor`` None when the run is not audited (``note`` says why)."""

    spec: JobSpec
    run_dir: Path
    note: str
    data: AuditData | None = None
    auditor: Auditor | None = None

    def attach(self, exchange: ExchangeServer, replica: Replica) -> None:
        """Let the auditor see the exchange's kept vectors and check each step on the replica before it is applied."""
        if self.data is None:
            return
        buffers = replica.buffers
        schedule = AuditSchedule(list(self.spec.boards), share=self.spec.audit_share or 1.0, start_step=replica.step,
                                 every=self.spec.audit_every)
        self.auditor = Auditor(list(self.spec.boards), self.data, schedule, wire_dtype=self.spec.wire_dtype,
                               grad_elements=replica.param_count - buffers.elements,
                               float_buffer_elements=buffers.float_elements, sizes_at=exchange.batch_sizes_at)
        exchange.mode.audit_tap = self.auditor.tap
        replica.auditor = self.auditor
        self.note = self.auditor.describe()

    def keep_start(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At a run's start (step 0), keep the state a failed audit rolls back to (``state()``: a checkpoint's dict)."""
        if self.auditor is not None and step == 0 and not (self.run_dir / START).exists():
            save_start(self.run_dir, state())

    def failures(self) -> list[AuditFailure]:
        """The audits failed since the last call."""
        return self.auditor.take_failures() if self.auditor is not None else []

    def summary(self) -> dict[str, Any]:
        """``result.json``'s ``audits``: passed audits per board, the time they took, the rollbacks; or why none ran."""
        rollbacks = audit_record(self.run_dir).get("rollbacks", [])
        if self.auditor is None:
            return {"audited": False, "why_not": self.note, "rollbacks": rollbacks}
        return {"audited": True, "passed": dict(self.auditor.audits), "audit_s": round(self.auditor.audit_s, 3),
                "every": self.auditor.schedule.every, "share": self.spec.audit_share, "rollbacks": rollbacks,
                **({"stopped": self.auditor.disabled} if self.auditor.disabled else {})}


def run_audits(spec: JobSpec, model: Any, dataset: Any, collate_fn: Callable[[list[Any]], Any], *, run_dir: Path,
               batches_per_epoch: int) -> RunAudits:
    """The run's audits, decided before any board starts (``model``: the replica's module)."""
    why = why_not_audited(spec, model)
    if why:
        return RunAudits(spec, run_dir, why)
    plan = GlobalBatchPlan(len(dataset), list(spec.batch_sizes), spec.seed)
    data = AuditData(dataset=dataset, collate_fn=collate_fn, plan=plan, seed=spec.seed, batches_per_epoch=batches_per_epoch)
    return RunAudits(spec, run_dir, "", data)


__all__ = ["RunAudits", "run_audits"]
