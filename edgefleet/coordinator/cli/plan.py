"""``edge-coordinator plan``: its flags, the :class:`PlanRequest` they describe, and the plan's table, PNG or JSON.

The plan itself is :func:`edgefleet.coordinator.planning.plan_job.plan`; with ``--verify K`` the best K are
pre-trained for a few real steps and the choice is made on measured figures
(:func:`edgefleet.coordinator.planning.verify.verify_candidates`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.cli.shared import FLEET_KEY_HELP, add_board_keys_arg, coordinator_keys, load_config
from edgefleet.coordinator.cli.train_args import placement_choice
from edgefleet.coordinator.cli.variant_flags import add_variant_args, parse_int_list, variants_from_args
from edgefleet.coordinator.planning import write_pareto_png
from edgefleet.coordinator.planning.objectives import DEFAULT_OBJECTIVE, OBJECTIVES
from edgefleet.coordinator.planning.pipeline_job import pipeline_json, plan_pipeline_job
from edgefleet.coordinator.planning.pipeline_render import render_result
from edgefleet.coordinator.planning.pipeline_train import train_flags
from edgefleet.coordinator.planning.pipeline_verify import (
    DEFAULT_VERIFY_ROUNDS,
    PipelineVerifyResult,
    front_runners,
    pipeline_verify_json,
    verify_lines,
    verify_plans,
)
from edgefleet.coordinator.planning.plan_job import (
    DEFAULT_FEWER_BOARDS_PCT,
    DEFAULT_GLOBAL_BATCHES,
    DEFAULT_MAX_MEMORY_FRACTION,
    DEFAULT_VERIFY_STEPS,
    INEXACT_MARGIN_PCT,
    PlanRequest,
    deadline_text,
    job_to_verify,
    plan,
)
from edgefleet.coordinator.planning.plan_summary import estimate_json, plan_notes, summary_of
from edgefleet.coordinator.planning.profile_job import DEFAULT_PROFILE
from edgefleet.coordinator.planning.verify import verify_candidates, verify_json
from edgefleet.coordinator.run.job_spec import DEFAULT_PIPELINE_PORT
from edgefleet.protocol.errors import BrokerError, ConfigError
from edgefleet.workloads.quiet_lightning import quiet_lightning

if TYPE_CHECKING:  # numpy, rich and matplotlib load only when a plan is made, not with the parser
    from rich.console import Console

    from edgefleet.coordinator.planning import PlanResult
    from edgefleet.coordinator.planning.pipeline_job import PipelineOutcome
    from edgefleet.coordinator.planning.plan_job import PlanOutcome
    from edgefleet.coordinator.planning.verify import VerifyResult

log = logging.getLogger(__name__)

DEFAULT_TOP = 10
# What "inexact" means, for --help of `plan` and `train --auto`: one text, one place.
INEXACT_HELP = ("also consider training modes that change the mathematics, and choose one when it is at least "
                f"{INEXACT_MARGIN_PCT:g}%% better by estimate than the best exact configuration. Local SGD (train "
                "--sync-every H, H = 2, 4 or 8): the boards step on their own gradients and average their parameters "
                "every H steps, moving the full-size vector H times less often. Accuracy per epoch may differ from "
                "single-process training, and a run may need more epochs to the same accuracy (in a one-process study "
                "LeNet-5 on digits ended 0.6 points below exact at H = 2 or 4 and 1.1 below at H = 8, reaching 95%% "
                "one or two epochs later: docs/benchmarks.md)")

PLAN_EPILOG = """\
examples:
  edge-coordinator plan                                   minimise energy x time (EDP) over the online boards
  edge-coordinator plan --objective time --batch 32,64,128
  edge-coordinator plan --objective energy --max-power 15 --deadline 30 --epochs 5
  edge-coordinator plan --model mlp --layers 2,3,4 --top 20
  edge-coordinator plan --objective time --allow-inexact  also consider local SGD (it changes the mathematics)
  edge-coordinator plan --verify 2 --fleet-key fleet.key  pre-train the best 2 for 20 steps, choose on measurement
  edge-coordinator plan --no-fleet-check --json           plan on the profile file alone, for scripts
  edge-coordinator plan --pipeline --objective time       pipeline stages over board groups, and the train flags
  edge-coordinator plan --pipeline --verify 3 --fleet-key fleet.key --board-keys keys/
                                                          pre-train the 3 best pipeline plans, choose on measurement
  edge-coordinator plan --boards x86-1,pi5-1,pi4-3        plan over these boards only

