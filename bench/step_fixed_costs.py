"""A board's CPU per training step at small batches, fitted as ``a + b * n``: the fixed cost ``a`` and where it goes.

Why: on the lab's fleet8 the small boards (0.09-0.12 of a core, 4-6 samples a step) spent about
3.6 ms of CPU a step that does not shrink with the batch (docs/benchmarks.md, issue 22 part 4):
at a tenth of a core that is 36 ms of wall time, every step. This benchmark measures that fixed
cost on the board's real step and breaks it down.

What runs: one board process (spawned, ``torch.set_num_threads(1)``) runs
``agent.worker.run_job`` itself, unchanged (the job's Lightning ``Trainer.fit`` with the
``GradientExchange`` callback, the ``ExchangeClient``, the data loader over the fleet's sampler),
for each batch size ``n`` of ``--batches``, one job after the other as a kept worker does. This
process is the coordinator's side: a real ``coordinator.exchange.server.ExchangeServer`` on 127.0.0.1
with this one board; its ``apply`` does nothing (the board's CPU is what is measured). The board
runs in a cgroup v1 group of its own with a CFS quota (``--quotas``, 10 ms periods as in the lab,
``lab.cgroups``) or unconstrained (quota 0); it joins its group after its imports.

A step's CPU is the board process's CPU time (``time.process_time``) from one step's
``GradientExchange`` progress call to the next (the worker's own ``on_step``), median over the
``--steps`` timed steps after ``--warmup`` untimed ones; ``a`` and ``b`` are the least-squares
line through the medians of the batch sizes. With ``--breakdown`` a second pass per batch size
marks the thread's CPU time at the step's boundaries (Lightning hooks, the module's
``training_step`` and ``backward``, ``GradientExchange.on_before_optimizer_step``,
``ExchangeClient.exchange``, the optimizer's step hooks, the DataLoader's fetch) and reports each
segment's median, fitted as ``a + b * n`` too: its ``a`` is the segment's share of the fixed cost.

Reference (this 2-core host, 2026-11-26, other processes 17% of it, ``--passes 2``): at 0.12 core
a = 8.0 ms (resnet_small) and 6.0 ms (lenet5) of CPU a step, 52-66 ms of wall time; unconstrained
4.7-8 ms. Lightning's loop and hooks take about 2.5 ms of it, ``training_step`` with ``self.log``
2 ms, the optimizer 1 ms, the exchange (our hook and client) 0.65-0.72 ms (1.0-1.3 ms before the
one-call gradient copies and the fixed-layout result with logs). The figures move by +-20% between
runs on a shared host: compare with ``--baseline``, not across runs.

``--baseline DIR`` runs a second board beside it whose ``edgefleet`` is imported from ``DIR``
(another checkout, e.g. ``git worktree add /tmp/base HEAD``): the two run each job in turn, so an
A/B comparison sees the same host. ``--json FILE`` keeps every figure.

Run as root (the cgroup). Exit code 0 if the run completed, 2 if it could not be made. The board
process and the cgroup are removed on every exit path (SIGTERM and Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from _board_queue import next_message  # bench/ is the script's folder, first on sys.path
from _harness import BenchError, die_with_parent, host_note, quiet_lightning
from _table import print_table

DATASET = "digits"
SEED = 0
BOARD_ID = "bench-0"
CFS_PERIOD_US = 10_000  # the lab's (lab.cgroups.CFS_PERIOD_US)

# The segments of a step, in order: each is named by the mark that ends it (see Marks).
SEGMENTS: dict[str, str] = {
    "data_in": "Lightning: batch end -> next fetch",
    "data_out": "data: sampler + dataset + collate",
    "batch_start": "Lightning: fetch -> on_train_batch_start",
    "opt_in": "Lightning: batch start -> optimizer.step",
    "fwd_in": "Lightning: closure -> training_step",
    "fwd_out": "forward: training_step (self.log included)",
    "bwd_in": "Lightning: zero_grad, closure",
    "bwd_out": "backward",
    "cb_in": "Lightning: after backward -> exchange hook",
    "ex_in": "exchange hook: gradient into the send buffer",
    "ex_out": "ExchangeClient.exchange: send + receive",
    "cb_out": "exchange hook: average into .grad, progress",
    "closure_out": "Lightning: exchange hook -> closure return",
    "opt_out": "optimizer update",
    "batch_end": "Lightning: optimizer step -> on_train_batch_end",
}


# ----------------------------------------------------------------------------- arithmetic

def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b * x``; needs two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct x values, got {list(xs)}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def step_cpu(marks: Sequence[int], warmup: int) -> list[float]:
    """Seconds between consecutive progress marks (nanoseconds), after ``warmup`` steps."""
    return [(b - a) / 1e9 for a, b in zip(marks[warmup:], marks[warmup + 1:])]


def segment_medians(steps: Sequence[dict[str, int]]) -> dict[str, float]:
    """Median seconds of each segment over the steps (0 where a step lacked it)."""
    return {name: statistics.median(s.get(name, 0) for s in steps) / 1e9 for name in SEGMENTS}


# ----------------------------------------------------------------------------- the board

class Marks:
    """The thread's CPU time at the boundaries of a step; each segment is added to the mark that ends it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._current: dict[str, int] = {}
        self._last = time.thread_time_ns()

    def mark(self, name: str) -> None:
        now = time.thread_time_ns()
        self._current[name] = self._current.get(name, 0) + now - self._last
        self._last = now

    def step_ended(self) -> None:
        self.steps.append(self._current)
        self._current = {}


