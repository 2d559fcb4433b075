"""What the planner can minimise, per epoch: ``time``, ``energy`` or their product ``edp``.

A module of its own, without numpy, so that the command line can list the objectives in
``--help`` and the planner, the pre-training check and the reports all spell them alike.
"""

from __future__ import annotations

OBJECTIVES = ("time", "energy", "edp")
DEFAULT_OBJECTIVE = "edp"
# The figure each objective minimises: a field of both planning.Estimate and verify.Measurement.
OBJECTIVE_KEY = {"time": "epoch_time_s", "energy": "energy_per_epoch_j", "edp": "edp_j_s"}
# How a table or a note names each objective.
OBJECTIVE_TEXT = {"time": "time per epoch", "energy": "energy per epoch", "edp": "energy x time (EDP)"}

__all__ = ["DEFAULT_OBJECTIVE", "OBJECTIVES", "OBJECTIVE_KEY", "OBJECTIVE_TEXT"]
