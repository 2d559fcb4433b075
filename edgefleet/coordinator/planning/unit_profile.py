"""One pipeline unit as a board measured it, as the profile file holds it (issue 35).

A board's profile job times each run of the model's layers between two admissible cuts
(``workloads.layer_timing``) and reports it (``protocol.profile_report.UnitReport``); the
coordinator keeps it in the board's :class:`~edgefleet.coordinator.planning.profiles.BoardProfile`
for the pipeline planner (``planning.pipeline_model.problem_from_fleet``). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from edgefleet.protocol.errors import PlanError
from edgefleet.protocol.profile_report import UnitReport

_HINT = "run `edge-coordinator profile` again"


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitProfile:
    """One unit's figures on one board: forward and backward lines ``a + b * n`` and bytes per sample."""

    name: str                         # the unit's last layer: the cut that ends it, or the model's last one
    forward_intercept_s: float
    forward_s_per_sample: float
    backward_intercept_s: float
    backward_s_per_sample: float
    param_bytes: int
    activation_bytes_per_sample: int  # its output, what crosses the cut after it
    held_bytes_per_sample: int        # what its forward keeps for its backward

    def __post_init__(self) -> None:
        figures = (self.forward_intercept_s, self.forward_s_per_sample, self.backward_intercept_s,
                   self.backward_s_per_sample, self.param_bytes, self.activation_bytes_per_sample,
                   self.held_bytes_per_sample)
        if not self.name or not all(math.isfinite(x) and x >= 0 for x in figures):
            raise PlanError(f"pipeline unit {self.name!r}: a figure is not a finite number >= 0 ({figures}); {_HINT}")

    @property
    def work_s_per_sample(self) -> float:
        """Forward plus backward seconds per sample on the board that measured it."""
        return self.forward_s_per_sample + self.backward_s_per_sample

    @classmethod
    def from_report(cls, unit: UnitReport) -> UnitProfile:
        return cls(name=unit.name, forward_intercept_s=unit.forward_intercept_s,
                   forward_s_per_sample=unit.forward_s_per_sample, backward_intercept_s=unit.backward_intercept_s,
                   backward_s_per_sample=unit.backward_s_per_sample, param_bytes=unit.param_bytes,
                   activation_bytes_per_sample=unit.activation_bytes_per_sample,
                   held_bytes_per_sample=unit.held_bytes_per_sample)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> UnitProfile:
        """Raises PlanError: not a unit profile (edited by hand, or another edgefleet's)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping) or set(data) != set(names):
            keys = sorted(data) if isinstance(data, Mapping) else data
            raise PlanError(f"a pipeline unit in the profile file has the keys {keys!r:.120}, expected {sorted(names)}; "
                            f"{_HINT}")
        wholes = ("param_bytes", "activation_bytes_per_sample", "held_bytes_per_sample")
        bad = [k for k in names[1:] if isinstance(data[k], bool) or not isinstance(data[k], int if k in wholes else (int, float))]
        if not isinstance(data["name"], str) or bad:
            raise PlanError(f"pipeline unit {data['name']!r:.60} in the profile file: {', '.join(bad) or 'name'} "
                            f"is not a number of the right kind; {_HINT}")
        return cls(name=data["name"], forward_intercept_s=float(data["forward_intercept_s"]),
                   forward_s_per_sample=float(data["forward_s_per_sample"]),
                   backward_intercept_s=float(data["backward_intercept_s"]),
                   backward_s_per_sample=float(data["backward_s_per_sample"]), param_bytes=data["param_bytes"],
                   activation_bytes_per_sample=data["activation_bytes_per_sample"],
                   held_bytes_per_sample=data["held_bytes_per_sample"])


__all__ = ["UnitProfile"]
