"""Train with an automatic configuration (``edge-coordinator train --auto``): profile (or reuse a
profile), plan, train the chosen configuration, and measure it against the plan's prediction.

1. Profile: a saved profile is reused when it was measured for this model, data (dataset or
   DataModule), wire dtype, precision, gradient accumulation and the agent versions the boards run
   now; otherwise (or with ``reprofile``) the online boards are profiled again, timing the job's own
   steps (its data, precision and K batches per step), and the file rewritten, with a note saying why.
   The plan then counts K x the global batch per step; its batch sizes are per batch and the job
   keeps its K, precision and DataModule.
2. Plan over the boards that are online (the job's ``boards`` narrow them); ``verify=K``
   pre-trains the best K and takes the best measured.
3. Just before training the fleet is looked at again: a planned board that went offline is left
   out and the plan recomputed, with a note saying so.
4. Train while :class:`PowerMeter` follows every board's power; then measure the run (step time,
   samples/s, time, power, energy per epoch, EDP) against the prediction, in ``plan.json``.

With ``request.allow_inexact`` the plan may choose a mode that changes the mathematics (local SGD);
the job then gets the mode's JobSpec keywords (``sync_every``), and the measurement leaves out
the mode's exact warm-up and times whole periods of H steps, as the steady-state prediction counts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.control.fleet_select import fleet_snapshot
from edgefleet.coordinator.control.monitor import monitor_fleet, wait_for_snapshot
from edgefleet.coordinator.control.power_meter import PowerMeter
from edgefleet.coordinator.planning.plan_fleet import check_fleet, load_profile_file, restrict_to, select_variants
from edgefleet.coordinator.planning.plan_job import DEFAULT_VERIFY_STEPS, PlanRequest, candidate_fields, placement_modes
from edgefleet.coordinator.planning.plan_summary import estimate_json, fewer_boards_line, summary_of
from edgefleet.coordinator.planning.profile_job import DEFAULT_PROFILE, profile
from edgefleet.coordinator.planning.profiles import check_settings, settings_flags
from edgefleet.coordinator.planning.profiling import ProfileRequest
from edgefleet.coordinator.planning.verify import WARMUP_STEPS, measure, step_intervals, verify_candidates
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.train_job import TrainObserver, resolve_job, train
from edgefleet.protocol.errors import ConfigError, EdgeTrainError, PlanError
from edgefleet.protocol.signing import CoordinatorKeys

if TYPE_CHECKING:
    from edgefleet.coordinator.control.fleet_select import FleetSnapshot
    from edgefleet.coordinator.planning import Estimate, FleetProfile, PlanResult
    from edgefleet.coordinator.planning.plan_fleet import FleetCheck
    from edgefleet.coordinator.planning.verify import Measurement, VerifyResult
    from edgefleet.coordinator.run.training import TrainOutcome
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

READY_WAIT_S = 60.0   # a board that just finished profiling or pre-training is busy until its worker exits


class AutoTrainObserver(TrainObserver):
    """What ``auto_train`` reports as it goes, besides the training run's steps and notes; no-ops here."""

    def planned(self, result: PlanResult, request: PlanRequest) -> None:
        """The plan was made (before any pre-training)."""

    def verified(self, result: VerifyResult) -> None:
        """The best candidates were pre-trained and one chosen on measurement."""


@dataclass(frozen=True, kw_only=True)
class AutoTrainOutcome:
    """How an automatically configured run went, against its prediction."""

    chosen: Estimate                  # the configuration trained, as the plan predicted it
    training: TrainOutcome            # the run itself
    measured: Measurement | None      # the run's measured figures (None: too few steps, no telemetry)
    measure_note: str                 # how it was measured, or why it was not
    profile_s: float                  # time spent profiling (0: the saved profile was reused)
    verify_s: float                   # time spent pre-training candidates

    @property
    def run_dir(self) -> Path:
        return self.training.run_dir


