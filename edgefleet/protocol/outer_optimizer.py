"""The outer optimizer of periodic averaging (DiLoCo): its settings, which both sides check alike.

Periodic averaging (``--sync-every H``, ``protocol.sync_schedule``) sets every model to the anchor
minus the fleet's sample-weighted average delta D at a sync step. DiLoCo (Douillard et al., arXiv
2311.08105) treats D as a gradient instead and steps an outer optimizer on the anchor with it:

* ``diloco``: SGD with Nesterov momentum (the paper's): ``m = mu*m + D``; ``anchor -= lr*(D + mu*m)``;
* ``sgd``: SGD with heavy-ball momentum: ``m = mu*m + D``; ``anchor -= lr*m``;
* ``average`` (the default): ``anchor -= D``, today's periodic averaging.

With ``lr == 1`` and ``mu == 0`` both optimizers are the plain average. The outer step moves the
trainable parameters only; float buffers (BatchNorm's running statistics) are averaged, as without
it. Every board and the coordinator's replica compute the same step from the same average, so the
momentum never travels per step (it does in the welcome of a joining board). No torch, no numpy:
the rules only; ``workloads.outer_step`` computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

AVERAGE: Final = "average"
DILOCO: Final = "diloco"
SGD: Final = "sgd"
OUTER_OPTIMIZERS: Final = (AVERAGE, DILOCO, SGD)
DEFAULT_OUTER_LR: Final = 0.7        # the paper's outer learning rate
DEFAULT_OUTER_MOMENTUM: Final = 0.5  # the paper's 0.9 overshoots at H = 4-8 on the lab's models (docs/training.md)
MAX_OUTER_LR: Final = 10.0           # far above any useful rate: a larger one is a typo


def outer_problem(name: object, lr: object, momentum: object) -> str:
    """Why these outer optimizer settings cannot run, in one line naming the flag; "" when they can."""
    if name not in OUTER_OPTIMIZERS:
        return f"--outer-optimizer {name!r:.30}: choose one of {', '.join(OUTER_OPTIMIZERS)}"
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0 < lr <= MAX_OUTER_LR:
        return f"--outer-lr {lr!r:.30}: give a finite learning rate in (0, {MAX_OUTER_LR:g}], e.g. {DEFAULT_OUTER_LR}"
    if (isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not math.isfinite(momentum)
            or not 0 <= momentum < 1):
        return f"--outer-momentum {momentum!r:.30}: give a momentum in [0, 1), e.g. {DEFAULT_OUTER_MOMENTUM}"
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterOptimizer:
    """How a sync step moves the anchor with the fleet's average delta (see the module's docstring)."""

    name: str = AVERAGE                     # average, diloco (SGD with Nesterov momentum) or sgd (heavy-ball momentum)
    lr: float = DEFAULT_OUTER_LR            # the outer learning rate (not used by ``average``)
    momentum: float = DEFAULT_OUTER_MOMENTUM  # the outer momentum (not used by ``average``)

    def __post_init__(self) -> None:
        problem = outer_problem(self.name, self.lr, self.momentum)
        if problem:
            raise ValueError(problem)

    @property
    def stepped(self) -> bool:
        """Whether a sync step runs an optimizer with state (anything but the plain average)."""
        return self.name != AVERAGE

    @property
    def nesterov(self) -> bool:
        return self.name == DILOCO

    def describe(self) -> str:
        """The outer step in words, for notes and ``result.json``."""
        if not self.stepped:
            return "the boards' parameters averaged"
        kind = "Nesterov" if self.nesterov else "heavy-ball"
        return f"outer SGD ({kind} momentum {self.momentum:g}, lr {self.lr:g}) on the averaged change (DiLoCo)"


PLAIN_AVERAGE: Final = OuterOptimizer()  # no outer optimizer: periodic averaging as it always was

__all__ = [
    "AVERAGE",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "DILOCO",
    "MAX_OUTER_LR",
    "OUTER_OPTIMIZERS",
    "PLAIN_AVERAGE",
    "SGD",
    "OuterOptimizer",
    "outer_problem",
]
