"""``edge-coordinator plan``: choose the boards, per-board batch sizes and model variant for a job.

The profile file (``edge-coordinator profile``) is checked against the job (model, dataset) and
against the fleet as it is now (which profiled boards are online, and which agent version each
runs); then :func:`coordinator.planning.plan` estimates every candidate and the table shows the
best ones. With ``--verify K`` the best K are pre-trained for a few real steps and the choice is
made on measured figures (:mod:`coordinator.verify`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.variants import add_variant_args, parse_int_list, variants_from_args
from edgefleet.protocol.errors import BrokerError, ConfigError, PlanError

if TYPE_CHECKING:  # numpy, rich and matplotlib load only when a plan is made, not with the parser
    from edgefleet.coordinator.plan_fleet import FleetCheck
    from edgefleet.coordinator.planning import PlanResult

log = logging.getLogger(__name__)

DEFAULT_PROFILE = Path("edgefleet-profile.json")
DEFAULT_GLOBAL_BATCHES = "32,64,128"
OBJECTIVES = ("time", "energy", "edp")  # planning.OBJECTIVES, without importing numpy for --help
DEFAULT_FEWER_BOARDS_PCT = 2.0          # planning.search.FEWER_BOARDS_WITHIN, in percent

PLAN_EPILOG = """\
examples:
  edge-coordinator plan                                   minimise energy x time (EDP) over the online boards
  edge-coordinator plan --objective time --batch 32,64,128
  edge-coordinator plan --objective energy --max-power 15 --deadline 30 --epochs 5
  edge-coordinator plan --model mlp --layers 2,3,4 --top 20
  edge-coordinator plan --verify 2 --fleet-key fleet.key  pre-train the best 2 for 20 steps, choose on measurement
  edge-coordinator plan --no-fleet-check --json           plan on the profile file alone, for scripts

The profile comes from `edge-coordinator profile` (default ./edgefleet-profile.json). A profiled
board that is offline now is left out, with a line saying so; a profile measured for another
model, dataset or agent version is refused (profile again). --deadline is in minutes for a run of
--epochs epochs. The time/energy Pareto front is drawn to <profile>-pareto.png unless --png says
where. Exit status: 0 with a plan; 1 when no configuration meets the request (the message names
the constraint and by how much) or the profile does not fit the job.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """The objective and constraints of one planning request (the CLI flags, in plan()'s units)."""

    objective: str
    max_power_w: float | None
    deadline_s: float | None          # per epoch: --deadline minutes * 60 / --epochs
    global_batches: tuple[int, ...]
    count_idle: bool
    max_memory_fraction: float
    top: int
    fewer_boards_within: float = DEFAULT_FEWER_BOARDS_PCT / 100  # near ties go to fewer boards (a fraction)

    def run(self, profiles: dict[str, Any], *, deadline_text: str = "") -> PlanResult:
        """plan() over ``profiles``; ``deadline_text`` explains the per-epoch deadline in a refusal."""
        from edgefleet.coordinator.planning import plan

        try:
            return plan(profiles, objective=self.objective, max_power_w=self.max_power_w, deadline_s=self.deadline_s,
                        global_batches=self.global_batches, count_idle=self.count_idle,
                        max_memory_fraction=self.max_memory_fraction, top=self.top,
                        fewer_boards_within=self.fewer_boards_within)
        except PlanError as exc:
            if deadline_text and "--deadline" in str(exc):
                raise PlanError(f"{exc} ({deadline_text})") from None
            raise


def deadline_text(args: argparse.Namespace, epochs: float | None = None) -> str:
    """``"--deadline 30 min over 5 epochs = 6.0 min per epoch"``, or "" without a deadline."""
    if args.deadline is None:
        return ""
    from edgefleet.coordinator.planning import format_duration

    epochs = epochs if epochs is not None else args.epochs
    return (f"--deadline {args.deadline:g} min over {epochs:g} epoch{'s' if epochs != 1 else ''} = "
            f"{format_duration(args.deadline * 60 / epochs)} per epoch")