The profile comes from `edge-coordinator profile` (default ./edgefleet-profile.json). A profiled
board that is offline now is left out, with a line saying so; a profile measured for another
model, dataset or agent version is refused (profile again). --deadline is in minutes for a run of
--epochs epochs. The time/energy Pareto front is drawn to <profile>-pareto.png unless --png says
where. Exit status: 0 with a plan; 1 when no configuration meets the request (the message names
the constraint and by how much) or the profile does not fit the job.
"""


def add_objective_args(p: argparse.ArgumentParser) -> None:
    """The flags ``plan`` and ``train --auto`` share: objective, constraints, profile file, variants."""
    p.add_argument("--objective", choices=OBJECTIVES, default=DEFAULT_OBJECTIVE,
                   help=f"minimise time per epoch, energy per epoch, or their product EDP (default {DEFAULT_OBJECTIVE})")
    p.add_argument("--max-power", type=float, metavar="W",
                   help="power cap: the taking-part boards together draw at most W watts")
    p.add_argument("--deadline", type=float, metavar="MIN", help="the whole run (--epochs epochs) within MIN minutes")
    p.add_argument("--count-idle", action="store_true",
                   help="charge the idle power of the boards left out (they stay on) to the energy")
    p.add_argument("--max-memory-fraction", type=float, default=DEFAULT_MAX_MEMORY_FRACTION, metavar="F",
                   help=f"share of a board's memory a predicted peak may use (default {DEFAULT_MAX_MEMORY_FRACTION:g})")
    p.add_argument("--fewer-boards-within", type=float, default=DEFAULT_FEWER_BOARDS_PCT, metavar="PCT",
                   help="of the configurations within PCT%% of the best estimate, choose the one with the fewest "
                        f"boards (default {DEFAULT_FEWER_BOARDS_PCT:g}; 0 = always the best estimate): an estimate "
                        "is not exact to a few percent, and every board added is one more link to wait for")
    p.add_argument("--allow-inexact", action="store_true", help=INEXACT_HELP)
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help=f"profile file from `edge-coordinator profile` (default ./{DEFAULT_PROFILE})")
    add_variant_args(p)


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` command to the top-level subparsers ``sub``."""
    global_batches = ",".join(map(str, DEFAULT_GLOBAL_BATCHES))
    p = sub.add_parser("plan", help="choose boards, batch sizes and model variant from a profile",
                       description="Estimate every configuration (which boards take part, each one's batch size, "
                                   "the model variant) from the profile, choose the best for the objective under "
                                   "the constraints, and draw the time/energy Pareto front.",
                       epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_objective_args(p)
    p.add_argument("--outer-optimizer", choices=("average", "diloco"), default="average",
                   help="with --allow-inexact, diloco weighs DiLoCo too (train --sync-every H --outer-optimizer diloco, "
                        "H = 8 or 16: local SGD's bytes, an outer Nesterov SGD on each average); opt-in, as its accuracy "
                        "depends on the model (docs/training.md)")
    p.add_argument("--epochs", type=float, default=1.0, metavar="E", help="epochs the --deadline covers (default 1)")
    p.add_argument("--batch", default=global_batches, metavar="B,B,…",
                   help=f"global batch sizes to consider, split among the boards (default {global_batches})")
    p.add_argument("--model", help="the job's model (default: the profile's); another model than profiled is refused")
    p.add_argument("--model-options", default="", metavar="K=V,…", help="the job's model options (default: the profile's)")
    p.add_argument("--dataset", help="the job's dataset (default: the profile's)")
    p.add_argument("--dataset-options", default="", metavar="K=V,…", help="the job's dataset options")
    p.add_argument("--placement", default="auto", metavar="auto|none|CUT",
                   help="layer placement: weigh the model's admissible cuts (auto, the default: each profiled on this "
                        "machine, the tail host), one cut, or none (data-parallel only); the chosen line says which "
                        "and the bytes each board moves")
    p.add_argument("--pipeline", action="store_true",
                   help="plan pipeline stages instead: contiguous layer ranges on groups of boards, micro-batches, "
                        "each board's memory against its limit, the bytes each link carries and the bubble, from the "
                        "boards' per-layer profiles; for a model no single board can train. GPipe, as train runs it; "
                        "the last line gives train's --pipeline flags for the plan (docs/pipeline.md)")
    p.add_argument("--boards", default="", metavar="B,B,…",
                   help="plan over these profiled boards only (default: every profiled board that can take part now); "
                        "a named board that cannot is refused, saying why")
    p.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="N", help=f"rows in the table (default {DEFAULT_TOP})")
    p.add_argument("--png", type=Path, metavar="FILE", help="where to draw the Pareto front (default <profile>-pareto.png)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON for scripts (notes go to stderr)")
    p.add_argument("--no-fleet-check", action="store_true",
                   help="plan on the profile alone: do not ask the broker which boards are online and their versions")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="pre-train the best K candidates for a few real steps and choose on the measured figures (with "
                        "--pipeline: K plans train can run, the best of each layout of boards first; a pipeline's stage "
                        "links need every board's key, --board-keys)")
    p.add_argument("--verify-steps", type=int, default=DEFAULT_VERIFY_STEPS, metavar="N",
                   help=f"timed steps per pre-trained candidate, after 3 warm-up steps (default {DEFAULT_VERIFY_STEPS})")
    p.add_argument("--verify-rounds", type=int, default=DEFAULT_VERIFY_ROUNDS, metavar="R",
                   help=f"with --pipeline --verify: pre-train each plan R times, in turn forth and back (A B C C B A), "
                        f"and compare their means; short runs of one plan differ by 10-20%% (default {DEFAULT_VERIFY_ROUNDS})")
    p.add_argument("--fleet-key", metavar="FILE", help=f"with --verify: {FLEET_KEY_HELP}")
    add_board_keys_arg(p, what="with --verify: ")
    p.add_argument("--allow-token-boards", action="store_true",
                   help="with --verify: let boards without a key of their own join the pre-training with a token in their "
                        "command (as train --allow-token-boards)")
    p.add_argument("--pipeline-port", type=int, default=DEFAULT_PIPELINE_PORT, metavar="PORT",
                   help=f"with --pipeline --verify: the pre-trained pipeline's i-th board listens on PORT + i (as train's; "
                        f"default {DEFAULT_PIPELINE_PORT})")


