"""Does the pipeline planner pick the fastest plan? Ten lab cases, each plan measured side by side (issue 35).

Issue 35's target: the planner's pick is the measured best, or within 5% of it, in at least 9 of
10 lab cases. On the emulated lab's ``fleet8`` (root), through the real ``edge-coordinator train``:

1. each model of the cases is profiled once on every board (``edge-coordinator profile``, per-layer
   figures included; the other boards spin meanwhile), and the profile is kept;
2. for each case (a model and a few of fleet8's boards, :data:`CASES`), every plan train can run
   today over those boards is costed by the pipeline cost model (``bench/pipeline_candidates.py``:
   data-parallel, or a stage-0 group and one or two later stages of one board or a group, GPipe, M = 1, 2, 4);
   the cheapest is the model's pick. With ``--verify K`` (default 3) the case's pick is
   ``edge-coordinator plan --pipeline --boards ... --verify K`` instead: the K best distinct plans by the
   model, each pre-trained for 3 + 20 real steps ``--verify-rounds`` times in turn (default 2: A B C C B A), the
   fastest by the mean of its runs chosen (``planning.pipeline_verify``);
   ``--verify 0`` takes the model's pick as it is;
3. the pick, the model's pick and the best plan of each other family (another shape, another M, another stage count;
   at most 5) each train ``--epochs`` epochs (default 3, no target) with ``--stage-sync checkpoint``
   as ``plan --pipeline``'s flags say and the split the model gives stage 0's boards; data-parallel
   runs take the pipeline model's split too. Each run's samples/s counts the steps after the warm-up,
   validation left out (``bench/scaling.py``'s definition), its state steps in.

The boards' CPU quotas run in each board's shortest CFS period (``--cpu-period-ms 1``, a 1 ms quota): in
the fleet file's 10 ms a later stage, computing in bursts between micro-batches, runs them at the
host core's speed, which no real board does (docs/lab.md).

A case is a hit when the pick's samples/s is at least 95% of the best measured one's; the model's own pick
is scored alike, for the record of what the pre-training adds. Two runs of
one plan differ by up to 8% on the lab, so a pick at 85-95% of the best is taken again with the best,
and each counts the mean of its two runs. Printed per
plan: predicted and measured step time, samples/s against the case's best, and each board's median
busy time a step (its step without the time it waited on a neighbour: ``compute_s``), which is what
calibrating the cost model needs; ``--json OUT`` keeps it all with the profiles' paths.

Run as root from the repository root (about 30 min on a 2-core machine; 17-20 with ``--verify 0``)::

    python bench/pipeline_picks.py --json OUT --keep-runs DIR
    python bench/pipeline_picks.py --cases 1 6 --epochs 2        # a quicker look

Exit status: 0 when every run was made (whatever the hits), 2 when one or more could not be, 130
when interrupted; the lab comes down on every exit path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import scaling  # bench/ is the script's folder, first on sys.path
from _harness import (
    ballast,
    in_coordinator_netns,
    log_tail,
    sigterm_as_ctrl_c,
    train_command,
    wait_ready,
    write_fleet_key,
)
from _table import print_table
from pipeline_candidates import Candidate, candidate_of_flags, runs_to_measure, same_plan, trainable_plans

from edgefleet.coordinator.planning.pipeline_verify import DEFAULT_VERIFY_ROUNDS

if TYPE_CHECKING:
    from edgefleet.coordinator.planning import FleetProfile
    from edgefleet.coordinator.planning.pipeline_model import PipelineProblem

log = logging.getLogger("bench.pipeline_picks")

FLEET = "fleet8"
HIT_SHARE = 0.95          # the pick within 5% of the measured best
RETAKE_SHARE = 0.85       # a pick this close to a miss: it and the best are taken again, each figure the mean of two
EPOCHS = 3
VERIFY = 3                # plan --pipeline --verify K: the K best plans by the model pre-trained
CPU_PERIOD_MS = 1.0  # each board's shortest CFS period (lab.fleet_file.LabSettings.cpu_period_ms)
CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("conv_mlp", ("x86-1", "pi5-1", "pi5-2")),
    ("conv_mlp", ("x86-1", "pi5-2", "pi4-3")),
    ("conv_mlp", ("pi5-1", "pi5-2", "pi4-3")),
    ("conv_mlp", ("x86-1", "pi5-1", "pi5-2", "pi4-3")),
    ("conv_mlp", ("x86-1", "pi4-1", "pi4-2")),
    ("conv_mlp", ("pi4-1", "pi4-2", "pi4-3", "nano-1")),
    ("lenet5", ("x86-1", "pi5-1", "pi5-2")),
    ("lenet5", ("pi5-1", "pi5-2", "pi4-3")),
    ("lenet5", ("x86-1", "pi4-1", "nano-1")),
    ("lenet5", ("pi4-1", "pi4-2", "pi4-3", "nano-1")),
)


@dataclass
class PlanRun:
    """One measured plan of a case."""

    label: str
    pipeline: str | None            # train's --pipeline, None for data-parallel
    boards: list[str]
    batch_sizes: list[int]
    micro_batches: int
    predicted_step_ms: float
    samples_per_s: float | None = None  # the mean over its takes
    takes: list[float] = field(default_factory=list)  # each run's samples/s (a near miss is taken twice)
    step_ms: float | None = None    # the global batch over samples/s
    busy_ms: dict[str, float] = field(default_factory=dict)  # each board's median compute_s a step
    stolen: float = 0.0
    others_share: float = 0.0
    error: str = ""


@dataclass
class CaseResult:
    number: int
    model: str
    boards: list[str]
    plans_costed: int
    runs: list[PlanRun]
    model_pick: str = ""                # the model's pick's label (the pick itself with --verify 0)
    verify: dict[str, object] = field(default_factory=dict)  # plan --pipeline --verify's trials and choice

    @property
    def best(self) -> PlanRun | None:
        done = [r for r in self.runs if r.samples_per_s]
        return max(done, key=lambda r: r.samples_per_s or 0.0) if done else None

    @property
    def pick_share(self) -> float | None:
        """The pick's samples/s over the best measured plan's."""
        best, pick = self.best, self.runs[0] if self.runs else None
        if best is None or pick is None or not pick.samples_per_s or not best.samples_per_s:
            return None
        return pick.samples_per_s / best.samples_per_s

    @property
    def hit(self) -> bool | None:
        share = self.pick_share
        return None if share is None else share >= HIT_SHARE

    @property
    def model_hit(self) -> bool | None:
        """Whether the model's own pick is within 5% of the best measured plan."""
        best = self.best
        model = next((r for r in self.runs if r.label == self.model_pick), None)
        if best is None or model is None or not model.samples_per_s or not best.samples_per_s:
            return None
        return model.samples_per_s / best.samples_per_s >= HIT_SHARE


