"""``edge-coordinator train --auto``: profile (or reuse a profile), plan, train the chosen configuration,
and compare what the plan predicted with what the run measured.

1. Profile: a saved profile is reused when it was measured for this model, dataset, wire dtype
   and the agent versions the boards run now; otherwise (or with ``--reprofile``) the online
   boards are profiled again and the file rewritten, with a line saying why.
2. Plan over the boards that are online (``--boards`` narrows them); ``--verify K`` pre-trains
   the best K and takes the best measured.
3. Just before training the fleet is looked at again: a planned board that went offline is left
   out and the plan recomputed, with a line saying so.
4. Train with the standard progress display, while :class:`PowerMeter` follows every board's
   power; then the predicted-vs-measured table (step time, samples/s, time, power, energy per
   epoch, EDP) and the overheads of profiling and pre-training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.plan_cli import (
    DEFAULT_FEWER_BOARDS_PCT,
    PlanRequest,
    add_objective_args,
    deadline_text,
    request_from_args,
)
from edgefleet.coordinator.variants import parse_int_list, variants_from_args
from edgefleet.protocol.errors import ConfigError, EdgeTrainError, PlanError

if TYPE_CHECKING:
    from edgefleet.coordinator.plan_fleet import FleetCheck
    from edgefleet.coordinator.planning import Estimate, FleetProfile
    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

AUTO_GLOBAL_BATCHES = (32, 64, 128)
READY_WAIT_S = 60.0   # a board that just finished profiling or pre-training is busy until its worker exits

AUTO_EPILOG = """
automatic configuration (--auto):
  edge-coordinator train --auto --model lenet5 --dataset digits --epochs 5
  edge-coordinator train --auto --objective time --max-power 20 --batch 32,64,128
  edge-coordinator train --auto --model mlp --layers 2,3,4 --objective edp --verify 2
With --auto, --batch lists global batch sizes to consider (default 32,64,128), split among the boards by
the planner; --boards limits the boards it may use. The run ends with predicted against measured figures.
"""


class _BatchNotGiven(str):
    """The train parser's ``--batch`` default, recognisable as 'not given' under ``--auto``."""


class _ObjectiveNotGiven(str):
    """The train parser's ``--objective`` default, recognisable as 'not given' without ``--auto``."""


def planner_flags_given(args: argparse.Namespace) -> list[str]:
    """The planner's flags given on a ``train`` command line (they mean something only with ``--auto``)."""
    given = {
        "--objective": not isinstance(args.objective, _ObjectiveNotGiven),
        "--max-power": args.max_power is not None,
        "--deadline": args.deadline is not None,
        "--count-idle": args.count_idle,
        "--fewer-boards-within": args.fewer_boards_within != DEFAULT_FEWER_BOARDS_PCT,
        "--reprofile": args.reprofile,
        "--verify": bool(args.verify),
    }
    return [flag for flag, present in given.items() if present]


def add_auto_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--auto`` and the planner's flags to the ``train`` parser."""
    parser.add_argument("--auto", action="store_true",
                        help="choose boards, batch sizes and variant automatically: profile (or reuse the profile), "
                             "plan, train, and compare predicted with measured figures")
    add_objective_args(parser)
    parser.add_argument("--reprofile", action="store_true", help="with --auto: profile again even if the profile fits")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="with --auto: pre-train the best K candidates for a few steps and take the best measured")
    parser.add_argument("--verify-steps", type=int, default=20, metavar="N",
                        help="with --verify: timed steps per candidate (default 20)")
    parser.set_defaults(batch=_BatchNotGiven(parser.get_default("batch") or "32"),
                        objective=_ObjectiveNotGiven(parser.get_default("objective")))
    parser.epilog = (parser.epilog or "") + AUTO_EPILOG


def _check_args(args: argparse.Namespace) -> None:
    if args.resume is not None:
        raise ConfigError("--auto starts a new run; continue an interrupted one with plain `train --resume RUN_DIR`")
    if args.deadline is not None and args.steps is not None:
        raise ConfigError("--deadline is per run of --epochs epochs; give --epochs instead of --steps")
    if args.verify < 0 or args.verify_steps < 1:
        raise ConfigError("--verify K needs K >= 1 (0 = no pre-training) and --verify-steps N >= 1")
    if args.log_every_n_steps < 1:
        raise ConfigError(f"--log-every-n-steps {args.log_every_n_steps}: use a whole number of steps >= 1")
    # These change what a step computes, which the profile does not measure: its step times would be wrong.
    unplanned = [flag for flag, given in (("--datamodule", args.datamodule),
                                          ("--accumulate-grad-batches", args.accumulate_grad_batches != 1),
                                          ("--precision", args.precision != "32-true")) if given]
    if unplanned:
        raise ConfigError(f"{', '.join(unplanned)} not with --auto yet: the profile times steps of a dataset's "
                          "batches in fp32; run `plan`, then `train` with the plan's --boards and --batch and these flags")