def request_from_args(args: argparse.Namespace, global_batches: list[int], epochs: float) -> PlanRequest:
    """The PlanRequest of the parsed flags; ``epochs`` is what ``--deadline`` covers."""
    if args.deadline is not None and not args.deadline > 0:
        raise ConfigError(f"--deadline {args.deadline:g}: give the minutes the whole run may take (a positive number)")
    if not epochs > 0:
        raise ConfigError(f"--epochs {epochs:g} must be positive")
    deadline_s = None if args.deadline is None else args.deadline * 60.0 / epochs
    if not 0 <= args.fewer_boards_within < 100:
        raise ConfigError(f"--fewer-boards-within {args.fewer_boards_within:g}: give a percentage from 0 (always the "
                          f"best estimate) to under 100; the default is {DEFAULT_FEWER_BOARDS_PCT:g}")
    outer = getattr(args, "outer_optimizer", "average")
    if outer == "diloco" and not args.allow_inexact:
        raise ConfigError("--outer-optimizer diloco asks the plan to weigh DiLoCo, a mode that changes the mathematics: "
                          "add --allow-inexact")
    return PlanRequest(objective=args.objective, max_power_w=args.max_power, deadline_s=deadline_s,
                       global_batches=tuple(global_batches), count_idle=args.count_idle,
                       max_memory_fraction=args.max_memory_fraction, top=max(1, getattr(args, "top", DEFAULT_TOP)),
                       fewer_boards_within=args.fewer_boards_within / 100,
                       deadline_text=deadline_text(args.deadline, epochs), allow_inexact=args.allow_inexact,
                       outer_optimizer=outer)