def _busy(run_dir: Path, warmup: int) -> dict[str, float]:
    """Each board's median ``compute_s`` over the steps after the warm-up, in ms."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if isinstance(r.get("compute_s"), dict)][warmup:]
    boards = {b for r in records for b in r["compute_s"]}
    return {b: round(statistics.median(r["compute_s"][b] for r in records if b in r["compute_s"]) * 1e3, 2)
            for b in sorted(boards)}


def _measure_plan(ctx: scaling.FleetContext, model: str, number: int, index: int, cand: Candidate,
                  epochs: int, quotas: dict[str, float], run: PlanRun | None = None) -> PlanRun:
    """Train ``cand`` and note its figures in ``run`` (a new one unless this is a retake)."""
    workload = dataclasses.replace(scaling.WORKLOADS[model], target=1.01)  # never reached: the run goes its epochs
    if run is None:
        run = PlanRun(label=cand.label, pipeline=cand.shape if cand.later else None, boards=list(cand.boards),
                      batch_sizes=list(cand.batch_sizes), micro_batches=cand.micro_batches,
                      predicted_step_ms=round(cand.predicted_step_s * 1e3, 2))
    run_dir = ctx.runs_dir / f"case{number}-plan{index}-take{len(run.takes) + 1}"
    piped = ["--pipeline", cand.shape, "--micro-batches", str(cand.micro_batches), "--stage-sync", "checkpoint"]
    # --batch is stage 0's boards' (a later stage's board takes the whole batch from its neighbour)
    cmd = train_command(ctx.lab, ctx.key_file, cand.boards, cand.batch_sizes, "--model", model,
                        "--dataset", workload.dataset, "--epochs", str(epochs), "--seed", "0", "--no-rebalance",
                        "--run-dir", str(run_dir), *(piped if cand.later else []), board_keys=bool(cand.later))
    cmd = in_coordinator_netns(ctx.lab, cmd)
    later = (0,) * (len(cand.boards) - len(cand.stage0))  # every later stage's board, a group's each
    cfg = scaling.Config(FLEET, model, "picks", cand.boards, (*cand.batch_sizes, *later),
                         tuple(quotas[b] for b in cand.boards), "planned")
    wait_ready(ctx.lab, cand.boards)
    idle = [b for b in ctx.ballast_info if b not in cand.boards] if ctx.ballast else []
    cpu = scaling.StepCpu({b: ctx.board_cpuacct[b] for b in cand.boards})
    log_path = run_dir.with_suffix(".log")
    try:
        with ballast(ctx.ballast_info, idle):
            load = scaling.HostLoad(ctx.cpuacct_files)
            started = time.monotonic()
            status, _ = scaling._drive(cmd, run_dir, log_path, workload, f"case {number} {cand.label}", ctx.deadline, cpu)
            wall = time.monotonic() - started
            host = load.finish()
        if status != 0 or not (run_dir / "metrics.jsonl").exists():
            raise RuntimeError(f"train exited with {status}:\n{log_tail(log_path)}")
        figures = scaling._figures(cfg, workload, run_dir, wall, False, host, cpu)
    except RuntimeError as exc:
        if isinstance(exc, scaling.OutOfTime):
            raise
        run.error = str(exc)
        return run
    if figures.samples_per_s:
        run.takes.append(figures.samples_per_s)
        run.samples_per_s = statistics.fmean(run.takes)
        run.step_ms = workload.global_batch / run.samples_per_s * 1e3
    run.busy_ms = _busy(run_dir, scaling.WARMUP_STEPS)
    run.stolen, run.others_share = max(run.stolen, figures.stolen), max(run.others_share, figures.others_share)
    return run


def _problem(profile: FleetProfile, boards: tuple[str, ...], global_batch: int) -> PipelineProblem:
    from edgefleet.coordinator.planning.pipeline_model import problem_from_fleet

    problem, _ = problem_from_fleet(profile, global_batch=global_batch)
    return dataclasses.replace(problem, boards=tuple(b for b in problem.boards if b.board_id in boards))


def verified_pick(ctx: scaling.FleetContext, model: str, boards: Sequence[str], profile: str, count: int, rounds: int,
                  *, what: str) -> tuple[Candidate, dict[str, object]]:
    """``plan --pipeline --verify count --verify-rounds rounds`` over ``boards``: the plan it chooses on measurement,
    and its record (``what``: the run's name in messages and its log's, e.g. "case 3").

    Raises:
        RuntimeError: plan failed (its output's tail included).
    """
    from edgefleet.launch import module_command

    workload = scaling.WORKLOADS[model]
    log_path = ctx.runs_dir / f"{what.replace(' ', '')}-verify.log"
    cmd = in_coordinator_netns(ctx.lab, module_command(
        "edgefleet.coordinator.cli", "--broker", ctx.lab.broker_address, "plan", "--profile", profile, "--pipeline",
        "--objective", "time", "--batch", str(workload.global_batch), "--boards", ",".join(boards), "--verify", str(count),
        "--verify-rounds", str(rounds), "--fleet-key", str(ctx.key_file), "--board-keys", str(ctx.lab.board_keys_dir), "--json"))
    idle = [b for b in ctx.ballast_info if b not in boards] if ctx.ballast else []
    wait_ready(ctx.lab, boards)
    timeout = max(1.0, ctx.deadline - time.monotonic())
    with ballast(ctx.ballast_info, idle), log_path.open("w") as err:
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise scaling.OutOfTime(f"{what}: plan --verify not done in {timeout:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{what}: plan --pipeline --verify exited with {done.returncode}:\n{log_tail(log_path)}")
    verify = json.loads(done.stdout)["verify"]
    chosen = verify["trials"][verify["chosen"]]
    return candidate_of_flags(chosen["train_flags"], chosen["predicted"]["step_time_s"]), verify


def _measure(args: argparse.Namespace, key_file: Path, tmp: Path, results: list[CaseResult],
             profiles: dict[str, str], failures: list[str]) -> None:
    cases = [(n, *CASES[n - 1]) for n in args.cases]
    logs = args.keep_runs / FLEET / "lab-logs" if args.keep_runs else None  # the agents' logs outlive the lab there
    with scaling.lab_up(FLEET, key_file, logs_dir=logs, cpu_period_ms=args.cpu_period_ms) as lab:
        runs_dir = (args.keep_runs or tmp) / FLEET
        ctx = scaling.FleetContext.of_lab(lab, key_file, runs_dir, args.deadline, args.ballast)
        quotas = {b.id: b.cpu for b in scaling._fleet_quotas(lab.fleet)}
        every = sorted(lab.boards)
        scaling._warm(ctx, every)
        fleets: dict[str, FleetProfile] = {}
        for model in dict.fromkeys(model for _, model, _ in cases):
            print(f"  profiling {model} on every board", file=sys.stderr, flush=True)
            fleets[model], record = scaling._profile(ctx, model, every)
            profiles[model] = str(runs_dir / f"profile-{model}.json")
            print(f"    profiled in {record['profile_s']:.0f} s", file=sys.stderr, flush=True)
        for number, model, boards in cases:
            problem = _problem(fleets[model], boards, scaling.WORKLOADS[model].global_batch)
            plans = trainable_plans(problem)
            chosen = runs_to_measure(plans)
            print(f"  case {number}: {model} on {'+'.join(boards)}: {len(plans)} plans costed, the model's pick "
                  f"{chosen[0].label if chosen else 'none'}", file=sys.stderr, flush=True)
            result = CaseResult(number, model, list(boards), len(plans), [], model_pick=chosen[0].label if chosen else "")
            if args.verify and chosen:
                started = time.monotonic()
                pick, result.verify = verified_pick(ctx, model, boards, profiles[model], args.verify,
                                                    args.verify_rounds, what=f"case {number}")
                same = next((c for c in chosen if same_plan(c, pick)), None)
                chosen = [same or pick, *(c for c in chosen if not same_plan(c, pick))]  # the model's pick stays measured
                print(f"    plan --verify {args.verify} chose {pick.label} in {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)
            for index, cand in enumerate(chosen):
                run = _measure_plan(ctx, model, number, index, cand, args.epochs, quotas)
                result.runs.append(run)
                if run.error:
                    failures.append(f"case {number} {cand.label}: {run.error.splitlines()[0]}")
                print(f"    {cand.label}: predicted {run.predicted_step_ms:.0f} ms, measured "
                      f"{scaling._fmt(run.step_ms, '.0f')} ms, busy {run.busy_ms}{' FAILED' if run.error else ''}",
                      file=sys.stderr, flush=True)
            share, best = result.pick_share, result.best
            if share is not None and best is not None and RETAKE_SHARE <= share < HIT_SHARE:
                print("    a near miss: the pick and the best measured taken again", file=sys.stderr, flush=True)
                for index in (0, result.runs.index(best)):
                    again = _measure_plan(ctx, model, number, index, chosen[index], args.epochs, quotas,
                                          result.runs[index])
                    if again.error:
                        failures.append(f"case {number} {again.label}, taken again: {again.error.splitlines()[0]}")
            results.append(result)
            print(f"    pick at {scaling._fmt(result.pick_share, '.2f')} of the best: "
                  f"{'hit' if result.hit else 'miss'}", file=sys.stderr, flush=True)


def print_figures(results: list[CaseResult], wall_s: float) -> None:
    rows = []
    for case in results:
        best = case.best
        for index, run in enumerate(case.runs):
            rows.append([str(case.number) if index == 0 else "", case.model if index == 0 else "",
                         ("pick: " if index == 0 else "") + run.label, f"{run.predicted_step_ms:.0f}",
                         scaling._fmt(run.step_ms, ".0f"),
                         scaling._fmt(run.samples_per_s / best.samples_per_s if best and best.samples_per_s
                                      and run.samples_per_s else None, ".2f"),
                         " ".join(f"{b} {v:.0f}" for b, v in run.busy_ms.items()) or run.error[:40]])
    hits = [c.hit for c in results if c.hit is not None]
    model_hits = [c.model_hit for c in results if c.model_hit is not None]
    verified = any(c.verify for c in results)
    print_table("The pipeline planner's pick against the measured best, fleet8",
                ["case", "model", "plan", "predicted ms", "measured ms", "x best", "busy ms a step"], rows,
                caption=f"hits (pick within {1 - HIT_SHARE:.0%} of the best measured): {sum(hits)} of {len(hits)} "
                        f"cases (target: 9 of 10)"
                        + (f"; the model's own pick: {sum(model_hits)} of {len(model_hits)}" if verified else "")
                        + f"; {wall_s / 60:.1f} min")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", type=int, default=list(range(1, len(CASES) + 1)),
                        choices=range(1, len(CASES) + 1), metavar="N", help=f"which cases, 1 to {len(CASES)} (default all)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"each run's length (default {EPOCHS})")
    parser.add_argument("--verify", type=int, default=VERIFY, metavar="K",
                        help=f"the pick is plan --pipeline --verify K's (default {VERIFY}); 0: the cost model's pick")
    parser.add_argument("--verify-rounds", type=int, default=DEFAULT_VERIFY_ROUNDS, metavar="R",
                        help=f"with --verify: each plan pre-trained R times, forth and back (default {DEFAULT_VERIFY_ROUNDS})")
    parser.add_argument("--ballast", action=argparse.BooleanOptionalAction, default=True,
                        help="boards left out of a run spin at their quotas meanwhile (default on)")
    parser.add_argument("--cpu-period-ms", type=float, metavar="MS", default=CPU_PERIOD_MS,
                        help=f"the boards' CFS period (default {CPU_PERIOD_MS:g}: each board's shortest, a 1 ms quota, so "
                             "that a later stage's short bursts run at its board's speed; the fleet file's 10 ms lets "
                             "them run at the host's)")
    parser.add_argument("--max-minutes", type=float, default=70.0, help="stop (exit 2) after this long (default 70)")
    parser.add_argument("--keep-runs", type=Path, metavar="DIR", help="keep every run directory, log and profile here")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write every figure here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("pipeline_picks: needs root for the lab (network namespaces, cgroups)", file=sys.stderr)
        return 2
    from edgefleet.lab.lab import LabBusy, LabUnavailable

    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    started = time.monotonic()
    args.deadline = started + args.max_minutes * 60
    results: list[CaseResult] = []
    profiles: dict[str, str] = {}
    failures: list[str] = []
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="efl-picks-") as tmp:
        key_file = write_fleet_key(Path(tmp) / "fleet.key")
        try:
            _measure(args, key_file, Path(tmp), results, profiles, failures)
        except (scaling.OutOfTime, LabUnavailable, LabBusy, TimeoutError, RuntimeError) as exc:
            failures.append(str(exc))
        except KeyboardInterrupt:
            interrupted = True
            print("pipeline_picks: interrupted; the lab is down", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "deadline"},
                                         "wall_s": wall, "profiles": profiles, "failures": failures,
                                         "cases": [{**asdict(c), "pick_share": c.pick_share, "hit": c.hit,
                                                    "model_hit": c.model_hit}
                                                   for c in results], "interrupted": interrupted},
                                        indent=1, default=str))
    print_figures(results, wall)
    if interrupted:
        return 130
    return 0 if not failures and len(results) == len(args.cases) else 2


if __name__ == "__main__":
    sys.exit(main())
