"""When a later pipeline stage's board sends the coordinator what (issue 35): every step, or only at checkpoints.

In a pipeline each later stage is trained by one board, with the user's optimizer on that board. The
coordinator's replica holds the whole model (it checkpoints and validates it), so by default each
such board sends its stage's gradient every step and the replica takes the same optimizer step:
that costs the board's link the stage's whole gradient every step, often the model's largest part.

With ``every`` > 0 the board sends it only where the replica needs the stage:

* ``GRAD`` at the first step of a run (or of a resume): its gradient, as every step by default, so that
  the replica's optimizer state for the stage takes the board's shape;
* ``STATE`` at every ``every``-th step (the run's checkpoints), at each epoch's end (the replica
  validates the model) and at the run's last step: its gradient, then its stage's parameters and
  optimizer state as they were before the step (``workloads.stage_state``), which the replica takes
  before stepping them with that gradient: after the step it holds exactly what the board holds;
* ``NOTHING`` at every other step: an empty vector (the round still carries the step's bookkeeping).

Between two ``STATE`` steps the replica's copy of the later stages is behind: a checkpoint is only
written at a ``STATE`` step (:meth:`StageSync.whole_after`), and a run that stops between them
continues from the last one. Both sides compute the schedule from the same figures (the signed
train command's), so no step says which kind it is.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAD = "grad"
NOTHING = "nothing"
STATE = "state"


@dataclass(frozen=True)
class StageSync:
    """A later stage's schedule: ``every`` 0 (its gradient every step) or the run's checkpoint interval.

    Args:
        every: 0, or the steps between checkpoints: the stage's state goes to the replica at those steps,
            each epoch's last and the run's last, nothing at the others.
        steps_per_epoch: the run's optimizer steps per epoch.
        total_steps: the run's last step + 1.
        start: the first step this run (or resume) trains.
    """

    every: int
    steps_per_epoch: int
    total_steps: int
    start: int = 0

    def __post_init__(self) -> None:
        if self.every < 0 or self.steps_per_epoch < 1 or self.total_steps < 1 or self.start < 0:
            raise ValueError(f"a stage sync schedule needs every >= 0, steps_per_epoch >= 1, total_steps >= 1 and "
                             f"start >= 0, not {self.every}, {self.steps_per_epoch}, {self.total_steps}, {self.start}")

    @property
    def sparse(self) -> bool:
        """Whether the later stages' gradients stay on their boards between checkpoints."""
        return self.every > 0

    def kind(self, step: int) -> str:
        """What a later stage's board sends at ``step``: :data:`GRAD`, :data:`STATE` or :data:`NOTHING`."""
        if not self.every:
            return GRAD
        if self.whole_after(step):
            return STATE
        return GRAD if step == self.start else NOTHING

    def whole_after(self, step: int) -> bool:
        """Whether the replica holds every stage as the boards do once it has taken ``step``."""
        return (not self.every or (step + 1) % self.every == 0 or (step + 1) % self.steps_per_epoch == 0
                or step + 1 >= self.total_steps)


__all__ = ["GRAD", "NOTHING", "STATE", "StageSync"]