def requested_variants(args: argparse.Namespace, base_options: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The variants the flags ask for; None when neither --model-options nor a variant flag is given."""
    if base_options is None and not any(getattr(args, f, None) for f in ("layers", "width", "depth")):
        return None
    return variants_from_args(args, dict(base_options or {}))


def _parse_options(text: str) -> dict[str, Any] | None:
    if not text:
        return None
    # workloads.registry imports torch: only when options are given
    from edgefleet.workloads.registry import parse_options

    return parse_options(text)


def cmd_plan(args: argparse.Namespace) -> int:
    """``edge-coordinator plan``; returns the exit status."""
    if args.verify < 0 or args.verify_steps < 1 or args.verify_rounds < 1:
        raise ConfigError("--verify K needs K >= 1 (0 = no pre-training), --verify-steps N >= 1 and --verify-rounds R >= 1")
    if args.verify and args.no_fleet_check:
        raise ConfigError("--verify pre-trains on the boards, so it needs the broker: drop --no-fleet-check")
    request = request_from_args(args, parse_int_list(args.batch, "--batch"), args.epochs)
    cfg = None if args.no_fleet_check else load_config(args)
    if getattr(args, "pipeline", False):
        return _plan_pipeline(args, request, cfg)
    try:
        outcome = plan(request, profile_path=args.profile, model=args.model,
                       variants=requested_variants(args, _parse_options(args.model_options)), dataset=args.dataset,
                       dataset_options=_parse_options(args.dataset_options), broker=None if cfg is None else cfg.broker,
                       placement=placement_choice(args.placement), boards=_boards(args))
    except BrokerError as exc:
        raise BrokerError(f"{exc} (or plan on the profile alone with --no-fleet-check)") from None
    notes = list(outcome.notes)
    png = _draw(outcome.result, args.png or args.profile.with_name(f"{args.profile.stem}-pareto.png"), notes)
    if not args.json:
        _print_plan(outcome.result, request, notes, png)
    verified = None
    if args.verify:
        assert cfg is not None
        verified = _verify(args, outcome, coordinator_keys(
            args, cfg, missing="--verify sends training commands: give --fleet-key FILE or [security] fleet_key_file"),
            cfg.broker)
    if args.json:
        _print_json(outcome, notes, png, verified)
    return 0


def _boards(args: argparse.Namespace) -> tuple[str, ...]:
    """``--boards``, as board ids."""
    return tuple(b.strip() for b in args.boards.split(",") if b.strip())


def _plan_pipeline(args: argparse.Namespace, request: PlanRequest, cfg: Any) -> int:
    """``plan --pipeline``: the best pipeline plan, or the line saying what would fit (exit 1); with ``--verify K``,
    the K best pre-trained and the choice made on measurement."""
    broker = None if cfg is None else cfg.broker
    try:
        outcome = plan_pipeline_job(request, profile_path=args.profile, model=args.model,
                                    variants=requested_variants(args, _parse_options(args.model_options)),
                                    dataset=args.dataset, dataset_options=_parse_options(args.dataset_options),
                                    broker=broker, boards=_boards(args))
    except BrokerError as exc:
        raise BrokerError(f"{exc} (or plan on the profile alone with --no-fleet-check)") from None
    option = outcome.chosen
    console = None if args.json else _console()
    if console is None:
        for note in [*outcome.notes, *option.notes]:
            print(note, file=sys.stderr)
    else:
        for note in [*outcome.notes, *option.notes]:
            console.print(note, markup=False, soft_wrap=True)
        console.print(f"variant {option.variant_label}, global batch {option.global_batch}", markup=False)
        console.print(render_result(option.problem, option.result), markup=False, soft_wrap=True)
        if option.result.plan is not None:
            console.print(train_flags(option.problem, option.result.plan).line(), markup=False, soft_wrap=True)
    doc = pipeline_json(outcome, request.objective) if args.json else {}
    if args.verify and outcome.fits:
        verified = _verify_pipeline(args, outcome, request, cfg, console)
        if console is None:
            doc["verify"] = pipeline_verify_json(verified)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0 if outcome.fits else 1


def _verify_pipeline(args: argparse.Namespace, outcome: PipelineOutcome, request: PlanRequest, cfg: Any,
                     console: Console | None) -> PipelineVerifyResult:
    """Pre-train the ``--verify`` best pipeline plans; print the comparison unless --json."""
    keys = coordinator_keys(args, cfg, missing="--verify sends training commands: give --fleet-key FILE or "
                                               "[security] fleet_key_file")
    _quiet_lightning(args)
    job = replace(job_to_verify(outcome.meta, model=args.model, model_options=_parse_options(args.model_options),
                                dataset=args.dataset, dataset_options=_parse_options(args.dataset_options),
                                allow_token_boards=args.allow_token_boards), pipeline_port=args.pipeline_port)

    def note(text: str) -> None:
        if console is None:
            print(text, file=sys.stderr)
        else:
            console.print(text, markup=False, soft_wrap=True)

    verified = verify_plans(front_runners(outcome, request.objective, args.verify), job, broker=cfg.broker,
                            fleet_key=keys, objective=request.objective, steps=args.verify_steps,
                            rounds=args.verify_rounds, fleet_boards=list(outcome.check.boards),
                            count_idle=args.count_idle, on_note=note)
    for line in verify_lines(verified):
        note(line)
    return verified


def _draw(result: PlanResult, path: Path, notes: list[str]) -> Path | None:
    try:
        return write_pareto_png(path, list(result.ranked) + list(result.front), result.chosen,
                                title=f"Candidates by time and energy per epoch (objective: {result.objective})")
    except (RuntimeError, OSError) as exc:
        notes.append(f"no Pareto plot: {exc}")
        return None


def _verify(args: argparse.Namespace, outcome: PlanOutcome, fleet_key: bytes, broker: Any) -> VerifyResult:
    """Pre-train the best ``--verify`` candidates; print the comparison unless --json."""
    from edgefleet.coordinator.cli.verify_render import verify_report  # rich: only when candidates are verified

    _quiet_lightning(args)
    job = job_to_verify(outcome.meta, model=args.model, model_options=_parse_options(args.model_options),
                        dataset=args.dataset, dataset_options=_parse_options(args.dataset_options),
                        allow_token_boards=args.allow_token_boards)
    console = None if args.json else _console()
    verified = verify_candidates(list(outcome.result.ranked[:args.verify]), job, broker=broker, fleet_key=fleet_key,
                                 objective=outcome.result.objective, steps=args.verify_steps, count_idle=args.count_idle,
                                 fleet_boards=list(outcome.check.boards), dataset_len=outcome.dataset_len,
                                 on_note=(lambda text: print(text, file=sys.stderr)) if console is None
                                 else (lambda text: console.print(text, markup=False, soft_wrap=True)))
    if console is not None:
        verify_report(console, verified)
    return verified


def _quiet_lightning(args: argparse.Namespace) -> None:
    """Lightning's INFO lines off (the replica of every pre-training builds a Trainer), unless -v."""
    quiet_lightning(verbose=getattr(args, "verbose", False))


def _console() -> Console:
    from edgefleet.coordinator.cli.render import make_console  # rich: only to print, not with the parser

    return make_console()


def _print_plan(result: PlanResult, request: PlanRequest, notes: list[str], png: Path | None) -> None:
    from edgefleet.coordinator.cli.plan_render import plan_table  # rich: only to print the table

    console = _console()
    for note in notes:
        console.print(note, markup=False, soft_wrap=True)
    console.print(plan_table(result, request))
    for line in plan_notes(result):
        console.print(line, markup=False, soft_wrap=True)
    console.print(summary_of(result.chosen, "chosen"), markup=False, soft_wrap=True)
    if png is not None:
        console.print(f"Pareto front: {png}", markup=False, soft_wrap=True)


def _print_json(outcome: PlanOutcome, notes: list[str], png: Path | None, verified: VerifyResult | None) -> None:
    result, check = outcome.result, outcome.check
    for note in notes:
        print(note, file=sys.stderr)
    doc: dict[str, Any] = {
        "objective": result.objective, "method": result.method, "evaluated": result.evaluated,
        "feasible": result.feasible, "chosen": estimate_json(result.chosen),
        "passed_over": None if result.passed_over is None else estimate_json(result.passed_over),
        "fewer_boards_within": result.fewer_boards_within,
        "modes": [m.name for m in result.modes], "inexact_margin": result.inexact_margin,
        "declined_inexact": None if result.declined_inexact is None else estimate_json(result.declined_inexact),
        "best_exact": None if result.best_exact is None else estimate_json(result.best_exact),
        "ranked": [estimate_json(e) for e in result.ranked], "front": [estimate_json(e) for e in result.front],
        "ruled_out": [{"constraint": x.constraint, "board_id": x.board_id, "count": x.count, "example": x.example}
                      for x in result.ruled_out],
        "boards": list(check.boards), "left_out": dict(check.left_out), "notes": notes,
        "png": None if png is None else str(png),
    }
    if verified is not None:
        doc["verify"] = verify_json(verified)
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


__all__ = ["add_objective_args", "add_plan_parser", "cmd_plan", "request_from_args", "requested_variants"]