def add_objective_args(p: argparse.ArgumentParser) -> None:
    """The flags ``plan`` and ``train --auto`` share: objective, constraints, profile file, variants."""
    p.add_argument("--objective", choices=OBJECTIVES, default="edp",
                   help="minimise time per epoch, energy per epoch, or their product EDP (default edp)")
    p.add_argument("--max-power", type=float, metavar="W",
                   help="power cap: the taking-part boards together draw at most W watts")
    p.add_argument("--deadline", type=float, metavar="MIN", help="the whole run (--epochs epochs) within MIN minutes")
    p.add_argument("--count-idle", action="store_true",
                   help="charge the idle power of the boards left out (they stay on) to the energy")
    p.add_argument("--max-memory-fraction", type=float, default=0.9, metavar="F",
                   help="share of a board's memory a predicted peak may use (default 0.9)")
    p.add_argument("--fewer-boards-within", type=float, default=DEFAULT_FEWER_BOARDS_PCT, metavar="PCT",
                   help="of the configurations within PCT%% of the best estimate, choose the one with the fewest "
                        f"boards (default {DEFAULT_FEWER_BOARDS_PCT:g}; 0 = always the best estimate): an estimate "
                        "is not exact to a few percent, and every board added is one more link to wait for")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help=f"profile file from `edge-coordinator profile` (default ./{DEFAULT_PROFILE})")
    add_variant_args(p)


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose boards, batch sizes and model variant from a profile",
                       description="Estimate every configuration (which boards take part, each one's batch size, "
                                   "the model variant) from the profile, choose the best for the objective under "
                                   "the constraints, and draw the time/energy Pareto front.",
                       epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_objective_args(p)
    p.add_argument("--epochs", type=float, default=1.0, metavar="E", help="epochs the --deadline covers (default 1)")
    p.add_argument("--batch", default=DEFAULT_GLOBAL_BATCHES, metavar="B,B,…",
                   help=f"global batch sizes to consider, split among the boards (default {DEFAULT_GLOBAL_BATCHES})")
    p.add_argument("--model", help="the job's model (default: the profile's); another model than profiled is refused")
    p.add_argument("--model-options", default="", metavar="K=V,…", help="the job's model options (default: the profile's)")
    p.add_argument("--dataset", help="the job's dataset (default: the profile's)")
    p.add_argument("--dataset-options", default="", metavar="K=V,…", help="the job's dataset options")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows in the table (default 10)")
    p.add_argument("--png", type=Path, metavar="FILE", help="where to draw the Pareto front (default <profile>-pareto.png)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON for scripts (notes go to stderr)")
    p.add_argument("--no-fleet-check", action="store_true",
                   help="plan on the profile alone: do not ask the broker which boards are online and their versions")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="pre-train the best K candidates for a few real steps and choose on the measured figures")
    p.add_argument("--verify-steps", type=int, default=20, metavar="N",
                   help="timed steps per pre-trained candidate, after 3 warm-up steps (default 20)")
    p.add_argument("--fleet-key", metavar="FILE", help="with --verify: the key that signs commands "
                                                       "(default: [security] fleet_key_file)")


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
    return PlanRequest(objective=args.objective, max_power_w=args.max_power, deadline_s=deadline_s,
                       global_batches=tuple(global_batches), count_idle=args.count_idle,
                       max_memory_fraction=args.max_memory_fraction, top=max(1, getattr(args, "top", 10)),
                       fewer_boards_within=args.fewer_boards_within / 100)


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
    from edgefleet.coordinator.config import load_coordinator_config
    from edgefleet.coordinator.plan_fleet import (
        FleetCheck,
        check_fleet,
        fleet_rows,
        load_profile_file,
        restrict_to,
        select_variants,
    )
    from edgefleet.protocol.address import parse_host_port

    if args.verify < 0 or args.verify_steps < 1:
        raise ConfigError("--verify K needs K >= 1 (0 = no pre-training) and --verify-steps N >= 1")
    if args.verify and args.no_fleet_check:
        raise ConfigError("--verify pre-trains on the boards, so it needs the broker: drop --no-fleet-check")
    request = request_from_args(args, parse_int_list(args.batch, "--batch"), args.epochs)
    profiles, meta = load_profile_file(args.profile)
    selected = select_variants(profiles, meta=meta, model=args.model, variants=requested_variants(
        args, _parse_options(args.model_options)), dataset=args.dataset, dataset_options=_parse_options(args.dataset_options))
    notes: list[str] = []
    broker = None
    if args.no_fleet_check:
        check = FleetCheck.unchecked(selected)
        notes.append("not checked against the fleet (--no-fleet-check): boards and agent versions are the profile's")
    else:
        broker = load_coordinator_config(args.config, broker=parse_host_port(args.broker, what="--broker")
                                         if args.broker else None, fleet_key_file=args.fleet_key)
        try:
            check = check_fleet(selected, fleet_rows(broker.broker))
        except BrokerError as exc:
            raise BrokerError(f"{exc} (or plan on the profile alone with --no-fleet-check)") from None
    notes += check.notes
    result = request.run(restrict_to(selected, check), deadline_text=deadline_text(args))
    png = _draw(result, args.png or args.profile.with_name(f"{args.profile.stem}-pareto.png"), notes)
    if not args.json:
        _print_plan(result, request, notes, png)
    verified = None
    if args.verify:
        assert broker is not None
        verified = _verify(args, result, list(check.boards), broker, meta, dataset_len=next(iter(selected.values())).dataset_len)
    if args.json:
        _print_json(result, check, notes, png, verified)
    return 0