def check_auto_job(spec: JobSpec, request: PlanRequest) -> None:
    """Refuse what the planner cannot plan for.

    A DataModule, gradient accumulation and a precision are planned for: the profile measures the
    job's own steps (``planning.profiling.ProfileRequest``).

    Raises:
        ConfigError: the job has a deadline with a step count, or fixes the training mode
            (``--sync-every``: with ``--auto`` the planner chooses it).
    """
    if request.deadline_s is not None and spec.steps is not None:
        raise ConfigError("--deadline is per run of --epochs epochs; give --epochs instead of --steps")
    sync_every = getattr(spec, "sync_every", 1)  # JobSpec.sync_every: local SGD (absent before that mode existed)
    if sync_every != 1:
        raise ConfigError(f"--sync-every {sync_every} with --auto: the planner chooses the training mode; "
                          "add --allow-inexact (instead of --sync-every) to let it consider local SGD, or train "
                          "without --auto")


def _job_settings(spec: JobSpec) -> str:
    """The job's settings that change what a step computes, as flags ("" for the defaults)."""
    return settings_flags(precision=spec.precision, accumulate_grad_batches=spec.accumulate_grad_batches)


def _modes_for(spec: JobSpec, request: PlanRequest, placement: str,
               note: Callable[[str], None]) -> tuple[PlanRequest, str]:
    """The request and placement the job's settings allow: ``job_spec.JobSpec`` refuses layer placement with
    accumulation or mixed precision, and local SGD with accumulation or 16-mixed; those are not weighed.

    Raises:
        ConfigError: ``--placement`` names a cut with such a setting.
    """
    settings = _job_settings(spec)
    if settings and placement != "none":
        if placement != "auto":
            raise ConfigError(f"--placement {placement} cannot be combined with {settings} yet (the tail host would see "
                              "another step than the boards): leave it out, or train with --placement none")
        note(f"layer placement not weighed: it does not train with {settings} yet")
        placement = "none"
    no_local_sgd = [flag for flag, given in ((f"--accumulate-grad-batches {spec.accumulate_grad_batches}",
                                              spec.accumulate_grad_batches != 1),
                                             ("--precision 16-mixed", spec.precision == "16-mixed")) if given]
    if request.allow_inexact and no_local_sgd:
        note(f"local SGD not weighed (--allow-inexact): it does not train with {' '.join(no_local_sgd)}")
        request = replace(request, allow_inexact=False)
    return request, placement


@dataclass(frozen=True, kw_only=True)
class _Fleet:
    """Where the job runs: the broker, the key and the boards it may use."""

    broker: BrokerSettings
    fleet_key: bytes
    wanted: list[str] | None          # the job's boards, or None: any


def _profiles(spec: JobSpec, variants: list[dict[str, Any]], fleet: _Fleet, snapshot: FleetSnapshot, path: Path,
              reprofile: bool, note: Callable[[str], None]) -> tuple[dict[str, FleetProfile], float]:
    """The profiles to plan with: the saved ones if they fit this job and fleet, else fresh ones; and the time profiling took."""
    reason = "asked to (--reprofile)" if reprofile else ""
    if not reason:
        try:
            profiles, meta = load_profile_file(path)
            selected = select_variants(profiles, meta=meta, model=spec.model, variants=variants, dataset=spec.dataset,
                                       dataset_options=spec.dataset_options, datamodule=spec.datamodule,
                                       datamodule_options=spec.datamodule_options)
            if meta is not None and meta.wire_dtype != spec.wire_dtype:
                raise PlanError(f"it was measured with --wire-dtype {meta.wire_dtype}, this run uses {spec.wire_dtype}")
            check_settings(meta, precision=spec.precision, accumulate_grad_batches=spec.accumulate_grad_batches)
            check_fleet(selected, snapshot.rows, wanted=fleet.wanted)
            settings = _job_settings(spec)
            note(f"reusing the profile {path} (it fits this model, {'DataModule' if spec.datamodule else 'dataset'}"
                 f"{', ' + settings if settings else ''} and the agents' versions)")
            return selected, 0.0
        except PlanError as exc:
            reason = str(exc)
    return _profile_now(spec, variants, fleet, snapshot, path, reason, note)


