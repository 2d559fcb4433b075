"""A pipelined run's revision around a board that slowed for good, step by step (issue 35, CEFT).

The training driver hands every step's busy times to :class:`StageReviser`. When the watch
(``pipeline.stage_watch``) says a board's changed for good, the reviser times the model's units on
the coordinator (once per run, on a copy of the replica's model, in a thread: the boards go on) and
asks ``pipeline.revision`` for a better plan at the measured speeds. A plan that pays becomes the
run's next plan (a :class:`~coordinator.pipeline.replan.Replanned`): the run stops at its next whole
step and goes on from it with the new stages, as after a lost board. One that does not pay is noted
once, and the slowdown becomes the watch's new normal. When a board is lost for good, the run's next
plan is cut again at the speeds measured so far too (:meth:`StageReviser.without`), rather than its
stage merged into a neighbour.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from edgefleet.coordinator.pipeline.replan import Replanned
from edgefleet.coordinator.pipeline.revision import Revision, replan_measured, revise
from edgefleet.coordinator.pipeline.stage_plan import parse_stage_plan
from edgefleet.coordinator.pipeline.stage_watch import Drift, StageWatch
from edgefleet.protocol.profile_report import UnitReport
from edgefleet.workloads.layer_cut import CutRefused
from edgefleet.workloads.layer_timing import time_units

log = logging.getLogger(__name__)

# What a revision costs the run: it stops at a whole step and its boards start the new plan. A lost board's
# re-plan measured 4.2-4.5 s on the lab's fleet8 and 3.6 s on the loopback (docs/benchmarks.md, 2026-11-29).
REVISION_COST_S = 5.0
MIN_GAIN = 0.15         # the smallest fall of the predicted step time worth a revision


class StageReviser:
    """Watches a pipelined run's boards and proposes its next plan when one slowed for good (module doc).

    Args:
        pipeline: the run's ``--pipeline``.
        batch_sizes: the run's batch sizes (stage 0's slices, then 0 per later stage).
        micro_batches: M.
        model: the replica's model (copied before its units are timed).
        sample: ``n`` -> a batch of ``n`` of the model's inputs (``workloads.layer_timing.input_sampler``).
        total_steps: the run's steps, for what a revision would save before the end.
        on_note: the run's notes to the user.
    """

    def __init__(self, pipeline: str, batch_sizes: Sequence[int], micro_batches: int, *, model: Any,
                 sample: Callable[[int], Any], total_steps: int, on_note: Callable[[str], None]) -> None:
        self.plan = parse_stage_plan(pipeline)
        self.batch_sizes, self.micro_batches = list(batch_sizes), micro_batches
        self.model, self.sample, self.total_steps, self.on_note = model, sample, total_steps, on_note
        self.watch = StageWatch(self.plan.boards)
        self.next_plan: Replanned | None = None
        self._units: tuple[UnitReport, ...] | None = None
        self._units_failed = False

    async def after_step(self, step: int, busy_s: Mapping[str, float],
                         ram_bytes: Callable[[], Mapping[str, int]]) -> Replanned | None:
        """Take step ``step``'s busy times; the run's next plan when a revision pays (once: then the run stops).
        ``ram_bytes`` gives each board's RAM, asked only on a drift."""
        if self.next_plan is not None:
            return None
        drift = self.watch.observe(step, busy_s)
        if drift is None:
            return None
        units = await self._unit_times()
        revision = None
        if units is not None:
            slowed = [b for b, d in drift.change.items() if d > 0]
            measured = {**self.watch.recent_s(), **drift.recent_s}
            revision = revise(self.plan, self.batch_sizes, self.micro_batches, units, measured, slowed=slowed,
                              ram_bytes=ram_bytes(), min_gain=MIN_GAIN, steps_left=self.total_steps - step - 1,
                              change_s=REVISION_COST_S)
        changed = _changes(drift)
        if revision is None:
            self.watch.settle(drift.change)
            self.on_note(f"step {step}: {changed}; no other plan of these boards would be {MIN_GAIN:.0%} faster and "
                         "pay for the change before the run ends: the pipeline stays as it is")
            return None
        self.next_plan = _replanned(revision, f"{changed}: {revision.why}")
        self.on_note(f"step {step}: {changed}; revising the pipeline after its next whole step: {revision.why} "
                     f"({revision.pipeline or 'data-parallel'}; predicted {revision.current_s:.3f} s -> "
                     f"{revision.predicted_s:.3f} s a step)")
        return self.next_plan

    async def without(self, lost: Collection[str], ram_bytes: Mapping[str, int]) -> Replanned | None:
        """The run's plan without the ``lost`` boards, its stages cut again at the speeds the watch measured (None:
        a board left was not measured yet, or the units cannot be timed: the caller merges the lost stages)."""
        units = await self._unit_times()
        if units is None:
            return None
        revision = replan_measured(self.plan, self.batch_sizes, self.micro_batches, units, self.watch.recent_s(),
                                   lost=lost, ram_bytes=ram_bytes)
        return _replanned(revision, revision.why) if revision is not None else None

    async def _unit_times(self) -> tuple[UnitReport, ...] | None:
        """The model's units timed on the coordinator (once; None when the model's units cannot be timed)."""
        if self._units is None and not self._units_failed:
            rows = max(2, sum(self.batch_sizes) // max(self.micro_batches, 1))
            try:
                self._units = await asyncio.to_thread(time_units, copy.deepcopy(self.model), self.sample,
                                                      (max(1, rows // 2), rows))
            except (CutRefused, RuntimeError, ValueError) as exc:
                self._units_failed = True
                log.warning("the model's units could not be timed for a revision: %s", exc)
        return self._units


def _changes(drift: Drift) -> str:
    """``"q3 takes 2.9x its time since the plan began (0.412 s a step busy)"``, one part per board."""
    return "; ".join(f"{b} takes {1 + d:.1f}x its time since the plan began ({drift.recent_s[b]:.3f} s a step busy)"
                     for b, d in sorted(drift.change.items(), key=lambda item: -abs(item[1])))


def _replanned(revision: Revision, why: str) -> Replanned:
    return Replanned(pipeline=revision.pipeline, boards=revision.boards, batch_sizes=revision.batch_sizes, why=why)


__all__ = ["MIN_GAIN", "REVISION_COST_S", "StageReviser"]