def _wrap(owner: Any, attr: str, before: str | None, after: str | None, marks: Marks) -> None:
    inner = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            marks.mark(before)
        try:
            return inner(*args, **kwargs)
        finally:
            if after:
                marks.mark(after)

    setattr(owner, attr, wrapped)


def install_marks(marks: Marks) -> None:
    """Mark the step's boundaries in this process: a callback added to the worker's Trainer, and wrappers."""
    import pytorch_lightning as pl
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils.data import dataloader

    from edgefleet.agent.worker_exchange import GradientExchange
    from edgefleet.workloads import fleet_trainer

    class StepMarks(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            _wrap(pl_module, "training_step", "fwd_in", "fwd_out", marks)
            _wrap(pl_module, "backward", "bwd_in", "bwd_out", marks)
            exchange = next(c for c in trainer.callbacks if isinstance(c, GradientExchange))
            _wrap(exchange, "on_before_optimizer_step", "cb_in", "cb_out", marks)
            _wrap(exchange.client, "exchange", "ex_in", "ex_out", marks)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            marks.mark("batch_start")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            marks.mark("batch_end")
            marks.step_ended()

    def before_step(optimizer: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        marks.mark("opt_in")
        closure = kwargs.get("closure")
        if closure is None:
            return None

        def marked_closure() -> Any:
            try:
                return closure()
            finally:
                marks.mark("closure_out")

        return args, {**kwargs, "closure": marked_closure}

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: marks.mark("opt_out"))
    _wrap(dataloader._SingleProcessDataLoaderIter, "_next_data", "data_in", "data_out", marks)
    make_trainer = fleet_trainer.make_trainer

    def marked_trainer(package: Any, *, callbacks: list[Any], **kwargs: Any) -> Any:
        return make_trainer(package, callbacks=[*callbacks, StepMarks()], **kwargs)

    fleet_trainer.make_trainer = marked_trainer  # run_job imports it when it runs


def board_main(jobs: Any, results: Any, verbose: bool, code_root: str) -> None:
    """The board: imports first, says ready (the parent then puts it in its cgroup), then runs each job it is sent."""
    if code_root:  # the baseline's edgefleet, ahead of the installed one
        sys.path.insert(0, code_root)
    if not verbose:  # Lightning's notes at every Trainer; failures come back through ``results``
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    try:
        import torch

        torch.set_num_threads(1)
        quiet_lightning()
        from edgefleet.agent.worker import run_job
        from edgefleet.agent.worker_events import EventWriter
        from edgefleet.protocol.jobs import TrainCommand

        class StepClock(EventWriter):
            """The worker's events, and the process's CPU time at every step's progress call."""

            def __init__(self) -> None:
                super().__init__(open(os.devnull, "w"))
                self.cpu_ns: list[int] = []
                self.wall_ns: list[int] = []

            def progress(self, step: int, loss: float | None, compute_s: float) -> None:
                self.cpu_ns.append(time.process_time_ns())
                self.wall_ns.append(time.perf_counter_ns())
                super().progress(step, loss, compute_s)

        results.put(("ready", os.getpid()))
        marks: Marks | None = None
        for job_dict, breakdown, profile_to in iter(jobs.get, None):
            if breakdown and marks is None:
                marks = Marks()
                install_marks(marks)
            if marks is not None:
                marks.steps.clear()
            clock = StepClock()
            job = TrainCommand.from_dict(job_dict)
            if profile_to:
                import cProfile

                with cProfile.Profile() as profile:
                    code = run_job(job, clock)
                profile.dump_stats(profile_to)
            else:
                code = run_job(job, clock)
            if code != 0:
                raise BenchError(f"run_job returned {code}")
            results.put(("job", {"cpu_ns": clock.cpu_ns, "wall_ns": clock.wall_ns,
                                 "segments": list(marks.steps) if breakdown and marks is not None else []}))
    except BaseException as exc:  # reported to the parent, which fails the run with it
        results.put(("error", f"board: {type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------------------- the coordinator's side

@dataclass
class JobResult:
    """One job's measurements: per-step CPU and wall seconds, and the marked segments (breakdown passes)."""

    model: str
    quota: float
    n: int
    cpu_s: list[float]
    wall_s: list[float]
    segments: list[dict[str, int]]
    throttled: int = 0  # CFS periods the board was throttled in during the job
    code: str = "this tree"  # which edgefleet the board ran: "this tree" or "baseline"


class Board:
    """The board process and its cgroup (none when unconstrained)."""

    def __init__(self, quota: float, timeout_s: float, verbose: bool, *, code: str = "this tree", code_root: str = "") -> None:
        self.timeout_s, self.code = timeout_s, code
        ctx = mp.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=board_main, args=(self.jobs, self.results, verbose, code_root), daemon=True,
                                   name="efb-fixed-board")
        self.group: Any = None
        self.process.start()
        _, pid = self.get("ready")
        if quota > 0:
            from edgefleet.lab.cgroups import Cgroup

            self.group = Cgroup(f"efb-fixedcost-{os.getpid()}-{pid}")
            self.group.create()
            self.group.set_cpu_quota(quota, CFS_PERIOD_US)
            self.group.add(pid)

    def get(self, kind: str) -> tuple[str, Any]:
        return kind, next_message(self.results, self.process, kind, self.timeout_s, BenchError)

    def check(self) -> None:
        """Raise the board's error if it reported one (without waiting)."""
        try:
            got = self.results.get_nowait()
        except queue.Empty:  # only that: a signal's BenchError raised in get() must stop the run
            if not self.process.is_alive():
                raise BenchError(f"the board process ended (exit code {self.process.exitcode})") from None
            return
        raise BenchError(got[1] if got[0] == "error" else f"unexpected {got[0]!r} from the board")

    def throttled(self) -> int:
        return self.group.throttled()[0] if self.group is not None else 0

    def close(self) -> None:
        try:
            self.jobs.put(None)
            self.process.join(5)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(3)
            if self.group is not None:
                self.group.remove()


async def run_one_job(board: Board, model_name: str, n: int, args: argparse.Namespace, breakdown: bool,
                      profile_to: str = "") -> tuple[Any, int]:
    """Serve one job of ``n`` samples a step to the board; its result message and the periods it was throttled in."""
    import torch

    from edgefleet.coordinator.exchange.server import ExchangeError, ExchangeServer
    from edgefleet.protocol.codec import encode_value
    from edgefleet.protocol.jobs import TrainCommand
    from edgefleet.workloads.params import exchange_size, single_optimizer, to_numpy_tree
    from edgefleet.workloads.registry import build_dataset, build_model

    torch.manual_seed(SEED)
    model = build_model(model_name, {}, data=build_dataset(DATASET, "train", {}))
    optimizer = single_optimizer(model.configure_optimizers())  # the built-ins return one optimizer
    total = args.warmup + args.steps
    token = secrets.token_hex(16)
    job_id = f"fixed-{model_name}-{n}-{secrets.token_hex(3)}"
    server = ExchangeServer(job_id=job_id, token=token, boards=[(BOARD_ID, n)],
                            param_count=exchange_size(optimizer, model), wire_dtype="float32",
                            welcome_state=lambda: (0, encode_value(to_numpy_tree(model.state_dict())),
                                                   encode_value(to_numpy_tree(optimizer.state_dict()))))
    port = await server.start("127.0.0.1", 0)
    job = TrainCommand(job_id=job_id, board_id=BOARD_ID, exchange_host="127.0.0.1", exchange_port=port, token=token,
                       model=model_name, dataset=DATASET, board_index=0, batch_sizes=[n], seed=SEED,
                       total_steps=total, threads=1)
    throttled = board.throttled()
    try:
        board.jobs.put((job.to_dict(), breakdown, profile_to))
        waiter = asyncio.ensure_future(server.wait_for_boards(args.timeout, need={BOARD_ID}))
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.2)
            if not waiter.done():
                board.check()
        waiter.result()
        for step in range(total):
            server.finished = step == total - 1  # the board closes its connection after the last step
            result = await server.run_step(step, apply=lambda avg, result: None, minimum_deadline_s=args.timeout)
            if BOARD_ID not in result.contributors:
                raise BenchError(f"step {step}: the board did not contribute (late {result.late}, refused {result.refused})")
        got = await asyncio.get_running_loop().run_in_executor(None, board.get, "job")
    except ExchangeError as exc:
        board.check()
        raise BenchError(str(exc)) from None
    finally:
        await server.close()
    return got[1], board.throttled() - throttled


def measure(args: argparse.Namespace) -> list[JobResult]:
    """Every model at every quota: the fit passes over the batch sizes, then the breakdown passes."""
    results: list[JobResult] = []
    for model_name in args.models:
        for quota in args.quotas:
            boards: list[Board] = []
            try:
                boards.append(Board(quota, args.timeout, args.verbose))
                if args.baseline:
                    boards.append(Board(quota, args.timeout, args.verbose, code="baseline", code_root=args.baseline))
                plan = [(n, False) for _ in range(args.passes) for n in args.batches]
                plan += [(n, True) for n in args.batches] if args.breakdown else []
                for n, breakdown in plan:
                    for board in boards:  # in turn: an A/B comparison on the same host
                        got, throttled = asyncio.run(run_one_job(board, model_name, n, args, breakdown))
                        cpu, wall = step_cpu(got["cpu_ns"], args.warmup), step_cpu(got["wall_ns"], args.warmup)
                        segments = got["segments"][args.warmup:]
                        results.append(JobResult(model_name, quota, n, cpu, wall, segments, throttled, board.code))
                        what = "breakdown" if breakdown else "fit"
                        print(f"{board.code}: {model_name} quota {quota or 'none'} n={n} ({what}): CPU "
                              f"{1e3 * statistics.median(cpu):.2f} ms, wall {1e3 * statistics.median(wall):.2f} ms a step",
                              file=sys.stderr, flush=True)
                board = boards[0]
                for n in args.batches if args.profile else ():
                    path = os.path.join(args.profile, f"{model_name}-{quota_text(quota).replace(' ', '')}-n{n}.prof")
                    asyncio.run(run_one_job(board, model_name, n, args, False, os.path.abspath(path)))
                    print(f"profile of {model_name} n={n} at {quota_text(quota)}: {path}", file=sys.stderr, flush=True)
            finally:
                for board in boards:
                    board.close()
    return results


# ----------------------------------------------------------------------------- report

def quota_text(quota: float) -> str:
    return f"{quota:g} core" if quota > 0 else "unconstrained"


def fit_rows(results: list[JobResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model, quota and code: the medians at each n (ms) and the fitted a and b, for the table and --json."""
    rows = []
    codes = ["this tree", "baseline"] if args.baseline else ["this tree"]
    for model_name in args.models:
        for quota in args.quotas:
            for code in codes:
                mine = [r for r in results if (r.model, r.quota, r.code) == (model_name, quota, code) and not r.segments]
                if not mine:
                    continue
                cpu = [1e3 * statistics.median([s for r in mine if r.n == n for s in r.cpu_s]) for n in args.batches]
                wall = [1e3 * statistics.median([s for r in mine if r.n == n for s in r.wall_s]) for n in args.batches]
                a, b = fit_line(args.batches, cpu)
                wall_a, wall_b = fit_line(args.batches, wall)
                periods = sum(len(r.cpu_s) + args.warmup for r in mine)
                rows.append({"model": model_name, "quota": quota, "code": code, "batches": args.batches, "cpu_ms": cpu,
                             "wall_ms": wall, "a_ms": a, "b_ms": b, "wall_a_ms": wall_a, "wall_b_ms": wall_b,
                             "throttled_per_step": sum(r.throttled for r in mine) / max(1, periods),
                             "steps": sum(len(r.cpu_s) for r in mine)})
    return rows


def breakdown_rows(results: list[JobResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model, quota and code: each segment's median at each n (ms) and its fitted a and b."""
    rows = []
    for model_name in args.models:
        for quota in args.quotas:
            for code in ["this tree", "baseline"] if args.baseline else ["this tree"]:
                mine = {r.n: segment_medians(r.segments) for r in results
                        if (r.model, r.quota, r.code) == (model_name, quota, code) and r.segments}
                if len(mine) < 2:
                    continue
                ns = sorted(mine)
                segments = {}
                for name in SEGMENTS:
                    ms = [1e3 * mine[n][name] for n in ns]
                    a, b = fit_line(ns, ms)
                    segments[name] = {"ms": ms, "a_ms": a, "b_ms": b}
                rows.append({"model": model_name, "quota": quota, "code": code, "batches": ns, "segments": segments})
    return rows


def report(fits: list[dict[str, Any]], breakdowns: list[dict[str, Any]], args: argparse.Namespace) -> None:
    batches = "/".join(str(n) for n in args.batches)
    print_table(f"A board's step at n = {batches} samples: CPU = a + b*n (least squares over the medians), "
                f"torch threads 1, {os.cpu_count()} CPUs on the host",
                ["model", "board CPU", "code", "CPU ms / step", "a, ms", "b, ms / sample", "wall ms / step",
                 "wall a, ms", "wall b", "throttled / step", "steps"],
                [(f["model"], quota_text(f["quota"]), f["code"], " / ".join(f"{v:.2f}" for v in f["cpu_ms"]),
                  f"{f['a_ms']:.2f}", f"{f['b_ms']:.3f}", " / ".join(f"{v:.1f}" for v in f["wall_ms"]),
                  f"{f['wall_a_ms']:.1f}", f"{f['wall_b_ms']:.2f}",
                  f"{f['throttled_per_step']:.1f}" if f["quota"] > 0 else "", str(f["steps"])) for f in fits],
                caption=("CPU: the board process's CPU time from one step's GradientExchange progress call to the next "
                         "(agent.worker.run_job unchanged; the exchange server on 127.0.0.1, one board). Quotas in "
                         f"{CFS_PERIOD_US // 1000} ms CFS periods (cgroup v1). " + args.host_note))
    for row in breakdowns:
        segments = row["segments"]
        lines = [(label, *(f"{v:.3f}" for v in segments[name]["ms"]), f"{segments[name]['a_ms']:.3f}",
                  f"{segments[name]['b_ms']:.4f}") for name, label in SEGMENTS.items()]
        sums = [sum(segments[name]["ms"][i] for name in SEGMENTS) for i in range(len(row["batches"]))]
        a, b = fit_line(row["batches"], sums)
        lines.append(("sum of the medians", *(f"{v:.3f}" for v in sums), f"{a:.3f}", f"{b:.4f}"))
        print_table(f"Where a step's CPU goes: {row['model']}, {quota_text(row['quota'])}, {row['code']} (thread CPU ms, "
                    f"medians of {args.steps} steps; a + b*n per segment)",
                    ["segment", *(f"n={n}" for n in row["batches"]), "a, ms", "b, ms / sample"], lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A board's CPU per training step (agent.worker.run_job against a real exchange server on "
                    "127.0.0.1) at small batches, under a cgroup CPU quota and unconstrained: the fixed cost a and "
                    "the cost per sample b of CPU = a + b*n, and where a goes (--breakdown).",
        epilog="Run as root (cgroup v1 quotas). Exit code 0 if the run completed, 2 if it could not be made.")
    parser.add_argument("--models", default="resnet_small,lenet5", help="comma-separated (default resnet_small,lenet5)")
    parser.add_argument("--batches", default="1,4,8,16", help="samples a step, comma-separated (default 1,4,8,16)")
    parser.add_argument("--quotas", default="0.12,0",
                        help="the board's CPU quotas in cores, 0 = unconstrained, comma-separated (default 0.12,0)")
    parser.add_argument("--steps", type=int, default=60, metavar="K", help="timed steps per job (default 60)")
    parser.add_argument("--warmup", type=int, default=10, metavar="W", help="untimed steps first (default 10)")
    parser.add_argument("--passes", type=int, default=1, metavar="P", help="jobs per batch size for the fit (default 1)")
    parser.add_argument("--breakdown", action="store_true", help="also mark where each step's CPU goes (one more job per n)")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="also run one job per n under cProfile and write its stats to DIR (python -m pstats)")
    parser.add_argument("--baseline", default="", metavar="DIR",
                        help="also run each job on a board importing edgefleet from DIR (a checkout of the code "
                             "to compare with), in turn with this tree's")
    parser.add_argument("--json", default="", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--verbose", action="store_true", help="keep the board's stderr (Lightning's notes)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="bound on the board joining, each step and each job's report (default 300 s)")
    parser.add_argument("--max-seconds", type=float, default=1800.0, metavar="S",
                        help="bound on the whole run; cleans up and exits 2 past it (default 1800)")
    args = parser.parse_args(argv)
    try:
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        args.batches = sorted({int(n) for n in args.batches.split(",")})
        args.quotas = [float(q) for q in args.quotas.split(",")]
    except ValueError as exc:
        parser.error(f"--batches and --quotas take comma-separated numbers ({exc})")
    if len(args.batches) < 2 or min(args.batches) < 1:
        parser.error("--batches needs at least two distinct sizes, each at least 1")
    if any(q < 0 or q > os.cpu_count() for q in args.quotas) or any(0 < q < 0.1 for q in args.quotas):
        parser.error("--quotas must be 0 (unconstrained) or between 0.1 and the host's CPUs (1 ms per 10 ms period at least)")
    if args.steps < 5 or args.warmup < 2 or args.passes < 1:
        parser.error("--steps must be >= 5, --warmup >= 2 and --passes >= 1")
    if any(q > 0 for q in args.quotas) and os.geteuid() != 0:
        parser.error("a CPU quota needs root (cgroup v1); run as root or with --quotas 0")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.baseline:
        if not os.path.isfile(os.path.join(args.baseline, "edgefleet", "__init__.py")):
            parser.error(f"--baseline {args.baseline}: no edgefleet/__init__.py there; give the root of a checkout")
        args.baseline = os.path.abspath(args.baseline)
    args.host_note = ""
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_signal(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signum}" if signum != signal.SIGALRM
                         else f"the run exceeded --max-seconds {args.max_seconds:.0f}")

    for sig in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, args.max_seconds)
    import psutil

    quiet_lightning()
    logging.getLogger("edgefleet").setLevel(logging.WARNING)
    try:
        t0, own0 = psutil.cpu_times(), os.times()
        results = measure(args)
        t1, own1 = psutil.cpu_times(), os.times()
        args.host_note = host_note(t0, t1, sum(own1[:4]) - sum(own0[:4]))
    except BenchError as exc:
        print(f"step_fixed_costs: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("step_fixed_costs: interrupted", file=sys.stderr)
        return 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    fits, breakdowns = fit_rows(results, args), breakdown_rows(results, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"host": args.host_note, "steps": args.steps, "warmup": args.warmup, "fits": fits,
                       "breakdowns": breakdowns}, handle, indent=1)
    report(fits, breakdowns, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