def _snapshot(broker: Any, boards: list[str] | None = None) -> list[Any]:
    """The fleet now; first waits (at most READY_WAIT_S) while any of ``boards`` is busy ending a job."""
    from edgefleet.coordinator.monitor import monitor_fleet, wait_for_snapshot

    with monitor_fleet(broker) as view:
        wait_for_snapshot(view, timeout_s=1.0)
        deadline = time.monotonic() + READY_WAIT_S
        while boards and time.monotonic() < deadline and any(
                r.state == "busy" for r in view.rows() if r.board_id in boards):
            time.sleep(0.1)
        return view.rows()


def _profile(args: argparse.Namespace, cfg: Any, fleet_key: bytes, rows: list[Any], variants: list[dict[str, Any]],
             dataset_options: dict[str, Any], wanted: list[str] | None, say: Any) -> tuple[dict[str, Any], float]:
    """The profiles to plan with: the saved ones if they fit this job and fleet, else fresh ones."""
    from edgefleet.coordinator.plan_fleet import check_fleet, load_profile_file, select_variants

    reason = "asked to (--reprofile)" if args.reprofile else ""
    if not reason:
        try:
            profiles, meta = load_profile_file(args.profile)
            selected = select_variants(profiles, meta=meta, model=args.model, variants=variants, dataset=args.dataset,
                                       dataset_options=dataset_options)
            if meta is not None and getattr(meta, "wire_dtype", args.wire_dtype) != args.wire_dtype:
                raise PlanError(f"it was measured with --wire-dtype {meta.wire_dtype}, this run uses {args.wire_dtype}")
            check_fleet(selected, rows, wanted=wanted)
            say(f"reusing the profile {args.profile} (it fits this model, dataset and the agents' versions)")
            return selected, 0.0
        except PlanError as exc:
            reason = str(exc)
    return _profile_now(args, cfg, fleet_key, rows, variants, dataset_options, wanted, reason, say)