def _draw(result: PlanResult, path: Path, notes: list[str]) -> Path | None:
    from edgefleet.coordinator.planning import write_pareto_png

    try:
        return write_pareto_png(path, list(result.ranked) + list(result.front), result.chosen,
                                title=f"Candidates by time and energy per epoch (objective: {result.objective})")
    except (RuntimeError, OSError) as exc:
        notes.append(f"no Pareto plot: {exc}")
        return None


def _verify(args: argparse.Namespace, result: PlanResult, boards: list[str], cfg: Any, meta: Any, *,
            dataset_len: int) -> Any:
    """Pre-train the best ``--verify`` candidates; print the comparison unless --json."""
    from edgefleet.coordinator.verify import JobSpec, verify_candidates, verify_report
    from edgefleet.transport.fleet_key import load_fleet_key

    if not cfg.security.fleet_key_file:
        raise ConfigError("--verify sends training commands: give --fleet-key FILE or [security] fleet_key_file")
    model = args.model or (meta.model if meta is not None else None)
    dataset = args.dataset or (meta.dataset if meta is not None else None)
    if model is None or dataset is None:
        raise PlanError("--verify needs to know what to train: the profile does not say, so give --model and --dataset")
    dataset_options = _parse_options(args.dataset_options)
    if dataset_options is None and meta is not None and dataset == meta.dataset:
        dataset_options = dict(meta.dataset_options)
    job = JobSpec(model=model, base_options=_parse_options(args.model_options) or {}, dataset=dataset,
                  dataset_options=dataset_options or {}, wire_dtype=meta.wire_dtype if meta is not None else "float32")
    console = None if args.json else _console()
    verified = verify_candidates(list(result.ranked[:args.verify]), job, broker=cfg.broker,
                                 fleet_key=load_fleet_key(Path(cfg.security.fleet_key_file)),
                                 objective=result.objective, steps=args.verify_steps, count_idle=args.count_idle,
                                 fleet_boards=boards, dataset_len=dataset_len,
                                 on_note=(lambda text: print(text, file=sys.stderr)) if console is None
                                 else (lambda text: console.print(text, markup=False, soft_wrap=True)))
    if console is not None:
        verify_report(console, verified)
    return verified


def _console() -> Any:
    from edgefleet.coordinator.render import make_console

    return make_console()


def _print_plan(result: PlanResult, request: PlanRequest, notes: list[str], png: Path | None) -> None:
    from edgefleet.coordinator.plan_render import plan_notes, plan_table, summary_of

    console = _console()
    for note in notes:
        console.print(note, markup=False, soft_wrap=True)
    console.print(plan_table(result, request))
    for line in plan_notes(result):
        console.print(line, markup=False, soft_wrap=True)
    console.print(summary_of(result.chosen, "chosen"), markup=False, soft_wrap=True)
    if png is not None:
        console.print(f"Pareto front: {png}", markup=False, soft_wrap=True)


def _print_json(result: PlanResult, check: FleetCheck, notes: list[str], png: Path | None, verified: Any) -> None:
    from edgefleet.coordinator.plan_render import estimate_json

    for note in notes:
        print(note, file=sys.stderr)
    doc: dict[str, Any] = {
        "objective": result.objective, "method": result.method, "evaluated": result.evaluated,
        "feasible": result.feasible, "chosen": estimate_json(result.chosen),
        "passed_over": None if result.passed_over is None else estimate_json(result.passed_over),
        "fewer_boards_within": result.fewer_boards_within,
        "ranked": [estimate_json(e) for e in result.ranked], "front": [estimate_json(e) for e in result.front],
        "ruled_out": [{"constraint": x.constraint, "board_id": x.board_id, "count": x.count, "example": x.example}
                      for x in result.ruled_out],
        "boards": list(check.boards), "left_out": dict(check.left_out), "notes": notes,
        "png": None if png is None else str(png),
    }
    if verified is not None:
        from edgefleet.coordinator.verify import verify_json

        doc["verify"] = verify_json(verified)
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


__all__ = ["PlanRequest", "add_objective_args", "add_plan_parser", "cmd_plan", "deadline_text", "request_from_args",
           "requested_variants"]
