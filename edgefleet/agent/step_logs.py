"""What a module logs with ``self.log`` in ``training_step`` on a board, collected for the exchange.

The board's Trainer has no logger: each step's values travel with the gradient, and the
coordinator logs their sample-weighted mean over the boards with the same ``on_step``,
``on_epoch`` and ``prog_bar`` (into its own Lightning loop, so its logger, progress line and a
``ReduceLROnPlateau`` see them). The module is not changed: only this board's copy of it gets
its ``log`` method wrapped, which then calls Lightning's own.

Only numbers can be averaged: a value that is not one (a torchmetrics ``Metric``, a tensor of
many values) fails the job with an :class:`EdgeTrainError` the coordinator shows, rather than a
warning in the board's stderr that nobody reads while the metric goes missing. The launch check
(``workloads.module_audit``) refuses such modules before any board starts; this is the backstop
for what it cannot see. NaN and Inf are left out of the mean, as before.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

from edgefleet.protocol.errors import EdgeTrainError

log = logging.getLogger(__name__)

COLLECTED_HOOK = "training_step"  # values logged elsewhere on a board (its epoch hooks) stay local


class StepLogs:
    """Wraps ``model.log`` on this board's copy; :meth:`take` returns one optimizer step's values.

    With gradient accumulation a step spans several batches: a name's value is the mean over them.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._original = model.log
        self._signature = inspect.signature(self._original)
        self._sums: dict[str, list[Any]] = {}  # name -> [sum, count, on_step, on_epoch, prog_bar]
        model.log = self._log

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._model, "_current_fx_name", None) == COLLECTED_HOOK:
            self._record(name, value, args, kwargs)
        return self._original(name, value, *args, **kwargs)

    def _record(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Add one logged value to this step's sums.

        Raises:
            EdgeTrainError: ``value`` is not a number, so the fleet cannot average it over the boards.
        """
        try:
            detach = getattr(value, "detach", None)  # a tensor in the graph: as Lightning's own logging, its value only
            number = float(detach() if callable(detach) else value)
        except (TypeError, ValueError, RuntimeError):  # a torchmetrics Metric, a tensor of many values
            raise _not_a_number(name, value) from None
        if not math.isfinite(number):
            return
        bound = self._signature.bind_partial(name, value, *args, **kwargs).arguments
        on_step = True if bound.get("on_step") is None else bool(bound["on_step"])  # training_step's defaults
        on_epoch = False if bound.get("on_epoch") is None else bool(bound["on_epoch"])
        sums = self._sums.setdefault(name, [0.0, 0, on_step, on_epoch, bool(bound.get("prog_bar", False))])
        sums[0] += number
        sums[1] += 1

    def take(self) -> dict[str, list[Any]] | None:
        """This step's values (name -> [mean, on_step, on_epoch, prog_bar]), or None if nothing was logged."""
        if not self._sums:
            return None
        values = {name: [total / count, on_step, on_epoch, prog_bar]
                  for name, (total, count, on_step, on_epoch, prog_bar) in self._sums.items()}
        self._sums = {}
        return values


def _describe(value: Any) -> str:
    """What a logged value is, in the user's terms."""
    classes = type(value).__mro__
    if any(c.__name__ in ("Metric", "MetricCollection") and c.__module__.startswith("torchmetrics") for c in classes):
        return f"a torchmetrics {type(value).__name__}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    return f"a {type(value).__name__}"


def _not_a_number(name: str, value: Any) -> EdgeTrainError:
    return EdgeTrainError(
        f"self.log({name!r}, ...) in training_step logs {_describe(value)}, not a number: each board would log "
        "its own slice's value, and the fleet only averages numbers over the boards (it does not merge Metric "
        f"states across boards yet). Log a plain tensor value computed in training_step instead, e.g. "
        f"self.log({name!r}, (preds == y).float().mean()), which the fleet averages over the boards' samples; "
        "or use the Metric in validation_step only, which runs on the coordinator over the whole validation set")


__all__ = ["StepLogs"]
