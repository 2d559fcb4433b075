"""Does the profile fit the job and the fleet as it is now? Shared by ``plan`` and ``train --auto``.

* :func:`select_variants`: the profiled variants of the job's model (a profile of another model,
  dataset or a missing variant is refused, naming what to profile);
* :func:`check_fleet`: which profiled boards can take part now (offline, busy or untrainable ones
  are left out with a reason), and whether each still runs the agent version that measured it;
* :func:`restrict_to`: the profiles cut down to those boards, ready for ``planning.plan``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.coordinator.control.fleet import BoardRow
from edgefleet.coordinator.planning import (
    FleetProfile,
    check_compatible,
    load_profiles,
    model_key,
    variant_label,
)
from edgefleet.coordinator.planning.profiles import ProfileMeta, load_profile_meta
from edgefleet.coordinator.planning.variants import VARIANT_FLAGS
from edgefleet.protocol.errors import PlanError

log = logging.getLogger(__name__)

def load_profile_file(path: Path) -> tuple[dict[str, FleetProfile], ProfileMeta | None]:
    """The profile file's variants and its metadata (None when the file carries none).

    Raises:
        PlanError: the file is missing or unreadable (the message says to run ``profile``).
    """
    return load_profiles(path), load_profile_meta(path)


def _describe(name: str, options: Mapping[str, Any] | None) -> str:
    return name + (f" ({','.join(f'{k}={v}' for k, v in sorted(options.items()))})" if options else "")


def _input_shape(profiles: Mapping[str, FleetProfile]) -> list[int]:
    """One sample's shape, as the profile's model keys record it (``…[1,32,32]``)."""
    key = next(iter(profiles.values())).model_key
    return [int(x) for x in json.loads(key[key.rindex("["):])]


def _profile_hint(model: str, variants: Sequence[Mapping[str, Any]]) -> str:
    flags = []
    for flag, option in VARIANT_FLAGS.items():
        values = sorted({v[option] for v in variants if option in v})
        if values:
            flags.append(f"--{flag} {','.join(map(str, values))}")
    return " ".join([f"edge-coordinator profile --model {model}", *flags])


def _data_text(dataset: str, dataset_options: Mapping[str, Any], datamodule: str,
               datamodule_options: Mapping[str, Any], *, kind: bool = True) -> str:
    """``dataset digits``, ``DataModule pkg.mod:Class (n=64)``; without the kind with ``kind=False``."""
    if datamodule:
        return ("DataModule " if kind else "") + _describe(datamodule, datamodule_options)
    return ("dataset " if kind else "") + _describe(dataset, dataset_options)


def select_variants(profiles: Mapping[str, FleetProfile], *, meta: ProfileMeta | None, model: str | None,
                    variants: list[dict[str, Any]] | None, dataset: str | None = None,
                    dataset_options: dict[str, Any] | None = None, datamodule: str | None = None,
                    datamodule_options: dict[str, Any] | None = None) -> dict[str, FleetProfile]:
    """The profiled variants to plan over.

    Args:
        profiles: The profile file's variants, by label.
        meta: The file's ``ProfileMeta`` (model, dataset, …) or None.
        model: The job's model; None = the profile's.
        variants: The model-option dicts asked for (``--model-options`` and ``--layers`` …);
            None = every profiled variant of the model. A variant found in the profile is
            returned with these options (its ``variant``), so a candidate trains with the job's own.
        dataset: The job's dataset ("" with a DataModule); None = the profile's data.
        dataset_options: The job's dataset options; None = the profile's.
        datamodule: The job's LightningDataModule ("" with a dataset); None = the profile's data when
            ``dataset`` is None too, else none.
        datamodule_options: The DataModule's options; None = the profile's.

    Raises:
        PlanError: the profile was measured for another model or data, or lacks a variant
            asked for; the message names the ``profile`` command that fixes it.
    """
    model = model or (meta.model if meta is not None else None)
    if meta is not None and (dataset is not None or datamodule is not None):
        theirs = (meta.dataset, dict(meta.dataset_options or {}), meta.datamodule, dict(meta.datamodule_options or {}))
        dataset, datamodule = dataset or "", datamodule or ""
        ours = (dataset, dict(dataset_options if dataset_options is not None else
                              (meta.dataset_options if dataset == meta.dataset else {})),
                datamodule, dict(datamodule_options if datamodule_options is not None else
                                 (meta.datamodule_options if datamodule == meta.datamodule else {})))
        if ours != theirs:
            fix = ("profile the job's DataModule: train --auto does" if datamodule else
                   f"profile this job: edge-coordinator profile --model {model} --dataset {dataset}")
            same_kind = bool(ours[2]) == bool(theirs[2])
            raise PlanError(f"the profile was measured on {_data_text(*theirs)}, this job uses "
                            f"{_data_text(*ours, kind=not same_kind)}; {fix}")
    keys = sorted(fp.model_key for fp in profiles.values())
    if model is None:  # neither the flags nor the file name the model: the profile stands for itself
        if variants is None:
            return dict(profiles)
        chosen = {label: fp for label, fp in profiles.items()
                  if any(all(fp.variant.get(k) == v for k, v in want.items()) for want in variants)}
        if not chosen:
            raise PlanError(f"no profiled variant matches {', '.join(variant_label(v) for v in variants)} "
                            f"(the profile has {', '.join(sorted(profiles))}); profile those variants first")
        return chosen
    same_model = {label: fp for label, fp in profiles.items() if fp.model_key.startswith(model + "{")}
    if not same_model:
        raise PlanError(f"the profile was measured for {', '.join(keys)}, this job is model {model}; a profile "
                        f"is tied to one model. Profile this job: {_profile_hint(model, variants or [])}")
    if variants is None:
        return same_model
    shape = _input_shape(profiles)
    by_key = {fp.model_key: (label, fp) for label, fp in profiles.items()}
    chosen, missing = {}, []
    for want in variants:
        found = by_key.get(model_key(model, want, shape))
        if found is None:
            missing.append(want)
        else:  # the job's own options: they may differ from the profiled ones in cost-neutral options (lr)
            chosen[found[0]] = dataclasses.replace(found[1], variant=dict(want))
    if missing:
        have = ", ".join(sorted(variant_label(fp.variant) for fp in same_model.values()))
        raise PlanError(f"variant(s) {'; '.join(variant_label(v) for v in missing)} of {model} are not in the profile "
                        f"(it has {have}); profile them: {_profile_hint(model, missing)}")
    return chosen


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetCheck:
    """Which profiled boards can take part now."""

    boards: tuple[str, ...]                                   # profiled, online, idle, able to train
    left_out: dict[str, str] = field(default_factory=dict)    # profiled board -> why it cannot take part
    versions: dict[str, str] = field(default_factory=dict)    # agent version each usable board runs now
    notes: tuple[str, ...] = ()                               # one line per board left out, and the like

    @classmethod
    def unchecked(cls, profiles: Mapping[str, FleetProfile]) -> FleetCheck:
        """Every profiled board, as the profile says (``--no-fleet-check``)."""
        return cls(boards=tuple(sorted({b for fp in profiles.values() for b in fp.boards})))


def _why_not(row: BoardRow | None) -> str:
    if row is None:
        return "it has not reported on this broker since (is its agent running?)"
    if row.state == "offline":
        return f"it is offline ({row.offline_reason or 'unknown reason'})"
    if row.state == "busy":
        return "it is busy with another job"
    if row.caps is not None and not row.caps.training_available:
        return "it cannot train (no torch/Lightning there: pip install 'edgefleet[train]')"
    return ""


def check_fleet(profiles: Mapping[str, FleetProfile], rows: Sequence[BoardRow], *,
                wanted: Sequence[str] | None = None) -> FleetCheck:
    """Compare the profiled boards with a fleet snapshot.

    Args:
        profiles: The variants to plan over.
        rows: The fleet now (``control.fleet_select.fleet_snapshot``'s rows).
        wanted: Only these boards may take part (``train --boards``); None = any.

    Raises:
        PlanError: a usable board now runs another agent version than the one that profiled it,
            or no profiled board can take part.
    """
    by_id = {r.board_id: r for r in rows}
    profiled = sorted({b for fp in profiles.values() for b in fp.boards})
    notes: list[str] = []
    left_out: dict[str, str] = {}
    usable: list[str] = []
    for board in profiled:
        if wanted is not None and board not in wanted:
            continue
        why = _why_not(by_id.get(board))
        if why:
            left_out[board] = why
            notes.append(f"board {board} is left out of the plan: {why}")
        else:
            usable.append(board)
    for board in sorted(set(wanted or ()) - set(profiled)):
        notes.append(f"board {board} was not profiled, so it cannot be planned with; profile it to include it")
    if wanted is None:
        unprofiled = [r.board_id for r in rows if r.board_id not in profiled and not _why_not(r)]
        if unprofiled:
            notes.append(f"online but not in the profile (profile them to include them): {', '.join(unprofiled)}")
    versions = {}
    for board in usable:
        caps = by_id[board].caps
        if caps is not None and caps.agent_version:  # an agent too old to say cannot be checked
            versions[board] = caps.agent_version
    for fp in profiles.values():
        check_compatible(fp, fp.model_key, {b: v for b, v in versions.items() if b in fp.boards})
    if not usable:
        raise PlanError(f"none of the profiled boards ({', '.join(profiled)}) can take part now: "
                        + "; ".join(f"{b}: {why}" for b, why in left_out.items())
                        + ". Start their agents, or plan on the profile alone with --no-fleet-check")
    if left_out:
        notes.append(f"planning over {len(usable)} of {len(profiled)} profiled boards: {', '.join(usable)}")
    return FleetCheck(boards=tuple(usable), left_out=left_out, versions=versions, notes=tuple(notes))


def only_named(check: FleetCheck, named: Sequence[str]) -> FleetCheck:
    """The check cut down to the boards ``named`` (``plan --boards``), each of which must be able to take part.

    Raises:
        PlanError: a named board that cannot take part now (saying why) or that the profile does not hold.
    """
    for board in named:
        if board not in check.boards:
            why = check.left_out.get(board)
            raise PlanError(f"--boards names {board}, which " + (
                f"cannot take part now: {why}" if why else "the profile does not hold: profile it, or leave it out"))
    return dataclasses.replace(check, boards=tuple(b for b in check.boards if b in named), left_out={}, notes=())


def restrict_to(profiles: Mapping[str, FleetProfile], check: FleetCheck) -> dict[str, FleetProfile]:
    """Each variant's profile cut down to the boards that can take part (variants with none are dropped)."""
    out = {}
    for label, fp in profiles.items():
        boards = [b for b in check.boards if b in fp.boards]
        if boards:
            out[label] = fp if len(boards) == len(fp.boards) else fp.select(boards)
    if not out:
        raise PlanError(f"no profiled variant covers the boards that can take part ({', '.join(check.boards)})")
    return out


__all__ = ["FleetCheck", "check_fleet", "load_profile_file", "only_named", "restrict_to", "select_variants"]
