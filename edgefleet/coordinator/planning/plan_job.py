"""Choose the boards, per-board batch sizes and model variant for a job: the service behind ``edge-coordinator plan``.

The profile file (``edge-coordinator profile``) is checked against the job (model, dataset) and,
given a broker, against the fleet as it is now (which profiled boards are online, and which agent
version each runs); then :func:`edgefleet.coordinator.planning.plan` estimates every candidate
under the :class:`PlanRequest`'s objective and constraints. ``verify.verify_candidates`` then
pre-trains the best few, on :func:`job_to_verify`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.control.fleet_select import fleet_snapshot
from edgefleet.coordinator.planning import candidate_modes, format_duration
from edgefleet.coordinator.planning import plan as search_plan  # this module's plan() is the service around it
from edgefleet.coordinator.planning.modes import TrainingMode
from edgefleet.coordinator.planning.plan_fleet import (
    FleetCheck,
    check_fleet,
    load_profile_file,
    only_named,
    restrict_to,
    select_variants,
)
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.protocol.errors import ConfigError, PlanError

if TYPE_CHECKING:  # numpy loads only when a plan is made, not with the command line's parser
    from edgefleet.coordinator.planning import Candidate, FleetProfile, PlanResult
    from edgefleet.coordinator.planning.profiles import ProfileMeta
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

DEFAULT_GLOBAL_BATCHES = (32, 64, 128)  # each split among the boards by the planner
DEFAULT_FEWER_BOARDS_PCT = 2.0          # planning.search.FEWER_BOARDS_WITHIN, in percent
DEFAULT_MAX_MEMORY_FRACTION = 0.9
DEFAULT_VERIFY_STEPS = 20               # timed steps per pre-trained candidate
INEXACT_MARGIN_PCT = 10.0               # planning.modes.INEXACT_MARGIN, in percent (for --help, without numpy)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """The objective and constraints of one planning request, in ``planning.plan``'s units.

    Attributes:
        objective: What to minimise per epoch (:data:`~edgefleet.coordinator.planning.objectives.OBJECTIVES`).
        max_power_w: The taking-part boards together draw at most this (None: no cap).
        deadline_s: An epoch takes at most this (None: no deadline).
        global_batches: The global batch sizes to consider, each split among the boards.
        count_idle: Charge the idle power of the boards left out to the energy.
        max_memory_fraction: Share of a board's memory a predicted peak may use.
        top: Candidates kept in the ranking.
        fewer_boards_within: Of the candidates within this fraction of the best estimate, the one
            with the fewest boards is chosen.
        allow_inexact: Also consider training modes that change the mathematics (local SGD every
            2, 4 or 8 steps: ``planning.modes``); one is chosen only when clearly better than exact.
        outer_optimizer: ``diloco``: with ``allow_inexact``, DiLoCo (``planning.modes.diloco``) is weighed too.
        deadline_text: How the deadline was asked for (e.g. ``--deadline 30 min over 5 epochs = 6.0
            min per epoch``), added to a refusal that names it.
    """

    objective: str
    max_power_w: float | None
    deadline_s: float | None
    global_batches: tuple[int, ...]
    count_idle: bool
    max_memory_fraction: float
    top: int
    fewer_boards_within: float = DEFAULT_FEWER_BOARDS_PCT / 100
    deadline_text: str = ""
    allow_inexact: bool = False
    outer_optimizer: str = "average"

    def run(self, profiles: Mapping[str, FleetProfile], *, deadline_text: str = "",
            placements: tuple[TrainingMode, ...] = ()) -> PlanResult:
        """``planning.plan`` over ``profiles``, with the layer placement modes ``placements``; ``deadline_text``
        (default: the request's) explains a refusal's deadline."""
        deadline_text = deadline_text or self.deadline_text
        try:
            return search_plan(dict(profiles), objective=self.objective, max_power_w=self.max_power_w, deadline_s=self.deadline_s,
                               global_batches=self.global_batches, count_idle=self.count_idle,
                               max_memory_fraction=self.max_memory_fraction, top=self.top,
                               fewer_boards_within=self.fewer_boards_within,
                               modes=candidate_modes(allow_inexact=self.allow_inexact, placements=placements,
                                                     outer_optimizer=self.outer_optimizer))
        except PlanError as exc:
            if deadline_text and "--deadline" in str(exc):
                raise PlanError(f"{exc} ({deadline_text})") from None
            raise


def deadline_text(deadline_min: float | None, epochs: float) -> str:
    """``"--deadline 30 min over 5 epochs = 6.0 min per epoch"``, or "" without a deadline."""
    if deadline_min is None:
        return ""
    return (f"--deadline {deadline_min:g} min over {epochs:g} epoch{'s' if epochs != 1 else ''} = "
            f"{format_duration(deadline_min * 60 / epochs)} per epoch")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOutcome:
    """A plan and what it was made on."""

    result: PlanResult
    profiles: dict[str, FleetProfile]   # the job's variants as profiled (every profiled board)
    meta: ProfileMeta | None            # what the profile file says it measured
    check: FleetCheck                   # the boards that could take part
    notes: tuple[str, ...]              # boards left out, the fleet not checked, and the like

    @property
    def dataset_len(self) -> int:
        """Samples in the profiled dataset's training split."""
        return next(iter(self.profiles.values())).dataset_len


def plan(request: PlanRequest, *, profile_path: Path, model: str | None = None,
         variants: list[dict[str, Any]] | None = None, dataset: str | None = None,
         dataset_options: dict[str, Any] | None = None, broker: BrokerSettings | None = None,
         placement: str = "auto", boards: Sequence[str] = ()) -> PlanOutcome:
    """Plan the job over the profile file's boards that can take part now.

    Args:
        request: Objective and constraints.
        profile_path: The profile file.
        model, dataset, dataset_options: The job's; None = the profile's.
        variants: The model-option dicts to plan over; None = every profiled variant of the model.
        broker: Where to check the fleet (boards online, agent versions); None plans on the
            profile alone, as if every profiled board were there.
        placement: ``auto``: weigh layer placement at every cut the model admits against data-parallel
            (the profile file's cuts, measured on the coordinator: ``planning.layer_profile``); a cut's
            name: that cut only; ``none``: data-parallel only.
        boards: Plan over these boards only (``--boards``); () = every board that can take part.

    Raises:
        PlanError: the profile does not fit the job or the fleet, or no configuration meets the
            request (the message names the constraint and by how much).
        BrokerError: the broker cannot be reached.
    """
    selected, meta, check, notes = profiled_fleet(profile_path, model=model, variants=variants, dataset=dataset,
                                                  dataset_options=dataset_options, broker=broker, boards=boards)
    fleet = restrict_to(selected, check)
    placements = placement_modes(placement, fleet, notes)  # a tail's host is one of the boards that can take part
    result = request.run(fleet, placements=placements)
    return PlanOutcome(result=result, profiles=selected, meta=meta, check=check, notes=tuple(notes))


def profiled_fleet(profile_path: Path, *, model: str | None, variants: list[dict[str, Any]] | None,
                   dataset: str | None, dataset_options: dict[str, Any] | None, broker: BrokerSettings | None,
                   boards: Sequence[str] = ()) -> tuple[dict[str, FleetProfile], ProfileMeta | None, FleetCheck, list[str]]:
    """The job's profiled variants, the profile's meta, the boards that can take part now and the notes on them:
    what a data-parallel plan (:func:`plan`) and a pipeline plan (``planning.pipeline_job``) start from.
    ``boards``: plan over these only (``--boards``; () = every board that can take part).

    Raises:
        PlanError: the profile does not fit the job or the fleet.
        BrokerError: the broker cannot be reached.
    """
    profiles, meta = load_profile_file(profile_path)
    selected = select_variants(profiles, meta=meta, model=model, variants=variants, dataset=dataset,
                               dataset_options=dataset_options)
    notes: list[str] = []
    if broker is None:
        check = FleetCheck.unchecked(selected)
        notes.append("not checked against the fleet (--no-fleet-check): boards and agent versions are the profile's")
    else:
        check = check_fleet(selected, fleet_snapshot(broker).rows)
    if boards:
        check = only_named(check, boards)
    notes += check.notes
    return dict(selected), meta, check, notes


def placement_modes(placement: str, selected: Mapping[str, FleetProfile], notes: list[str], *,
                    keyed: Collection[str] | None = None) -> tuple[TrainingMode, ...]:
    """The layer placement modes to weigh (``placement``: auto, a cut, or none); why none, in ``notes``.

    ``keyed``: the boards with a key of their own on this coordinator (``train --auto``: a tail on a board is a
    pipeline, whose stage links need every board's key), None: not known (``plan``), every board taken as keyed.

    Raises:
        PlanError: a named cut the model does not admit (the message lists those it does).
    """
    if placement == "none":
        return ()
    if len(selected) != 1:
        notes.append("layer placement is weighed for one model variant at a time: plan a variant on its own to weigh it")
        return ()
    from edgefleet.coordinator.planning.layer_profile import cut_modes  # torch: only when weighing cuts

    profile = next(iter(selected.values()))
    modes, why_not = cut_modes(profile, only="" if placement == "auto" else placement)
    if why_not:
        notes.append(f"layer placement not weighed: {why_not}")
    unkeyed = sorted(set(profile.boards) - set(keyed)) if keyed is not None else []
    if unkeyed and any(m.tail_board for m in modes):
        modes = tuple(m for m in modes if not m.tail_board)
        notes.append(f"a board as the tail host not weighed: its stage links need each board's own key, and "
                     f"{', '.join(unkeyed)} have none here (--board-keys)")
    return modes


def job_to_verify(meta: ProfileMeta | None, *, model: str | None, model_options: dict[str, Any] | None,
                  dataset: str | None, dataset_options: dict[str, Any] | None, allow_token_boards: bool = False) -> JobSpec:
    """The job a plan's candidates are pre-trained on: the one given, else the one the profile measured
    (its DataModule when it measured one and no dataset is given); with the profile's wire dtype,
    precision and accumulation, which its step times are of.

    ``allow_token_boards``: boards without a key of their own may join with a token (``--allow-token-boards``).

    Raises:
        PlanError: neither the arguments nor the profile say which model and data.
    """
    model = model or (meta.model if meta is not None else None)
    datamodule = meta.datamodule if meta is not None and not dataset else ""
    dataset = dataset or (meta.dataset if meta is not None else None)
    if model is None or not (dataset or datamodule):
        raise PlanError("--verify needs to know what to train: the profile does not say, so give --model and --dataset")
    if dataset_options is None and meta is not None and dataset == meta.dataset:
        dataset_options = dict(meta.dataset_options)
    if meta is None:
        return JobSpec(model=model, model_options=model_options or {}, dataset=dataset or "",
                       dataset_options=dataset_options or {}, allow_token_boards=allow_token_boards)
    return JobSpec(model=model, model_options=model_options or {}, dataset="" if datamodule else dataset or "",
                   dataset_options={} if datamodule else dataset_options or {}, datamodule=datamodule,
                   datamodule_options=dict(meta.datamodule_options) if datamodule else {}, wire_dtype=meta.wire_dtype,
                   precision=meta.precision, accumulate_grad_batches=meta.accumulate_grad_batches,
                   allow_token_boards=allow_token_boards)


def mode_job_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A training mode's JobSpec keywords (``{"sync_every": 4}``, ``{"placement": "net.6"}``; ``{}`` for the exact mode).

    Only an inexact or a layer placement mode passes any, so a data-parallel exact plan builds the
    same JobSpec as before the modes existed, whatever fields the JobSpec has.

    Raises:
        ConfigError: the JobSpec has no such field (this edgefleet's ``train`` cannot run the mode).
    """
    known = {f.name for f in dataclasses.fields(JobSpec)}
    missing = sorted(set(options) - known)
    if missing:
        raise ConfigError(f"the plan chose a training mode this edgefleet's train cannot run (no JobSpec "
                          f"{', '.join(missing)}); plan without --allow-inexact")
    return dict(options)


def candidate_fields(candidate: Candidate) -> dict[str, Any]:
    """The JobSpec keywords that train ``candidate`` as planned: its boards, batch sizes and mode. Layer placement
    with the tail on a board is the two-stage pipeline ``HEAD+...,CUT@BOARD`` with the later stage's state sent only
    at checkpoints (``--stage-sync checkpoint``), as its cost (``planning.modes.placed_on_board``) assumes.

    Raises:
        ConfigError: the mode sets a keyword this JobSpec lacks (:func:`mode_job_options`).
    """
    mode = candidate.mode
    if mode.tail_board:
        return {"boards": (*candidate.boards, mode.tail_board), "batch_sizes": (*candidate.batch_sizes, 0),
                "placement": "", "pipeline": f"{'+'.join(candidate.boards)},{mode.placement}@{mode.tail_board}",
                "stage_sync": "checkpoint"}
    return {"boards": tuple(candidate.boards), "batch_sizes": tuple(candidate.batch_sizes), "placement": mode.placement,
            **mode_job_options(mode.job_options)}


__all__ = ["DEFAULT_FEWER_BOARDS_PCT", "DEFAULT_GLOBAL_BATCHES", "DEFAULT_MAX_MEMORY_FRACTION", "DEFAULT_VERIFY_STEPS",
           "INEXACT_MARGIN_PCT", "PlanOutcome", "PlanRequest", "candidate_fields", "deadline_text", "job_to_verify",
           "mode_job_options", "placement_modes", "plan"]