def _profile_now(args: argparse.Namespace, cfg: Any, fleet_key: bytes, rows: list[Any],
                 variants: list[dict[str, Any]], dataset_options: dict[str, Any], wanted: list[str] | None,
                 reason: str, say: Any) -> tuple[dict[str, Any], float]:
    from edgefleet.coordinator.planning import save_profiles
    from edgefleet.coordinator.planning.profiles import ProfileMeta
    from edgefleet.coordinator.profiling import ProfileRequest, profile_fleet

    boards = [r.board_id for r in rows if r.state == "online" and (r.caps is None or r.caps.training_available)
              and (wanted is None or r.board_id in wanted)]
    if not boards:
        raise ConfigError("no board to profile: none is online and able to train on this broker"
                          + (f" among --boards {','.join(wanted)}" if wanted else "") + "; start edge-agent on the boards")
    say(f"profiling {', '.join(boards)}: {reason}")
    request = ProfileRequest(model=args.model, variants=variants, dataset=args.dataset, dataset_options=dataset_options,
                             wire_dtype=args.wire_dtype, threads=args.threads, seed=args.seed,
                             exchange_host=args.exchange_host)
    started = time.monotonic()
    profiles = asyncio.run(profile_fleet(cfg.broker, fleet_key, boards, request, on_note=say))
    took = time.monotonic() - started
    meta = ProfileMeta(model=args.model, dataset=args.dataset, dataset_options=dataset_options,
                       wire_dtype=args.wire_dtype, batch_sizes=list(request.batch_sizes),
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    save_profiles(args.profile, profiles, meta=meta)
    say(f"profiled in {took:.0f} s; wrote {args.profile}")
    return profiles, took


def run_auto(args: argparse.Namespace) -> int:
    """``train --auto``; returns the exit code (raises EdgeTrainError with a clear message)."""
    from edgefleet.coordinator.config import load_coordinator_config
    from edgefleet.coordinator.plan_fleet import check_fleet, restrict_to
    from edgefleet.coordinator.plan_render import plan_notes, plan_table, summary_of
    from edgefleet.coordinator.render import make_console
    from edgefleet.protocol.address import parse_host_port
    from edgefleet.transport.fleet_key import load_fleet_key
    from edgefleet.workloads.registry import parse_options

    _check_args(args)
    cfg = load_coordinator_config(args.config, broker=parse_host_port(args.broker, what="--broker") if args.broker else None,
                                  fleet_key_file=args.fleet_key)
    if not cfg.security.fleet_key_file:
        raise ConfigError("no fleet key: give --fleet-key FILE or [security] fleet_key_file (the key the boards verify commands with)")
    fleet_key = load_fleet_key(Path(cfg.security.fleet_key_file))
    console = make_console()

    def say(text: str) -> None:
        console.print(text, markup=False, soft_wrap=True)

    base_options, dataset_options = parse_options(args.model_options), parse_options(args.dataset_options)
    variants = variants_from_args(args, base_options)
    wanted = [b for b in (args.boards or "").split(",") if b] or None
    batches = list(AUTO_GLOBAL_BATCHES) if isinstance(args.batch, _BatchNotGiven) else parse_int_list(args.batch, "--batch")
    epochs = args.epochs if args.epochs is not None else 5.0
    request = request_from_args(args, batches, epochs)

    rows = _snapshot(cfg.broker)
    selected, profile_s = _profile(args, cfg, fleet_key, rows, variants, dataset_options, wanted, say)
    if profile_s:  # profiling took a while: look again (a board may have gone, or still be ending its job)
        rows = _snapshot(cfg.broker, sorted({b for fp in selected.values() for b in fp.boards}))
    check = check_fleet(selected, rows, wanted=wanted)
    for note in check.notes:
        say(note)
    result = request.run(restrict_to(selected, check), deadline_text=deadline_text(args, epochs))
    console.print(plan_table(result, request))
    for line in plan_notes(result):
        say(line)
    chosen, verify_s = result.chosen, 0.0
    if args.verify:
        chosen, verify_s = _verify(args, result, selected, cfg, fleet_key, base_options, dataset_options, check, console)
    say(summary_of(chosen, "chosen"))

    if profile_s or verify_s:  # time has passed since the fleet was last looked at
        chosen, check = recheck_before_training(selected, check, chosen, request, cfg.broker, wanted,
                                                deadline_text(args, epochs), say)
    return _train_and_compare(args, cfg, fleet_key, chosen, selected, check, base_options, dataset_options,
                              profile_s, verify_s, console)


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
        wanted: ``--boards``, or None.
        deadline: :func:`deadline_text`, for a refusal's message.
        say: Prints one line.

    Returns:
        The configuration to train and the fleet check it was made on (unchanged when every
        chosen board is still there).
    """
    from edgefleet.coordinator.plan_fleet import check_fleet, restrict_to
    from edgefleet.coordinator.plan_render import fewer_boards_line, summary_of

    now = check_fleet(selected, _snapshot(broker, list(check.boards)), wanted=wanted)
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


def _verify(args: argparse.Namespace, result: Any, selected: dict[str, Any], cfg: Any, fleet_key: bytes,
            base_options: dict[str, Any], dataset_options: dict[str, Any], check: Any, console: Any) -> tuple[Any, float]:
    from edgefleet.coordinator.verify import JobSpec, verify_candidates, verify_report

    job = JobSpec(model=args.model, dataset=args.dataset, base_options=base_options, dataset_options=dataset_options,
                  seed=args.seed, lr=args.lr, wire_dtype=args.wire_dtype, threads=args.threads, data_mode=args.data_mode)
    verified = verify_candidates(list(result.ranked[:args.verify]), job, broker=cfg.broker, fleet_key=fleet_key,
                                 objective=result.objective, steps=args.verify_steps,
                                 dataset_len=next(iter(selected.values())).dataset_len, fleet_boards=list(check.boards),
                                 count_idle=args.count_idle,
                                 on_note=lambda text: console.print(text, markup=False, soft_wrap=True))
    verify_report(console, verified)
    return verified.chosen.estimate, verified.elapsed_s


def _train_and_compare(args: argparse.Namespace, cfg: Any, fleet_key: bytes, chosen: Any, selected: dict[str, Any],
                       check: Any, base_options: dict[str, Any], dataset_options: dict[str, Any], profile_s: float,
                       verify_s: float, console: Any) -> int:
    from edgefleet.coordinator.checkpoints import atomic_write_json
    from edgefleet.coordinator.monitor import monitor_fleet, wait_for_snapshot
    from edgefleet.coordinator.plan_render import estimate_json
    from edgefleet.coordinator.power_meter import PowerMeter
    from edgefleet.coordinator.train_cli import run_training_ui

    spec = _spec(args, chosen, selected[chosen.variant_label].dataset_len, base_options, dataset_options)
    run_dir = args.run_dir or Path("runs") / spec.run_id
    with monitor_fleet(cfg.broker) as view, PowerMeter(view, list(check.boards)) as meter:
        wait_for_snapshot(view, timeout_s=1.0)
        code = run_training_ui(spec, run_dir, broker=cfg.broker, fleet_key=fleet_key, resume=False)
        ended = time.monotonic()
        if not (run_dir / "result.json").exists():
            return code
        measured, note = _measure_run(run_dir, ended, meter, chosen, selected[chosen.variant_label].dataset_len,
                                      args.count_idle)
    _report(console, chosen, measured, note, profile_s, verify_s, run_dir)
    atomic_write_json(run_dir / "plan.json", {
        "objective": args.objective, "predicted": estimate_json(chosen), "profile_s": profile_s, "verify_s": verify_s,
        "measured": None if measured is None else {k: getattr(measured, k) for k in (
            "step_time_s", "samples_per_s", "epoch_time_s", "power_w", "energy_per_epoch_j", "edp_j_s",
            "power_measured", "steps")}})
    return code


def _spec(args: argparse.Namespace, chosen: Any, dataset_len: int, base_options: dict[str, Any],
          dataset_options: dict[str, Any]) -> Any:
    from edgefleet.coordinator.training import TrainSpec
    from edgefleet.workloads.sharding import GlobalBatchPlan

    c = chosen.candidate
    if args.data_mode == "global":
        steps_per_epoch = GlobalBatchPlan(dataset_len, list(c.batch_sizes), args.seed).steps_per_epoch
    else:
        steps_per_epoch = max(1, dataset_len // max(c.batch_sizes))
    total = args.steps if args.steps is not None else max(1, round((args.epochs or 5.0) * steps_per_epoch))
    run_id = (f"{args.model.split(':')[-1].lower()}-{args.dataset.split(':')[-1].lower()}-"
              f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
    return TrainSpec(run_id=run_id, boards=list(c.boards), batch_sizes=list(c.batch_sizes), model=args.model,
                     model_options=dict(base_options) | dict(c.variant), dataset=args.dataset,
                     dataset_options=dataset_options, total_steps=total, steps_per_epoch=steps_per_epoch,
                     batches_per_epoch=steps_per_epoch, seed=args.seed,
                     lr=args.lr, wire_dtype=args.wire_dtype, data_mode=args.data_mode, threads=args.threads,
                     checkpoint_every=args.checkpoint_every, step_timeout_s=args.step_timeout,
                     exchange_host=args.exchange_host, exchange_port=args.exchange_port,
                     gradient_clip_val=args.gradient_clip_val, gradient_clip_algorithm=args.gradient_clip_algorithm,
                     deterministic=args.deterministic, logger=args.logger, sync_buffers=args.sync_buffers,
                     log_every_n_steps=args.log_every_n_steps)


def _measure_run(run_dir: Path, ended: float, meter: Any, chosen: Any, dataset_len: int,
                 count_idle: bool) -> tuple[Any, str]:
    """The run's measured figures from metrics.jsonl and the power seen while it stepped."""
    from edgefleet.coordinator.verify import WARMUP_STEPS, measure, step_intervals

    result = json.loads((run_dir / "result.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    elapsed = [float(r["elapsed_s"]) for r in records]
    if len(elapsed) <= WARMUP_STEPS + 1:
        return None, f"the run had {len(elapsed)} steps: too few to measure after {WARMUP_STEPS} warm-up steps"
    started = ended - float(result["elapsed_s"])  # the run's clock started at its first step
    readings = meter.average(started + elapsed[WARMUP_STEPS - 1], started + elapsed[-1])
    intervals = step_intervals(elapsed, warmup_steps=WARMUP_STEPS,
                               exclude=[i for i, r in enumerate(records) if "val_accuracy" in r])
    try:
        measured = measure(intervals, readings, boards=chosen.candidate.boards,
                           global_batch=chosen.candidate.global_batch, dataset_len=dataset_len, count_idle=count_idle)
    except EdgeTrainError as exc:
        return None, str(exc)
    return measured, f"{measured.steps} steps timed after {WARMUP_STEPS} warm-up steps (validation steps left out)"


def _report(console: Any, chosen: Any, measured: Any, note: str, profile_s: float, verify_s: float,
            run_dir: Path) -> None:
    from edgefleet.coordinator.plan_render import batches_text
    from edgefleet.coordinator.planning import format_duration
    from edgefleet.coordinator.verify import comparison_table, disagreement_line

    result = json.loads((run_dir / "result.json").read_text())
    console.print(comparison_table([(batches_text(chosen), chosen, measured)],
                                   title="the plan against the run: predicted vs measured"))
    console.print(note, markup=False, soft_wrap=True)
    if measured is not None:
        console.print(disagreement_line("this run", chosen, measured), markup=False, soft_wrap=True)
    train_s = float(result["elapsed_s"])
    overhead = profile_s + verify_s
    console.print(f"overhead: profiling {format_duration(profile_s)}, pre-training {format_duration(verify_s)}; "
                  f"training {format_duration(train_s)}"
                  + (f" (overhead = {overhead / train_s:.0%} of the training time)" if train_s > 0 else ""),
                  markup=False, soft_wrap=True)


__all__ = ["AUTO_GLOBAL_BATCHES", "add_auto_args", "recheck_before_training", "run_auto"]