def _profile_now(spec: JobSpec, variants: list[dict[str, Any]], fleet: _Fleet, snapshot: FleetSnapshot, path: Path,
                 reason: str, note: Callable[[str], None]) -> tuple[dict[str, FleetProfile], float]:
    wanted = fleet.wanted
    boards = [b for b in snapshot.trainers() if wanted is None or b in wanted]
    if not boards:
        raise ConfigError("no board to profile: none is online and able to train on this broker"
                          + (f" among --boards {','.join(wanted)}" if wanted else "") + "; start edge-agent on the boards")
    note(f"profiling {', '.join(boards)}: {reason}")
    request = ProfileRequest(model=spec.model, variants=variants, dataset=spec.dataset, dataset_options=spec.dataset_options,
                             datamodule=spec.datamodule, datamodule_options=spec.datamodule_options,
                             precision=spec.precision, accumulate_grad_batches=spec.accumulate_grad_batches,
                             wire_dtype=spec.wire_dtype, threads=spec.threads, seed=spec.seed,
                             exchange_host=spec.exchange_host)
    started = time.monotonic()
    profiles = profile(request, broker=fleet.broker, fleet_key=fleet.fleet_key, path=path, boards=boards, on_note=note)
    took = time.monotonic() - started
    note(f"profiled in {took:.0f} s; wrote {path}")
    return profiles, took


def recheck_before_training(selected: dict[str, FleetProfile], check: FleetCheck, chosen: Estimate,
                            request: PlanRequest, broker: BrokerSettings, wanted: list[str] | None, deadline: str,
                            say: Callable[[str], None]) -> tuple[Estimate, FleetCheck]:
    """Just before training: a chosen board that has gone is left out and the plan recomputed.

    Args:
        selected: The variants' profiles planned with.
        check: The fleet check the plan was made on.
        chosen: The configuration about to be trained.
        request: The plan request, to recompute with.
        broker: Where to look at the fleet.
        wanted: The boards the job may use, or None.
        deadline: :func:`~edgefleet.coordinator.planning.plan_job.deadline_text`, for a refusal's message.
        say: Prints one line.

    Returns:
        The configuration to train and the fleet check it was made on (unchanged when every
        chosen board is still there).
    """
    now = check_fleet(selected, fleet_snapshot(broker, settle=check.boards, settle_s=READY_WAIT_S).rows, wanted=wanted)
    gone = [b for b in chosen.candidate.boards if b not in now.boards]
    if not gone:
        return chosen, check
    for board in gone:
        say(f"board {board} is left out and the plan recomputed: {now.left_out.get(board, 'it left the fleet')}")
    result = request.run(restrict_to(selected, now), deadline_text=deadline)
    fewer = fewer_boards_line(result)
    if fewer:
        say(fewer)
    chosen = result.chosen
    say(summary_of(chosen, "chosen now"))
    return chosen, now


def job_for(spec: JobSpec, chosen: Estimate, dataset_len: int) -> JobSpec:
    """The resolved job that trains ``chosen``: its boards, batch sizes, variant and training mode,
    for the spec's epochs or steps (layer placement with the tail on a board: the two-stage pipeline
    ``HEAD+...,CUT@BOARD`` with ``--stage-sync checkpoint``, as the plan's cost assumes). The chosen
    batch sizes are per batch (micro-batches with accumulation); the spec keeps its data,
    ``accumulate_grad_batches`` and ``precision``."""
    c = chosen.candidate
    planned = replace(spec, model_options=dict(spec.model_options) | dict(c.variant), **candidate_fields(c))
    return resolve_job(planned, dataset_len=dataset_len)


