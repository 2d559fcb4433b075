"""``edge-coordinator train --auto``: the planner's flags on ``train``, and the report of predicted against measured.

The work is :func:`edgefleet.coordinator.run.auto_train.auto_train`; this module builds its job spec
and plan request from the flags, and :mod:`.auto_progress` shows the plan, the pre-training and
the run as they come, and ends with the comparison table and the overheads.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from edgefleet.coordinator.cli.plan import add_objective_args, request_from_args
from edgefleet.coordinator.cli.shared import coordinator_keys, load_config
from edgefleet.coordinator.cli.train_args import job_from_args, placement_choice
from edgefleet.coordinator.cli.variant_flags import parse_int_list, variants_from_args
from edgefleet.coordinator.planning.plan_job import DEFAULT_FEWER_BOARDS_PCT, DEFAULT_GLOBAL_BATCHES, DEFAULT_VERIFY_STEPS
from edgefleet.coordinator.run.auto_train import auto_train, check_auto_job
from edgefleet.coordinator.run.job_spec import DEFAULT_BATCH, DEFAULT_EPOCHS
from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.quiet_lightning import quiet_lightning

if TYPE_CHECKING:
    from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics

AUTO_EPILOG = f"""
automatic configuration (--auto):
  edge-coordinator train --auto --model lenet5 --dataset digits --epochs 5
  edge-coordinator train --auto --objective time --max-power 20 --batch 32,64,128
  edge-coordinator train --auto --model mlp --layers 2,3,4 --objective edp --verify 2
  edge-coordinator train --auto --objective time --allow-inexact   may choose local SGD (changes the mathematics)
With --auto, --batch lists global batch sizes to consider (default {",".join(map(str, DEFAULT_GLOBAL_BATCHES))}), split among the boards by
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
        "--allow-inexact": bool(getattr(args, "allow_inexact", False)),
    }
    return [flag for flag, present in given.items() if present]


def _auto_placement(args: argparse.Namespace) -> str:
    """What ``--auto`` weighs: every cut unless ``--placement`` says none or names one."""
    return placement_choice(getattr(args, "placement", None) or "auto")


def add_auto_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--auto`` and the planner's flags to the ``train`` parser."""
    parser.add_argument("--auto", action="store_true",
                        help="choose boards, batch sizes and variant automatically: profile (or reuse the profile), "
                             "plan, train, and compare predicted with measured figures")
    add_objective_args(parser)
    parser.add_argument("--reprofile", action="store_true", help="with --auto: profile again even if the profile fits")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="with --auto: pre-train the best K candidates for a few steps and take the best measured")
    parser.add_argument("--verify-steps", type=int, default=DEFAULT_VERIFY_STEPS, metavar="N",
                        help=f"with --verify: timed steps per candidate (default {DEFAULT_VERIFY_STEPS})")
    parser.set_defaults(batch=_BatchNotGiven(parser.get_default("batch") or "32"),
                        objective=_ObjectiveNotGiven(parser.get_default("objective")))
    parser.epilog = (parser.epilog or "") + AUTO_EPILOG


def run_auto(args: argparse.Namespace, *, metrics: TrainingMetrics | None = None) -> int:
    """``train --auto``; returns the exit status (raises EdgeTrainError with a clear message)."""
    # rich: only when --auto runs, not when the parser is built
    from edgefleet.coordinator.cli.auto_progress import AutoProgress, print_report
    from edgefleet.coordinator.cli.render import make_console
    from edgefleet.coordinator.cli.train_progress import INTERRUPTED, display_options, print_json_outcome, print_outcome

    if args.resume is not None:
        raise ConfigError("--auto starts a new run; continue an interrupted one with plain `train --resume RUN_DIR`")
    if args.verify < 0 or args.verify_steps < 1:
        raise ConfigError("--verify K needs K >= 1 (0 = no pre-training) and --verify-steps N >= 1")
    batches = list(DEFAULT_GLOBAL_BATCHES) if isinstance(args.batch, _BatchNotGiven) else parse_int_list(args.batch, "--batch")
    spec = job_from_args(args, batch_sizes=(DEFAULT_BATCH,))  # not used: the plan splits each global batch among the boards
    request = request_from_args(args, batches, args.epochs if args.epochs is not None else DEFAULT_EPOCHS)
    check_auto_job(spec, request)
    cfg = load_config(args)
    fleet_key = coordinator_keys(args, cfg)
    options = display_options(args)
    quiet_lightning(verbose=options.verbose)
    console = make_console(stderr=options.json)
    display = AutoProgress(console, metrics=metrics, every_s=options.every_s)
    try:
        outcome = auto_train(spec, request, broker=cfg.broker, fleet_key=fleet_key, profile_path=args.profile,
                             variants=variants_from_args(args, dict(spec.model_options)), reprofile=args.reprofile,
                             verify=args.verify, verify_steps=args.verify_steps, run_dir=args.run_dir, observer=display,
                             placement=_auto_placement(args))
    except KeyboardInterrupt:
        display.stopped_before_training()
        return INTERRUPTED
    if options.json:  # the report of predicted against measured goes to stderr with the progress
        print_report(console, outcome)
        return print_json_outcome(outcome.training)
    code = print_outcome(console, outcome.training)
    print_report(console, outcome)
    return code


__all__ = ["add_auto_args", "planner_flags_given", "run_auto"]
