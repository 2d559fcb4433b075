"""Planning: profiling the boards, the cost model, the search over configurations, verification.

This package's names are pure computation (numpy, no MQTT, no torch): ``edge-coordinator profile``
writes the profile file (``planning.profiling``, ``planning.profile_job``), ``edge-coordinator plan``
and ``train --auto`` call :func:`plan` (``planning.plan_job``), ``planning.verify`` checks a plan
against a short measured run. Re-balancing during a run is the run's (``coordinator.run.rebalance``).
"""

from __future__ import annotations

from edgefleet.coordinator.planning.cost_model import (
    Candidate,
    Estimate,
    allocate_batches,
    estimate,
    format_duration,
)
from edgefleet.coordinator.planning.modes import (
    EXACT,
    INEXACT_MARGIN,
    LOCAL_SGD_EVERY,
    TrainingMode,
    candidate_modes,
    local_sgd,
)
from edgefleet.coordinator.planning.objectives import OBJECTIVES
from edgefleet.coordinator.planning.pareto import pareto_front, write_pareto_png
from edgefleet.coordinator.planning.profiles import (
    PROFILE_SCHEMA_VERSION,
    BatchPoint,
    BoardProfile,
    FleetProfile,
    ProfileMeta,
    check_compatible,
    load_profile_meta,
    load_profiles,
    model_key,
    save_profiles,
    variant_label,
)
from edgefleet.coordinator.planning.search import (
    Exclusion,
    GapReport,
    PlanResult,
    heuristic_gap,
    plan,
)

__all__ = [
    "EXACT",
    "INEXACT_MARGIN",
    "LOCAL_SGD_EVERY",
    "OBJECTIVES",
    "PROFILE_SCHEMA_VERSION",
    "BatchPoint",
    "BoardProfile",
    "Candidate",
    "Estimate",
    "Exclusion",
    "FleetProfile",
    "GapReport",
    "PlanResult",
    "ProfileMeta",
    "TrainingMode",
    "allocate_batches",
    "candidate_modes",
    "check_compatible",
    "estimate",
    "format_duration",
    "heuristic_gap",
    "load_profile_meta",
    "load_profiles",
    "local_sgd",
    "model_key",
    "pareto_front",
    "plan",
    "save_profiles",
    "variant_label",
    "write_pareto_png",
]