def auto_train(spec: JobSpec, request: PlanRequest, *, broker: BrokerSettings, fleet_key: bytes,
               profile_path: Path = DEFAULT_PROFILE, variants: Sequence[Mapping[str, Any]] | None = None,
               reprofile: bool = False, verify: int = 0, verify_steps: int = DEFAULT_VERIFY_STEPS,
               run_dir: Path | None = None, observer: AutoTrainObserver | None = None,
               placement: str = "auto") -> AutoTrainOutcome:
    """Profile (or reuse the profile), plan, train the chosen configuration and measure it.

    Args:
        spec: The job. Its ``boards`` limit the boards the planner may use (() = any online);
            its ``batch_sizes`` are not used (the plan splits ``request.global_batches`` among the boards).
        request: The planner's objective and constraints.
        broker: The fleet's broker.
        fleet_key: The key that signs the boards' commands.
        profile_path: The profile file, reused when it fits and rewritten when not.
        variants: The model-option dicts to plan over (default: the spec's model options alone).
        reprofile: Profile again even when the saved profile fits.
        verify: Pre-train the best ``verify`` candidates and choose on measurement (0: no pre-training).
        verify_steps: Timed steps per pre-trained candidate.
        run_dir: Where the run is written (default ``runs/<run-id>``); ``plan.json`` holds the
            prediction and the measurement.
        observer: Receives the notes, the plan, the pre-training and the run's steps.
        placement: ``auto``: weigh layer placement at every cut against data-parallel; a cut: that one;
            ``none``: data-parallel only (``planning.plan_job.placement_modes``).

    Raises:
        ConfigError: a job the planner cannot plan for, or no board to profile.
        PlanError: no configuration meets the request.
        EdgeTrainError: profiling, pre-training or training failed.
        KeyboardInterrupt: Ctrl-C before the run's first step.
    """
    from edgefleet.coordinator.run.checkpoints import atomic_write_json  # torch: only when the run starts

    check_auto_job(spec, request)
    if verify < 0 or verify_steps < 1:
        raise ConfigError("--verify K needs K >= 1 (0 = no pre-training) and --verify-steps N >= 1")
    observer = observer or AutoTrainObserver()
    request, placement = _modes_for(spec, request, placement, observer.note)
    fleet = _Fleet(broker=broker, fleet_key=fleet_key, wanted=list(spec.boards) or None)
    wanted_variants = [dict(v) for v in variants] if variants else [dict(spec.model_options)]

    snapshot = fleet_snapshot(broker, preferred=tuple(spec.boards))
    if fleet.wanted:  # a board named that never reported or is offline: refused before anything is profiled or built
        snapshot.check_named(fleet.wanted)
    selected, profile_s = _profiles(spec, wanted_variants, fleet, snapshot, profile_path, reprofile, observer.note)
    if profile_s:  # profiling took a while: look again (a board may have gone, or still be ending its job)
        snapshot = fleet_snapshot(broker, settle=sorted({b for fp in selected.values() for b in fp.boards}), settle_s=READY_WAIT_S)
    check = check_fleet(selected, snapshot.rows, wanted=fleet.wanted)
    for line in check.notes:
        observer.note(line)
    notes: list[str] = []
    keyed = CoordinatorKeys.from_bytes(fleet.fleet_key).board_keys or {}  # a tail on a board needs every board's key
    placements = placement_modes(placement, selected, notes, keyed=set(keyed))
    for line in notes:
        observer.note(line)
    result = request.run(restrict_to(selected, check), placements=placements)
    observer.planned(result, request)
    chosen, verify_s = result.chosen, 0.0
    if verify:
        verified = _verify(spec, result, selected, check, fleet, count=verify, steps=verify_steps,
                           count_idle=request.count_idle, observer=observer)
        chosen, verify_s = verified.chosen.estimate, verified.elapsed_s
    observer.note(summary_of(chosen, "chosen"))
    if profile_s or verify_s:  # time has passed since the fleet was last looked at
        chosen, check = recheck_before_training(selected, check, chosen, request, broker, fleet.wanted,
                                                request.deadline_text, observer.note)

    dataset_len = selected[chosen.variant_label].dataset_len
    job = job_for(spec, chosen, dataset_len)
    with monitor_fleet(broker) as view, PowerMeter(view, list(check.boards)) as meter:
        wait_for_snapshot(view, timeout_s=1.0)
        training = train(job, broker=broker, fleet_key=fleet_key, run_dir=run_dir, observer=observer, power_view=view)
        ended = time.monotonic()
        measured, note = _measure_run(training, ended, meter, chosen, dataset_len, request.count_idle,
                                      warmup_steps=mode_warmup_steps(job), accumulate=job.accumulate_grad_batches)
    atomic_write_json(training.run_dir / "plan.json", {
        "objective": request.objective, "predicted": estimate_json(chosen), "profile_s": profile_s, "verify_s": verify_s,
        "measured": None if measured is None else {k: getattr(measured, k) for k in (
            "step_time_s", "samples_per_s", "epoch_time_s", "power_w", "energy_per_epoch_j", "edp_j_s",
            "power_measured", "steps")}})
    return AutoTrainOutcome(chosen=chosen, training=training, measured=measured, measure_note=note,
                            profile_s=profile_s, verify_s=verify_s)


