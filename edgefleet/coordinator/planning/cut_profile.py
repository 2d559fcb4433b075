"""One cut's layer profile as the profile file holds it (``planning.layer_profile`` measures it), and the
planner's training mode for it (``planning.modes.placed``). No torch here: the planner reads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from edgefleet.coordinator.planning.modes import TrainingMode, placed, placed_on_board
from edgefleet.protocol.errors import PlanError

FLOAT_BYTES = 4


@dataclass(frozen=True)
class CutProfile:
    """One cut's figures, measured on the coordinator (``planning.layer_profile``'s module doc)."""

    name: str
    boundary_elements: int   # per sample, each way
    output_elements: int     # per sample, each way
    head_params: int
    tail_params: int
    head_share: float        # of a sample's forward and backward compute
    host_a_s: float          # the tail's forward and backward on the coordinator: a + c * N
    host_c_s: float

    def mode(self, grad_bytes: int) -> TrainingMode:
        """The planner's training mode for this cut (``planning.modes.placed``)."""
        return placed(self.name, grad_bytes=grad_bytes, head_bytes=self.head_params * FLOAT_BYTES,
                      per_sample_bytes=(self.boundary_elements + self.output_elements) * FLOAT_BYTES,
                      sample_scale=self.head_share, host_a_s=self.host_a_s, host_c_s=self.host_c_s)

    def board_mode(self, grad_bytes: int, board: Any) -> TrainingMode:
        """The planner's mode for this cut with the tail on ``board`` (``planning.modes.placed_on_board``)."""
        return placed_on_board(self.name, board, grad_bytes=grad_bytes, head_bytes=self.head_params * FLOAT_BYTES,
                               per_sample_bytes=(self.boundary_elements + self.output_elements) * FLOAT_BYTES,
                               head_share=self.head_share)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CutProfile:
        """Raises PlanError: not a cut profile (edited by hand, or another edgefleet's)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, Mapping) or set(data) != names:
            raise PlanError(f"a cut profile in the profile file has the keys {sorted(data) if isinstance(data, Mapping) else data!r:.80}, "
                            f"expected {sorted(names)}: profile again")
        try:
            profile = cls(name=str(data["name"]), boundary_elements=int(data["boundary_elements"]),
                          output_elements=int(data["output_elements"]), head_params=int(data["head_params"]),
                          tail_params=int(data["tail_params"]), head_share=float(data["head_share"]),
                          host_a_s=float(data["host_a_s"]), host_c_s=float(data["host_c_s"]))
        except (TypeError, ValueError):
            raise PlanError(f"a cut profile in the profile file holds a value that is not a number ({data!r:.120}): "
                            "profile again") from None
        if min(profile.boundary_elements, profile.output_elements, profile.head_params) < 0 or not (
                0 < profile.head_share <= 1 and profile.host_a_s >= 0 and profile.host_c_s >= 0):
            raise PlanError(f"cut profile {profile.name}: a figure out of range ({data!r:.120}): profile again")
        return profile


__all__ = ["FLOAT_BYTES", "CutProfile"]
