"""The replica's later pipeline stages when their boards send their state only at checkpoints (issue 35).

With a sparse stage sync (``protocol.stage_sync``) the replica steps stage 0 with its boards'
average every step, as always, but a later stage only where its board sent something: at a run's
first step its gradient (the replica takes the same step as the board), at a state step its
parameters and optimizer state from before the step, loaded here, then the same step with its
gradient (``workloads.stage_state``). At every other step the stage's gradients are set to None, so
the user's optimizer leaves it (and its state) as they are: the replica's copy waits, behind the
board's, for the next state step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.stage_sync import NOTHING, STATE, StageSync
from edgefleet.workloads.params import trainable_params
from edgefleet.workloads.stage_state import load_stage_state

log = logging.getLogger(__name__)


class StageKeeper:
    """Which of the replica's parameters each later stage holds, and what each step does to them.

    Args:
        sync: the run's schedule (sparse).
        stages: the replica's parameters of each later stage of one board, by stage (``workloads.stage_cut.StagedModel
            .params``; a later stage of several boards sends its group's gradient every step, which the replica takes
            as stage 0's).
    """

    def __init__(self, sync: StageSync, stages: Mapping[int, Sequence[torch.nn.Parameter]]) -> None:
        self.sync = sync
        self._ids = {stage: {id(p) for p in params} for stage, params in stages.items()}
        self._params: dict[int, list[torch.nn.Parameter]] = {}  # each stage's trainable parameters, in the optimizer's order

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The replica's optimizer, once its Trainer made it: the stages' parameters in its order (the boards')."""
        trainable = trainable_params(optimizer)
        self._params = {stage: [p for p in trainable if id(p) in ids] for stage, ids in self._ids.items()}

    def before_step(self, step: int, optimizer: torch.optim.Optimizer, states: Mapping[int, np.ndarray]) -> None:
        """Before the replica's optimizer step ``step`` (its gradients assigned): leave the later stages out of it, or
        load their state first.

        Raises:
            DecodeError: a state step without a stage's state, or one that does not fit the replica's stage.
        """
        kind = self.sync.kind(step)
        if kind == NOTHING:
            for params in self._params.values():
                for p in params:
                    p.grad = None
        elif kind == STATE:
            for stage, params in self._params.items():
                state = states.get(stage)
                if state is None:
                    raise DecodeError(f"step {step}: stage {stage}'s board sent no state at a state step")
                load_stage_state(params, optimizer, state, stage=stage)

    def whole_after(self, step: int) -> bool:
        """Whether the replica holds every stage as its board does once it has taken ``step`` (``step`` = start - 1:
        before the run's first step, as loaded)."""
        return step < self.sync.start or self.sync.whole_after(step)


__all__ = ["StageKeeper"]
