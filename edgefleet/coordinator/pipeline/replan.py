"""A pipeline re-planned without the boards it lost (CEFT's run-time revision, issue 35).

When a board of a pipelined run is gone for good (its agent went offline), the run stops at its last
complete step with a checkpoint of the whole model (the coordinator's replica), and :func:`replan`
gives the pipeline it goes on with, from that very step: nothing is lost or trained twice.

* A later stage's board: its layers go to the stage before it (the cut before them is dropped), so
  every layer still has a board; a board of a later stage's group: its micro-batches go to the group's
  others. When only stage 0 is left, the run goes on data-parallel on stage 0's
  boards (the same mathematics).
* One of stage 0's boards: its slice of the global batch is shared out among the others (the global
  batch, and so every step's samples, stay the run's).

Nothing is left when all of stage 0's boards are gone.

A board that comes back is taken up again (:class:`Comeback`): the re-planned run watches the boards
it lost, and when one is online again it stops at its next whole step (with ``--stage-sync
checkpoint``, a state step, so nothing is trained twice) and goes on with the plan it had before
the loss, less any board still away.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from edgefleet.coordinator.pipeline.stage_plan import StagePlan, parse_stage_plan
from edgefleet.protocol.stage_routes import micro_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replanned:
    """The run's next plan: ``pipeline`` ("" : data-parallel on ``boards``), its boards and their batch sizes."""

    pipeline: str
    boards: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    why: str
    micro_batches: int | None = None  # a pipeline's M and stage sync when they change (a comeback): None, the run's
    stage_sync: str | None = None


@dataclass(frozen=True)
class Comeback:
    """The pipeline a re-planned run returns to when boards it lost come back: the one it was planned with
    (``pipeline``, ``batch_sizes``), and the boards lost since (``lost``)."""

    pipeline: str
    batch_sizes: tuple[int, ...]
    lost: frozenset[str]
    micro_batches: int = 1
    stage_sync: str = "step"

    def losing(self, boards: Collection[str]) -> Comeback:
        """The same plan, ``boards`` lost too."""
        return dataclasses.replace(self, lost=self.lost | set(boards))

    def back(self, returned: Collection[str]) -> tuple[Replanned, Comeback | None]:
        """The plan with ``returned`` boards back (the planned one once every lost board is), and what is still
        awaited (None: nothing)."""
        plan = parse_stage_plan(self.pipeline)
        still = self.lost - set(returned)
        names = ", ".join(sorted(set(returned) & self.lost))
        m, sync = self.micro_batches, self.stage_sync
        if not still:
            return Replanned(pipeline=self.pipeline, boards=plan.boards, batch_sizes=self.batch_sizes,
                             why=f"{names} back: the pipeline as planned", micro_batches=m, stage_sync=sync), None
        partial = replan(plan, self.batch_sizes, still, m)
        if partial is None:  # stage 0 still lost whole: cannot be, a run without it stopped; kept as it is
            raise ValueError(f"the pipeline {self.pipeline} without {', '.join(sorted(still))} has no stage 0")
        return (dataclasses.replace(partial, why=f"{names} back; {partial.why}", micro_batches=m, stage_sync=sync),
                dataclasses.replace(self, lost=frozenset(still)))


def replan(plan: StagePlan, batch_sizes: Sequence[int], lost: Collection[str], micro_batches: int = 1
           ) -> Replanned | None:
    """The plan without the ``lost`` boards (None: none of stage 0's boards is left).

    A later group keeps at most one board per unit of the step (stage 0's boards' micro-batches, ``micro_batches``
    each): with fewer stage-0 boards a group's last boards may get none, and train runs no board without work; they
    are left out, named in ``why``, and taken up again when the lost boards come back."""
    group = [b for b in plan.boards[:plan.group] if b not in lost]
    if not group:
        return None
    sizes = _share_out(list(plan.boards[:plan.group]), list(batch_sizes[:plan.group]), set(lost))
    units = sum(len(micro_rows(n, micro_batches)) for n in sizes)
    cuts: list[str] = []
    stages: list[list[str]] = []  # each kept later stage's boards
    moved: list[str] = []
    for k, cut in enumerate(plan.cuts, start=1):
        boards = plan.stage_boards(k)
        kept = [b for b in boards if b not in lost]
        if not kept:
            moved.append(f"{'+'.join(boards)}'s layers (after {cut}) to the stage before")
            continue
        if len(kept) < len(boards):
            moved.append(f"{', '.join(b for b in boards if b in lost)}'s micro-batches (after {cut}) to "
                         f"{', '.join(kept)}")
        if len(kept) > units:
            moved.append(f"{', '.join(kept[units:])} left out (after {cut}): a step has {units} micro-batch(es) "
                         "for the group")
            kept = kept[:units]
        cuts.append(cut)
        stages.append(kept)
    dropped = [b for b in plan.boards[:plan.group] if b in lost]
    if dropped:
        moved.append(f"{', '.join(dropped)}'s samples to {', '.join(group)}")
    why = "; ".join(moved)
    if not cuts:
        return Replanned(pipeline="", boards=tuple(group), batch_sizes=tuple(sizes), why=why + "; data-parallel now")
    hosts = [b for boards in stages for b in boards]
    text = StagePlan(boards=(*group, *hosts), cuts=tuple(cuts), group=len(group),
                     sizes=(len(group), *(len(boards) for boards in stages))).text()
    return Replanned(pipeline=text, boards=(*group, *hosts), batch_sizes=(*sizes, *(0,) * len(hosts)), why=why)


def _share_out(boards: list[str], sizes: list[int], lost: set[str]) -> list[int]:
    """The kept boards' batch sizes, the lost ones' samples shared out among them as evenly as can be (in order)."""
    kept = [(b, n) for b, n in zip(boards, sizes) if b not in lost]
    spare = sum(n for b, n in zip(boards, sizes) if b in lost)
    share, extra = divmod(spare, len(kept))
    return [n + share + (1 if i < extra else 0) for i, (_, n) in enumerate(kept)]


__all__ = ["Comeback", "Replanned", "replan"]
