"""Profile the fleet for the planner and save the profile file: the service behind ``edge-coordinator profile``.

Every board trains the request's model at each of its batch sizes (one variant after the other,
boards in parallel) and measures its link (:func:`~edgefleet.coordinator.planning.profiling.profile_fleet`);
the profiles go to a file that ``plan`` and ``train --auto`` read, with what was measured
(:class:`~edgefleet.coordinator.planning.profiles.ProfileMeta`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.coordinator.control.fleet_select import fleet_snapshot
from edgefleet.coordinator.planning.profiles import ProfileMeta, save_profiles, settings_flags
from edgefleet.coordinator.planning.profiling import profile_fleet
from edgefleet.protocol.errors import ConfigError

if TYPE_CHECKING:
    from edgefleet.coordinator.planning import FleetProfile
    from edgefleet.coordinator.planning.profiling import ProfileRequest
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

DEFAULT_PROFILE = Path("edgefleet-profile.json")


def _log_note(text: str) -> None:
    log.info("%s", text)


def profile(request: ProfileRequest, *, broker: BrokerSettings, fleet_key: bytes, path: Path,
            boards: Sequence[str] = (), on_note: Callable[[str], None] = _log_note) -> dict[str, FleetProfile]:
    """Profile ``boards`` (default: every online board that can train) and write the profile file.

    Args:
        request: The model, its variants, the dataset and how to measure.
        broker: The fleet's broker.
        fleet_key: The key that signs the boards' commands.
        path: The profile file to write (replaced atomically).
        boards: The boards to profile; () = every online board able to train.
        on_note: Receives a line per board and variant as the profiling goes.

    Returns:
        The fleet's profile of each variant, by variant label (what the file holds).

    Raises:
        ConfigError: the file's folder does not exist, or no board is online.
        EdgeTrainError: a board refused or failed the job.
    """
    if not path.parent.is_dir():
        raise ConfigError(f"--profile {path}: the folder {path.parent} does not exist")
    chosen = list(boards) or fleet_snapshot(broker).trainers()
    if not chosen:
        raise ConfigError("no boards: none is online on this broker; start edge-agent on the boards or name them with --boards")
    profiles = asyncio.run(profile_fleet(broker, fleet_key, chosen, request, on_note=on_note))
    settings = settings_flags(precision=request.precision, accumulate_grad_batches=request.accumulate_grad_batches)
    if settings:  # job_spec.JobSpec refuses layer placement with these: no cut to weigh
        on_note(f"layer placement not profiled: it does not train with {settings} yet")
    else:
        from edgefleet.coordinator.planning.layer_profile import with_cuts  # torch and the model: once the boards are done

        profiles = with_cuts(profiles, model=request.model, dataset=request.dataset,
                             dataset_options=request.dataset_options, datamodule=request.datamodule,
                             datamodule_options=request.datamodule_options, on_note=on_note)
    meta = ProfileMeta(model=request.model, dataset=request.dataset, dataset_options=request.dataset_options,
                       wire_dtype=request.wire_dtype, batch_sizes=sorted(set(request.batch_sizes)),
                       created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       datamodule=request.datamodule, datamodule_options=dict(request.datamodule_options),
                       precision=request.precision, accumulate_grad_batches=request.accumulate_grad_batches)
    save_profiles(path, profiles, meta)
    return profiles


__all__ = ["DEFAULT_PROFILE", "profile"]