def _verify(spec: JobSpec, result: PlanResult, selected: dict[str, FleetProfile], check: FleetCheck, fleet: _Fleet, *,
            count: int, steps: int, count_idle: bool, observer: AutoTrainObserver) -> VerifyResult:
    verified = verify_candidates(list(result.ranked[:count]), spec, broker=fleet.broker, fleet_key=fleet.fleet_key,
                                 objective=result.objective, steps=steps,
                                 dataset_len=next(iter(selected.values())).dataset_len, fleet_boards=list(check.boards),
                                 count_idle=count_idle, on_note=observer.note)
    observer.verified(verified)
    return verified


def mode_warmup_steps(job: JobSpec) -> int:
    """Steps the run's training mode spends exact before its steady state: 0 in the exact mode,
    else ``sync_warmup`` (None: one epoch, ``steps_per_epoch`` of the resolved job)."""
    if getattr(job, "sync_every", 1) == 1:
        return 0
    warmup: int | None = getattr(job, "sync_warmup", None)
    return job.steps_per_epoch if warmup is None else int(warmup)


def _measure_run(training: TrainOutcome, ended: float, meter: PowerMeter, chosen: Estimate, dataset_len: int,
                 count_idle: bool, *, warmup_steps: int = 0, accumulate: int = 1) -> tuple[Measurement | None, str]:
    """The run's measured figures from metrics.jsonl and the power seen while it stepped; or None and why not.

    ``warmup_steps``: the training mode's exact steps (:func:`mode_warmup_steps`), left out with the
    usual warm-up: the prediction is the mode's steady state. An inexact mode's steps are timed in
    whole periods of its ``sync_every`` steps. ``accumulate``: the job's batches per optimizer step
    (a step trains that many global batches).
    """
    lines = (training.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line]
    elapsed = [float(r["elapsed_s"]) for r in records]
    skip = WARMUP_STEPS + warmup_steps
    if len(elapsed) <= skip + 1:
        why = f"{WARMUP_STEPS} warm-up steps" + (f" and the mode's {warmup_steps} exact steps" if warmup_steps else "")
        return None, f"the run had {len(elapsed)} steps: too few to measure after {why}"
    started = ended - float(training.result["elapsed_s"])  # the run's clock started at its first step
    readings = meter.average(started + elapsed[skip - 1], started + elapsed[-1])
    intervals = step_intervals(elapsed, warmup_steps=skip,
                               exclude=[i for i, r in enumerate(records) if "val_accuracy" in r])
    period = chosen.mode.sync_every
    try:
        measured = measure(intervals, readings, boards=chosen.candidate.boards,
                           global_batch=chosen.candidate.global_batch, dataset_len=dataset_len, count_idle=count_idle,
                           period=period, accumulate=accumulate)
    except EdgeTrainError as exc:
        return None, str(exc)
    how = f"{measured.steps} steps timed after {WARMUP_STEPS} warm-up steps"
    if warmup_steps:
        how += f" and the mode's {warmup_steps} exact warm-up steps, in periods of {period} ({chosen.mode.description})"
    return measured, how + " (validation steps left out)"


__all__ = ["AutoTrainObserver", "AutoTrainOutcome", "auto_train", "check_auto_job", "job_for", "mode_warmup_steps",
           "recheck_before_training"]
