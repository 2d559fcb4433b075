"""Pipeline stages against data-parallel on the lab, side by side in one run, and a pipeline that loses a board.

Issue 35's targets, on the emulated lab's ``fleet8`` (lab/fleets/fleet8.toml), through the real
``edge-coordinator train`` (signed commands, the TLS exchange, real agents in their namespaces and
cgroups, the boards' own keys for the stage links: ``Lab.board_keys_dir`` is ``--board-keys``):

1. **Speed, where links bind.** conv_mlp (``bench/scaling.py``'s workload: two small convolutions,
   then a 535,562-parameter dense head after ``net.6``: a 2.1 MB gradient each way in data-parallel,
   2 KiB a sample at the cut), global batch 128, digits, to 94% validation accuracy (at most 8
   epochs; the run stops after the first epoch that reaches it), trained

   * data-parallel (scaling's ``exact`` mode and lab driver) on the best single board (x86-1, the
     whole batch) and on the ``--dp-boards`` fastest boards (default 1 and 2: x86-1 + pi5-2),
     their batches scaling's planned split (the planner's allocation from a profile of the boards
     taken in the same run; ``--split quota``: in proportion to the CPU quotas, no profile);
   * as a pipeline: stage 0 a group of boards holding the convolutions (``--stage0``, default
     ``pi5-1+pi5-2``), the dense head on the strongest board (``net.6@x86-1``), with ``--micro-batches``
     M (default 1 and 2), stage 0's batches the planned split of layer placement at ``net.6`` (the
     head's boards send activations; ``--split quota``: by quota), in each mode of ``--modes``:
     ``piped`` (train's defaults: each later stage's gradient to the coordinator every step) and
     ``piped-sync-checkpoint`` (``--stage-sync checkpoint``: a later stage sends its state only at
     checkpoints and epoch ends), left out with a note when this train lacks the flag. Extra train
     flags for every pipelined run: ``--train-flag=--FLAG`` (repeated; ``=`` because they start with
     dashes), e.g. ``--train-flag=--checkpoint-every --train-flag=20``.

   * the planner's own plan (``--planned``, default on): ``edge-coordinator plan --pipeline --objective time
     --verify K`` (``--verify``, default 3: the K best plans by the model pre-trained, the fastest chosen; as
     ``bench/pipeline_picks.py`` asks it) over ``--plan-boards`` (default all eight) from the same run's profile of
     them, trained with the train flags it gives (the ``planned`` row; a data-parallel plan is a data-parallel row).

   Figures per run (scaling's definitions, ``bench/scaling_figures.py``): samples/s (training rate
   after 3 warm-up steps, validations left out), the median step period, time to 94% (the
   coordinator's ``elapsed_s`` at the first epoch reaching it), and the bytes each taking-part
   board's link carried per step, both ways, counted on the wire (its veth's counters on the host
   side: TCP/TLS framing, the gradient exchange, the stage links' activations and gradients, and
   MQTT telemetry, between the first poll after the warm-up and the last poll, over the steps
   between them). The ratio is each pipeline's samples/s over the best data-parallel run's
   (issue 35's target: at least 2x); its time to target against the best's too.
2. **Recovery.** A pipelined run of conv_mlp (``--recovery-pipeline``, default
   ``pi5-1+pi5-2,net.2@pi4-3,net.6@x86-1``, M = 2, 64 + 64 samples, ``--recovery-steps`` 24 steps,
   a checkpoint every 4) in each mode of ``--modes``: after ``--kill-after`` (8) steps the agent of
   ``--victim`` (default pi4-3, the middle stage) is killed with SIGKILL as
   tests/pipeline/test_pipelined_training.py does: the lab's supervisor starts each agent as the
   process it holds (``sh`` joins the cgroups, then ``exec nsenter ... exec python``), does not
   restart it, and the agent's training worker ends with it; the broker publishes the agent's
   last will at once (the connection closes with the process). Reported from the run: result.json's
   ``recovery_s`` (from the loss to the first step of the new plan; target <= 30 s) and
   ``pipeline`` (the re-planned one), whether metrics.jsonl's steps are 0 .. N-1, each once, and
   which steps were trained twice (applied, then rolled back to the last checkpoint, as
   ``--stage-sync checkpoint`` does: the record keeps them once, so the coordinator's notes
   "stopping after step N" and "re-planning from step K" say which).

3. **Revision around a slowed board.** The recovery pipeline in ``--stage-sync checkpoint`` (M = 2,
   ``--slowdown-steps`` 96 steps, state every 4): once its watch has its reference (16 steps), the
   victim's CPU quota is cut to ``--slowdown-factor`` (a fifth) of the fleet file's, as a Pi
   throttling under heat. Reported: the step the coordinator revised at and its new pipeline, result.json's
   ``revision_s`` (the old plan's last step to the new one's first), the median step period before the
   cut, between the cut and the revision, and after it, and whether every step ran once. The quota is
   put back after the run.

Boards that take no part in a run spin at their quotas meanwhile (scaling's ballast), so a board
never runs alone on an idle host. The host's steal and other processes' share of the CPU are
printed per run; no retakes. The figures come as a table last (``bench/_table.py``); ``--json OUT``
writes them all.

Run as root from the repository root (about 6-8 min on a 2-core machine)::

    python bench/pipeline.py                                  # everything above
    python bench/pipeline.py --modes piped piped-sync-checkpoint --micro-batches 1 2 4
    python bench/pipeline.py --no-recovery --split quota      # speed only, no profile
    python bench/pipeline.py --no-speed --victim x86-1        # recovery only, the last stage killed
    python bench/pipeline.py --no-speed --no-recovery         # the revision around a slowed board only

Exit status: 0 when every run was made (whatever its figures), 2 when one or more could not be
(the lab, a run, ``--max-minutes``), 130 when interrupted; the lab comes down on every exit path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import scaling  # bench/ is the script's folder, first on sys.path
from _harness import (
    ballast,
    in_coordinator_netns,
    log_tail,
    sigterm_as_ctrl_c,
    stop_job,
    train_command,
    wait_ready,
    write_fleet_key,
)
from _table import print_table
from scaling_figures import fastest_boards, planned_split, split_batch

from edgefleet.coordinator.planning.pipeline_verify import DEFAULT_VERIFY_ROUNDS

if TYPE_CHECKING:
    from edgefleet.coordinator.planning import FleetProfile
    from edgefleet.lab.lab import Lab

log = logging.getLogger("bench.pipeline")

FLEET = "fleet8"
MODEL = "conv_mlp"
CUT = "net.6"             # conv_mlp's flatten: the dense head after it
TAIL_BOARD = "x86-1"      # the strongest board takes the head
DEFAULT_STAGE0 = ("pi5-1+pi5-2",)
DEFAULT_DP_BOARDS = (1, 2)
DEFAULT_MICRO_BATCHES = (1, 2)
PIPED_MODES: dict[str, tuple[str, ...]] = {  # mode -> its own train flags (before --train-flag's)
    "piped": (), "piped-sync-checkpoint": ("--stage-sync", "checkpoint")}
VERIFY = 3                # plan --pipeline --verify K for the planner's own plan
RECOVERY_PIPELINE = "pi5-1+pi5-2,net.2@pi4-3,net.6@x86-1"
RECOVERY_VICTIM = "pi4-3"
RECOVERY_BATCH = "64,64"
RECOVERY_MICRO_BATCHES = 2
RECOVERY_STEPS = 24
RECOVERY_CHECKPOINT_EVERY = 4
KILL_AFTER = 8
RECOVERY_TARGET_S = 30.0
SPEED_TARGET_X = 2.0
RUN_TIMEOUT_S = 360.0     # one recovery run, boards joining twice included
SLOWDOWN_STEPS = 96
SLOWDOWN_AFTER = 16       # the watch's reference: the 10 steps after the plan's first 3, and a few more
SLOWDOWN_FACTOR = 0.2


@dataclass(frozen=True)
class PipedConfig:
    """One pipelined speed run: stage 0's group and batches, the later stages (the head on the tail board, or the
    planner's ``shape``), M and the mode."""

    mode: str
    stage0: tuple[str, ...]
    batch_sizes: tuple[int, ...]  # stage 0's boards'
    micro_batches: int
    split: str
    shape: str = ""               # the whole --pipeline (the planner's); "": stage 0, then the head on the tail board
    flags: tuple[str, ...] = ()   # train flags of its own (the planner's), after its mode's

    @property
    def pipeline(self) -> str:
        return self.shape or f"{'+'.join(self.stage0)},{CUT}@{TAIL_BOARD}"

    @property
    def boards(self) -> tuple[str, ...]:
        return tuple(_pipeline_boards(self.pipeline))

    @property
    def label(self) -> str:
        return f"{FLEET} {MODEL} {self.mode} {self.pipeline} M={self.micro_batches}"


@dataclass
class SpeedRow:
    """One speed run's figures, data-parallel or pipelined."""

    kind: str                     # "data-parallel" or a piped mode
    boards: str                   # "x86-1+pi5-2", or the pipeline
    batch_sizes: list[int]
    micro_batches: int | None
    samples_per_s: float | None
    median_step_ms: float | None
    time_to_target_s: float | None
    target_epoch: int | None
    final_val_accuracy: float | None
    wire_kib_per_step_board: float | None   # mean over the taking-part boards, both ways
    wire_kib_per_step_max: float | None     # the busiest board's
    wire_kib_per_step: dict[str, float]
    exchange_kib_per_step_board: float | None  # the coordinator's exchange bytes alone (result.json), welcomes included
    steps: int
    stolen: float
    others_share: float
    ratio_rate: float | None = None          # samples/s over the best data-parallel run's
    ratio_target: float | None = None        # the best data-parallel run's time to target over this one's


@dataclass
class RecoveryRow:
    """One recovery run's figures."""

    mode: str
    pipeline: str
    victim: str
    killed_after_step: int | None
    exit_status: int
    recovery_s: float | None
    replanned: str | None
    steps_expected: int
    steps_seen: int
    exactly_once: bool            # the record has 0 .. N-1 once each and no step was trained again
    missing: list[int] = field(default_factory=list)
    repeated: list[int] = field(default_factory=list)
    trained_again: list[int] = field(default_factory=list)  # applied, then rolled back and trained again (coordinator's log)
    note: str = ""


# ----------------------------------------------------------------------------- the wire

def _link_counters(lab: Lab, boards: Sequence[str]) -> dict[str, int]:
    """Bytes each board's link carried so far, both ways (its veth's host end: rx = the board's upload)."""
    out = {}
    for board in boards:
        stats = Path("/sys/class/net") / lab.boards[board].host_if / "statistics"
        out[board] = int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())
    return out


@dataclass
class StepCpuAndWire(scaling.StepCpu):
    """Scaling's CPU per step, plus each board's link bytes over the same polls (``scaling._drive`` calls ``note``)."""

    lab: Lab | None = None
    wire_first: tuple[int, dict[str, int]] | None = None
    wire_last: tuple[int, dict[str, int]] | None = None

    def note(self, pid: int, steps: int) -> None:
        super().note(pid, steps)
        if steps < scaling.WARMUP_STEPS or self.lab is None:
            return
        try:
            mark = (steps, _link_counters(self.lab, list(self.boards)))
        except (OSError, ValueError):
            return
        if self.wire_first is None:
            self.wire_first = mark
        self.wire_last = mark

    def wire_kib_per_step(self) -> dict[str, float]:
        if self.wire_first is None or self.wire_last is None or self.wire_last[0] <= self.wire_first[0]:
            return {}
        (s0, a), (s1, b) = self.wire_first, self.wire_last
        return {board: (b[board] - a[board]) / (s1 - s0) / 1024 for board in a}


# ----------------------------------------------------------------------------- speed runs

def _speed_row(kind: str, boards: str, batches: Sequence[int], micro_batches: int | None,
               figures: scaling.RunFigures, cpu: StepCpuAndWire) -> SpeedRow:
    wire = cpu.wire_kib_per_step()
    return SpeedRow(kind=kind, boards=boards, batch_sizes=list(batches), micro_batches=micro_batches,
                    samples_per_s=figures.samples_per_s,
                    median_step_ms=figures.median_period_s * 1e3 if figures.median_period_s else None,
                    time_to_target_s=figures.time_to_target_s, target_epoch=figures.target_epoch,
                    final_val_accuracy=figures.final_val_accuracy,
                    wire_kib_per_step_board=statistics.fmean(wire.values()) if wire else None,
                    wire_kib_per_step_max=max(wire.values()) if wire else None, wire_kib_per_step=wire,
                    exchange_kib_per_step_board=figures.kb_per_step_board, steps=figures.steps,
                    stolen=figures.stolen, others_share=figures.others_share)


def _run(ctx: scaling.FleetContext, cfg: scaling.Config, cmd: list[str], run_dir: Path) -> tuple[scaling.RunFigures, StepCpuAndWire]:
    """One job to its end or its target, through scaling's driver, the idle boards spinning (ballast).

    Raises:
        RuntimeError: train failed (the log's tail in the message); scaling.OutOfTime past the deadline.
    """
    workload = scaling.WORKLOADS[MODEL]
    wait_ready(ctx.lab, cfg.boards)
    idle = [b for b in ctx.ballast_info if b not in cfg.boards] if ctx.ballast else []
    cpu = StepCpuAndWire({b: ctx.board_cpuacct[b] for b in cfg.boards}, lab=ctx.lab)
    log_path = run_dir.with_suffix(".log")
    with ballast(ctx.ballast_info, idle):
        load = scaling.HostLoad(ctx.cpuacct_files)
        started = time.monotonic()
        status, stopped = scaling._drive(cmd, run_dir, log_path, workload, cfg.label, ctx.deadline, cpu)
        wall = time.monotonic() - started
        host = load.finish()
    if not (status == 0 or (stopped and status == 130)) or not (run_dir / "metrics.jsonl").exists():
        raise RuntimeError(f"{cfg.label}: train exited with {status}:\n{log_tail(log_path)}")
    return scaling._figures(cfg, workload, run_dir, wall, stopped, host, cpu), cpu


def _dp_run(ctx: scaling.FleetContext, cfg: scaling.Config) -> SpeedRow:
    run_dir = ctx.runs_dir / f"dp-{len(cfg.boards)}"
    cmd = scaling._train_command(ctx.lab, ctx.key_file, cfg, scaling.WORKLOADS[MODEL], run_dir)
    figures, cpu = _run(ctx, cfg, cmd, run_dir)
    return _speed_row("data-parallel", "+".join(cfg.boards), cfg.batch_sizes, None, figures, cpu)


def _piped_run(ctx: scaling.FleetContext, cfg: PipedConfig, extra: Sequence[str], quotas: dict[str, float]) -> SpeedRow:
    workload = scaling.WORKLOADS[MODEL]
    boards = cfg.boards
    run_dir = ctx.runs_dir / f"{cfg.mode}-{'+'.join(cfg.stage0)}-m{cfg.micro_batches}"
    cmd = in_coordinator_netns(ctx.lab, train_command(
        ctx.lab, ctx.key_file, boards, cfg.batch_sizes, "--model", MODEL, "--dataset", workload.dataset,
        "--epochs", str(workload.max_epochs), "--target-accuracy", str(workload.target), "--seed", "0",
        "--no-rebalance", "--run-dir", str(run_dir), "--pipeline", cfg.pipeline,
        "--micro-batches", str(cfg.micro_batches), *PIPED_MODES.get(cfg.mode, ()), *cfg.flags, *extra,
        board_keys=True))
    later = (0,) * (len(boards) - len(cfg.stage0))
    scfg = scaling.Config(FLEET, MODEL, cfg.mode, boards, (*cfg.batch_sizes, *later), tuple(quotas[b] for b in boards),
                          cfg.split)
    figures, cpu = _run(ctx, scfg, cmd, run_dir)
    return _speed_row(cfg.mode, cfg.pipeline, cfg.batch_sizes, cfg.micro_batches, figures, cpu)


def with_ratios(rows: list[SpeedRow]) -> list[SpeedRow]:
    """Each row's samples/s over the best data-parallel run's, and that run's time to target over its own."""
    dp = [r for r in rows if r.kind == "data-parallel" and r.samples_per_s]
    if not dp:
        return rows
    best = max(dp, key=lambda r: r.samples_per_s or 0.0)
    for r in rows:
        r.ratio_rate = r.samples_per_s / best.samples_per_s if r.samples_per_s and best.samples_per_s else None
        r.ratio_target = (best.time_to_target_s / r.time_to_target_s
                          if best.time_to_target_s and r.time_to_target_s else None)
    return rows


# ----------------------------------------------------------------------------- recovery

def metric_steps(path: Path) -> list[int]:
    """The step numbers of a run's metrics.jsonl as it is now, whole lines only.

    Read whole each time rather than tailed: a rollback (``--stage-sync checkpoint``) rewrites the
    file shorter (``MetricsLog.truncate_after``), which an offset-keeping reader would misread."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    steps = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the line being written
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return steps


def trained_again(output: str) -> list[int]:
    """Steps the coordinator applied, then stopped after, and re-planned from again (its notes "stopping after step
    N" and "re-planning from step K": K .. N were trained twice; none when K = N + 1)."""
    stopped = re.findall(r"stopping after step (\d+)", output)
    replanned = re.findall(r"re-planning from step (\d+)", output)
    again: list[int] = []
    for last, first in zip(stopped, replanned):
        again += range(int(first), int(last) + 1)
    return again


def steps_once(steps: Sequence[int], expected: int) -> tuple[list[int], list[int]]:
    """The steps of 0 .. expected-1 that are missing and those seen more than once."""
    seen: dict[int, int] = {}
    for s in steps:
        seen[s] = seen.get(s, 0) + 1
    return [s for s in range(expected) if s not in seen], sorted(s for s, n in seen.items() if n > 1)


def _drive_acting(ctx: scaling.FleetContext, cmd: list[str], boards: Sequence[str], run_dir: Path, after: int,
                  act: Callable[[], object], label: str) -> tuple[int, int | None]:
    """Run ``cmd`` to its end (the idle boards spinning), calling ``act`` once ``after`` steps are done: the exit
    status and the last step done when it acted (None: the run ended first).

    Raises:
        scaling.OutOfTime: not done in :data:`RUN_TIMEOUT_S` (or by ``--max-minutes``); the job is stopped.
    """
    wait_ready(ctx.lab, list(boards))
    idle = [b for b in ctx.ballast_info if b not in boards] if ctx.ballast else []
    metrics = run_dir / "metrics.jsonl"
    acted_after: int | None = None
    deadline = min(ctx.deadline, time.monotonic() + RUN_TIMEOUT_S)
    with ballast(ctx.ballast_info, idle), run_dir.with_suffix(".log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ctx.runs_dir)
        try:
            while proc.poll() is None:
                done = metric_steps(metrics)
                if acted_after is None and len(done) >= after:
                    acted_after = done[-1]
                    act()
                if time.monotonic() > deadline:
                    stop_job(proc)
                    raise scaling.OutOfTime(f"{label}: not done in {RUN_TIMEOUT_S:.0f} s (or --max-minutes)")
                time.sleep(scaling.POLL_S)
        finally:
            if proc.poll() is None:
                stop_job(proc)
    return proc.wait(), acted_after


def _recovery_run(ctx: scaling.FleetContext, mode: str, pipeline: str, victim: str, extra: Sequence[str],
                  kill_after: int, steps: int) -> RecoveryRow:
    """A pipelined run whose ``victim`` agent is killed after ``kill_after`` steps; what result.json says after."""
    boards = _pipeline_boards(pipeline)
    run_dir = ctx.runs_dir / f"recovery-{mode}"
    cmd = in_coordinator_netns(ctx.lab, train_command(
        ctx.lab, ctx.key_file, boards, [int(b) for b in RECOVERY_BATCH.split(",")], "--model", MODEL,
        "--dataset", "digits", "--steps", str(steps), "--checkpoint-every", str(RECOVERY_CHECKPOINT_EVERY),
        "--seed", "0", "--run-dir", str(run_dir), "--pipeline", pipeline,
        "--micro-batches", str(RECOVERY_MICRO_BATCHES), *PIPED_MODES[mode], *extra, board_keys=True))
    log_path = run_dir.with_suffix(".log")
    metrics = run_dir / "metrics.jsonl"

    def kill() -> None:
        os.kill(ctx.lab.agent(victim).pid, signal.SIGKILL)  # its worker ends with it
        print(f"    killed {victim}'s agent", file=sys.stderr, flush=True)

    status, killed_after = _drive_acting(ctx, cmd, boards, run_dir, kill_after, kill, f"recovery {mode}")
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    seen = metric_steps(metrics)
    missing, repeated = steps_once(seen, steps)
    again = trained_again(log_path.read_text(errors="replace"))
    note = "" if status == 0 else f"train exited with {status}: {log_tail(log_path, 3)}"
    if killed_after is None:
        note = note or f"the run ended before {kill_after} steps: nothing was killed"
    return RecoveryRow(mode=mode, pipeline=pipeline, victim=victim, killed_after_step=killed_after, exit_status=status,
                       recovery_s=result.get("recovery_s"), replanned=result.get("pipeline"), steps_expected=steps,
                       steps_seen=len(seen), exactly_once=not (missing or repeated or again) and len(seen) == steps,
                       missing=missing, repeated=repeated, trained_again=again, note=note)


@dataclass
class SlowdownRow:
    """One slowdown run's figures."""

    pipeline: str
    victim: str
    quota: float
    cut_after_step: int | None
    exit_status: int
    revised_at: int | None        # the step after which the coordinator revised (its note "revising from step N")
    revised_to: str | None
    revision_s: float | None
    before_ms: float | None       # median step period before the cut, after the cut until the revision, after it
    during_ms: float | None
    after_ms: float | None
    exactly_once: bool
    note: str = ""


def _periods_ms(metrics: Path, first: int, last: int) -> float | None:
    """The median of steps first..last's periods (elapsed_s since the step before), in ms."""
    elapsed = {}
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            elapsed[record["step"]] = record["elapsed_s"]
    periods = [elapsed[k] - elapsed[k - 1] for k in range(max(first, 1), last + 1) if k in elapsed and k - 1 in elapsed]
    return statistics.median(periods) * 1e3 if periods else None


def _slowdown_run(ctx: scaling.FleetContext, pipeline: str, victim: str, factor: float, steps: int,
                  extra: Sequence[str]) -> SlowdownRow:
    """A pipelined run whose ``victim`` loses most of its CPU after :data:`SLOWDOWN_AFTER` steps (module doc, 3)."""
    boards = _pipeline_boards(pipeline)
    run_dir = ctx.runs_dir / "slowdown"
    cmd = in_coordinator_netns(ctx.lab, train_command(
        ctx.lab, ctx.key_file, boards, [int(b) for b in RECOVERY_BATCH.split(",")], "--model", MODEL,
        "--dataset", "digits", "--steps", str(steps), "--checkpoint-every", str(RECOVERY_CHECKPOINT_EVERY),
        "--seed", "0", "--run-dir", str(run_dir), "--pipeline", pipeline, "--micro-batches",
        str(RECOVERY_MICRO_BATCHES), *PIPED_MODES["piped-sync-checkpoint"], *extra, board_keys=True))
    log_path = run_dir.with_suffix(".log")
    metrics = run_dir / "metrics.jsonl"
    group = ctx.lab.board(victim).cgroup
    quota = ctx.lab.board(victim).spec.cpu

    def throttle() -> None:
        group.set_cpu_quota(quota * factor)
        print(f"    cut {victim} to {quota * factor:.3f} of a core", file=sys.stderr, flush=True)

    try:
        status, cut_after = _drive_acting(ctx, cmd, boards, run_dir, SLOWDOWN_AFTER, throttle, "slowdown")
    finally:
        group.set_cpu_quota(quota)
    output = log_path.read_text(errors="replace")
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    seen = metric_steps(metrics)
    missing, repeated = steps_once(seen, steps)
    found = re.search(r"revising from step (\d+)", output)
    revised_at = int(found.group(1)) if found else None
    cut = cut_after if cut_after is not None else steps
    before = _periods_ms(metrics, 4, cut)
    during = _periods_ms(metrics, cut + 2, (revised_at if revised_at is not None else steps) - 1)
    after = _periods_ms(metrics, revised_at + 4, steps - 1) if revised_at is not None else None
    note = "" if status == 0 else f"train exited with {status}: {log_tail(log_path, 3)}"
    if revised_at is None:
        kept = re.search(r"step \d+: [^\n]*the pipeline stays as it is", output)
        note = note or (kept.group(0) if kept else "no revision")
    return SlowdownRow(pipeline=pipeline, victim=victim, quota=quota * factor, cut_after_step=cut_after,
                       exit_status=status, revised_at=revised_at, revised_to=result.get("pipeline") if found else None,
                       revision_s=result.get("revision_s"), before_ms=before, during_ms=during, after_ms=after,
                       exactly_once=not (missing or repeated) and len(seen) == steps, note=note)


# ----------------------------------------------------------------------------- the session

@dataclass
class Session:
    """Everything measured, and what went wrong."""

    speed: list[SpeedRow] = field(default_factory=list)
    recovery: list[RecoveryRow] = field(default_factory=list)
    slowdown: list[SlowdownRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    planned: dict[str, object] = field(default_factory=dict)  # the planner's own plan: its label and --verify's record


def _stage_sync_available() -> bool:
    """Whether this train has ``--stage-sync`` (being built: the ``piped-sync-checkpoint`` mode needs it)."""
    from edgefleet.launch import module_command

    done = subprocess.run(module_command("edgefleet.coordinator.cli", "train", "--help"), capture_output=True,
                          text=True, timeout=120, check=False)
    return "--stage-sync" in done.stdout


def _splits(ctx: scaling.FleetContext, args: argparse.Namespace, dp_boards: list[tuple[str, ...]],
            session: Session) -> tuple[dict[tuple[str, ...], tuple[int, ...]], dict[tuple[str, ...], tuple[int, ...]], str]:
    """The data-parallel runs' and stage 0's batches: planned from one profile of every board they use, or by quota."""
    batch = scaling.WORKLOADS[MODEL].global_batch
    stage0s = [tuple(g.split("+")) for g in args.stage0]
    profile: FleetProfile | None = None
    if args.split == "planned" or args.planned:
        boards = list(dict.fromkeys([b for bs in dp_boards if len(bs) > 1 for b in bs] + [b for g in stage0s for b in g]
                                    + (args.plan_boards if args.planned else [])))
        print(f"  profiling {MODEL} on {'+'.join(boards)} for the planned splits", file=sys.stderr, flush=True)
        try:
            profile, record = scaling._profile(ctx, MODEL, boards)
            print(f"    profiled in {record['profile_s']:.0f} s (counted in no run)", file=sys.stderr, flush=True)
        except RuntimeError as exc:
            session.notes.append(f"the profile failed, quota splits instead: {str(exc).splitlines()[0]}")
    quotas = {b.id: b.cpu for b in scaling._fleet_quotas(ctx.lab.fleet)}

    def split(boards: tuple[str, ...], placement: str) -> tuple[int, ...]:
        if len(boards) == 1:
            return (batch,)
        if profile is not None:
            try:
                return tuple(planned_split(profile, boards, batch, placement=placement))
            except ValueError as exc:
                session.notes.append(f"{'+'.join(boards)}: the planner refused a split ({exc}); by quota instead")
        return tuple(split_batch([quotas[b] for b in boards], batch))

    used = "planned" if profile is not None and args.split == "planned" else "quota"
    if args.split == "quota":
        profile = None  # profiled for the planner's own plan only
    return ({bs: split(bs, "") for bs in dp_boards}, {g: split(g, CUT) for g in stage0s}, used)


def _measure(args: argparse.Namespace, key_file: Path, tmp: Path, session: Session) -> None:
    logs = args.keep_runs / FLEET / "lab-logs" if args.keep_runs else None  # the agents' logs outlive the lab there
    with scaling.lab_up(FLEET, key_file, logs_dir=logs) as lab:
        runs_dir = (args.keep_runs or tmp) / FLEET
        ctx = scaling.FleetContext.of_lab(lab, key_file, runs_dir, args.deadline, args.ballast)
        quotas = {b.id: b.cpu for b in scaling._fleet_quotas(lab.fleet)}
        ranked = fastest_boards(scaling._fleet_quotas(lab.fleet), len(lab.boards))
        dp_boards = [tuple(ranked[:k]) for k in args.dp_boards] if args.speed else []
        args.planned = args.planned and args.speed
        args.plan_boards = args.plan_boards or sorted(lab.boards)
        used = sorted({*ranked[:max(args.dp_boards)], TAIL_BOARD, *(b for g in args.stage0 for b in g.split("+"))}
                      | (set(_pipeline_boards(args.recovery_pipeline)) if args.recovery or args.slowdown else set())
                      | (set(args.plan_boards) if args.planned else set()))
        scaling._warm(ctx, used)
        if args.speed:
            _speed(ctx, args, dp_boards, quotas, session)
        if args.recovery:
            for mode in args.modes:
                print(f"  recovery, {mode}: {args.recovery_pipeline}, {args.victim}'s agent killed after "
                      f"{args.kill_after} steps", file=sys.stderr, flush=True)
                row = _recovery_run(ctx, mode, args.recovery_pipeline, args.victim, args.train_flag, args.kill_after,
                                    args.recovery_steps)
                session.recovery.append(row)
                print(f"    exit {row.exit_status}, recovery_s {scaling._fmt(row.recovery_s, '.1f')}, re-planned "
                      f"{row.replanned}, steps once each: {row.exactly_once} (trained again: {row.trained_again})",
                      file=sys.stderr, flush=True)
                if row.exit_status != 0 or row.killed_after_step is None:
                    session.failures.append(f"recovery {mode}: {row.note}")
                if mode != args.modes[-1] or args.slowdown:
                    lab.start_agent(args.victim)  # back for the next run
                    lab.wait_online(timeout_s=120)
        if args.slowdown:
            print(f"  slowdown: {args.recovery_pipeline}, {args.victim} cut to {args.slowdown_factor:g} of its quota "
                  f"after {SLOWDOWN_AFTER} steps", file=sys.stderr, flush=True)
            srow = _slowdown_run(ctx, args.recovery_pipeline, args.victim, args.slowdown_factor, args.slowdown_steps,
                                 args.train_flag)
            session.slowdown.append(srow)
            print(f"    exit {srow.exit_status}, revised after step {srow.revised_at} to {srow.revised_to} "
                  f"(revision_s {scaling._fmt(srow.revision_s, '.1f')}); step ms {scaling._fmt(srow.before_ms, '.0f')} / "
                  f"{scaling._fmt(srow.during_ms, '.0f')} / {scaling._fmt(srow.after_ms, '.0f')}", file=sys.stderr,
                  flush=True)
            if srow.exit_status != 0:
                session.failures.append(f"slowdown: {srow.note}")


def _pipeline_boards(pipeline: str) -> list[str]:
    """A ``--pipeline``'s boards in order: stage 0's group, then each later stage's."""
    return [b for stage in pipeline.split(",") for b in stage.split("@")[-1].split("+")]


def _later_boards(pipeline: str) -> list[str]:
    """The boards of a ``--pipeline``'s later stages (``CUT@BOARD``, or ``CUT@B1+B2`` a group)."""
    return [b for stage in pipeline.split(",")[1:] if "@" in stage for b in stage.split("@", 1)[1].split("+")]


def _speed(ctx: scaling.FleetContext, args: argparse.Namespace, dp_boards: list[tuple[str, ...]],
           quotas: dict[str, float], session: Session) -> None:
    dp_splits, stage0_splits, used = _splits(ctx, args, dp_boards, session)
    configs: list[scaling.Config | PipedConfig] = [
        scaling.Config(FLEET, MODEL, scaling.BASELINE_MODE, bs, dp_splits[bs], tuple(quotas[b] for b in bs),
                       scaling.ONE_BOARD if len(bs) == 1 else used) for bs in dp_boards]
    configs += [PipedConfig(mode, group, stage0_splits[group], m, used)
                for mode in args.modes for group in stage0_splits for m in args.micro_batches]
    if args.planned:
        try:
            configs.append(_planned(ctx, args, quotas, session))
        except RuntimeError as exc:
            if isinstance(exc, scaling.OutOfTime):
                raise
            session.failures.append(f"the planner's plan: {exc}")
            print(f"    the planner's plan failed: {exc}", file=sys.stderr, flush=True)
    for n, cfg in enumerate(configs, 1):
        if time.monotonic() > args.deadline:
            raise scaling.OutOfTime(f"--max-minutes passed before {cfg.label}")
        print(f"  [{n}/{len(configs)}] {cfg.label}, batches {','.join(map(str, cfg.batch_sizes))}",
              file=sys.stderr, flush=True)
        try:
            row = (_dp_run(ctx, cfg) if isinstance(cfg, scaling.Config)
                   else _piped_run(ctx, cfg, args.train_flag, quotas))
        except RuntimeError as exc:
            if isinstance(exc, scaling.OutOfTime):
                raise
            session.failures.append(str(exc))
            print(f"    failed: {exc}", file=sys.stderr, flush=True)
            continue
        session.speed.append(row)
        print(f"    {scaling._fmt(row.samples_per_s, '.0f')} samples/s, step {scaling._fmt(row.median_step_ms, '.0f')} ms, "
              f"to target {scaling._fmt(row.time_to_target_s, '.1f')} s, {scaling._fmt(row.wire_kib_per_step_board, '.0f')} "
              f"KiB/step/board on the wire", file=sys.stderr, flush=True)


def _planned(ctx: scaling.FleetContext, args: argparse.Namespace, quotas: dict[str, float],
             session: Session) -> scaling.Config | PipedConfig:
    """The planner's own plan over ``--plan-boards`` (module doc, item 1), from the run's profile.

    Raises:
        RuntimeError: no profile, or plan failed.
    """
    from pipeline_picks import verified_pick

    profile = ctx.runs_dir / f"profile-{MODEL}.json"
    if not profile.exists():
        raise RuntimeError("the planner's plan needs the run's profile, which failed")
    print(f"  plan --pipeline --verify {args.verify} over {'+'.join(args.plan_boards)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    pick, record = verified_pick(ctx, MODEL, args.plan_boards, str(profile), args.verify, args.verify_rounds,
                                 what="planned")
    session.planned = {"label": pick.label, "verify_s": round(time.monotonic() - started, 1), "verify": record}
    print(f"    chose {pick.label} in {session.planned['verify_s']:.0f} s", file=sys.stderr, flush=True)
    if not pick.later:
        return scaling.Config(FLEET, MODEL, scaling.BASELINE_MODE, pick.stage0, pick.batch_sizes,
                              tuple(quotas[b] for b in pick.stage0), "planner")
    return PipedConfig("planned", pick.stage0, pick.batch_sizes, pick.micro_batches, "planner", shape=pick.shape,
                       flags=("--stage-sync", "checkpoint"))


# ----------------------------------------------------------------------------- the table

def print_figures(session: Session, wall_s: float) -> None:
    rows = with_ratios(session.speed)
    cells = [[r.kind, r.boards, ",".join(map(str, r.batch_sizes)), "-" if r.micro_batches is None else str(r.micro_batches),
              scaling._fmt(r.samples_per_s, ".0f"), scaling._fmt(r.median_step_ms, ".0f"),
              "-" if r.time_to_target_s is None else f"{r.time_to_target_s:.1f} ({r.target_epoch})",
              f"{scaling._fmt(r.wire_kib_per_step_board, ',.0f')} / {scaling._fmt(r.wire_kib_per_step_max, ',.0f')}",
              scaling._fmt(r.exchange_kib_per_step_board, ",.0f"),
              f"{scaling._fmt(r.ratio_rate, '.2f')} / {scaling._fmt(r.ratio_target, '.2f')}",
              f"{r.stolen:.0%} / {r.others_share:.0%}"] for r in rows]
    best = max((r.ratio_rate for r in rows if r.kind != "data-parallel" and r.ratio_rate), default=None)
    notes = [f"conv_mlp on digits, global batch 128, to 94% validation accuracy (epoch reached). x best DP: samples/s "
             f"over the best data-parallel run's / its time to target over this run's; issue 35's target >= "
             f"{SPEED_TARGET_X:.0f}x (best pipeline here: {scaling._fmt(best, '.2f')}x). Wire KiB: each taking-part "
             "board's link, both ways, per step after the warm-up (mean / busiest board); exchange KiB: the coordinator's "
             "gradient exchange alone per step and board (welcomes included). Host: steal / other processes' CPU.",
             f"{wall_s / 60:.1f} min in all."]
    if session.planned:
        notes.append(f"planned: plan --pipeline --objective time --verify over every board chose {session.planned['label']} "
                     f"({session.planned['verify_s']} s of pre-training, counted in no run).")
    notes += session.notes + [f"FAILED: {f.splitlines()[0]}" for f in session.failures]
    if cells:
        print_table(f"Pipeline stages against data-parallel on {FLEET}", [
            "run", "boards", "batches", "M", "samples/s", "step ms", "to 94% s", "wire KiB/step/board", "exchange KiB",
            "x best DP", "steal / others"], cells, caption="\n".join(notes), left_columns=3, min_width=170)
    rec = [[r.mode, r.pipeline, r.victim, "-" if r.killed_after_step is None else str(r.killed_after_step),
            scaling._fmt(r.recovery_s, ".1f"), r.replanned or "-",
            f"{r.steps_seen}/{r.steps_expected}, {'yes' if r.exactly_once else 'NO'}",
            ",".join(map(str, r.trained_again)) or "none", str(r.exit_status)]
           for r in session.recovery]
    if rec:
        detail = [f"{r.mode}: missing {r.missing}, repeated {r.repeated}, trained again {r.trained_again}"
                  for r in session.recovery if not r.exactly_once]
        print_table(f"Recovery on {FLEET}: a later stage's agent killed", [
            "mode", "pipeline", "killed", "after step", "recovery s", "re-planned", "steps, each once", "trained again",
            "exit"], rec,
            caption="\n".join([f"recovery_s: result.json's, from the board's loss to the first step of the new plan "
                               f"(target <= {RECOVERY_TARGET_S:.0f} s); steps: metrics.jsonl's step numbers against "
                               "0 .. N-1, and none trained again: applied, then rolled back to a checkpoint (the "
                               "coordinator's 'stopping after step N' and 're-planning from step K').", *detail,
                               *(r.note for r in session.recovery if r.note)]),
            left_columns=3, min_width=150)
    slow = [[r.pipeline, f"{r.victim} to {r.quota:.3f}", "-" if r.cut_after_step is None else str(r.cut_after_step),
             "-" if r.revised_at is None else str(r.revised_at), r.revised_to or "-", scaling._fmt(r.revision_s, ".1f"),
             f"{scaling._fmt(r.before_ms, '.0f')} / {scaling._fmt(r.during_ms, '.0f')} / {scaling._fmt(r.after_ms, '.0f')}",
             "yes" if r.exactly_once else "NO", str(r.exit_status)] for r in session.slowdown]
    if slow:
        print_table(f"Revision on {FLEET}: a later stage's board slowed for good", [
            "pipeline", "slowed (core)", "after step", "revised from", "revised to", "revision s",
            "step ms before / slowed / revised", "steps once", "exit"], slow,
            caption="\n".join(["--stage-sync checkpoint, M = 2; revision s: result.json's revision_s, from the old "
                               "plan's last step to the new one's first; step ms: median periods.",
                               *(r.note for r in session.slowdown if r.note)]), left_columns=2, min_width=150)
    if not cells and not rec and not slow:
        print("\n".join(notes))


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=list(PIPED_MODES), metavar="MODE",
                        help="pipelined modes: piped (train's defaults), piped-sync-checkpoint (--stage-sync checkpoint); "
                             "default both where train has --stage-sync, else piped")
    parser.add_argument("--train-flag", action="append", default=[], metavar="FLAG",
                        help="an extra train flag for every pipelined run, repeated, with '=': --train-flag=--foo "
                             "--train-flag=VALUE")
    parser.add_argument("--dp-boards", nargs="+", type=int, default=list(DEFAULT_DP_BOARDS), choices=range(1, 9),
                        metavar="K", help="data-parallel runs on the K fastest boards (default 1 2)")
    parser.add_argument("--stage0", nargs="+", default=list(DEFAULT_STAGE0), metavar="B+B",
                        help=f"stage 0's groups, each measured (default {' '.join(DEFAULT_STAGE0)}); the head is "
                             f"{CUT}@{TAIL_BOARD}")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=list(DEFAULT_MICRO_BATCHES), metavar="M",
                        help="micro-batch counts, each measured (default 1 2)")
    parser.add_argument("--planned", action=argparse.BooleanOptionalAction, default=True,
                        help="also train the planner's own plan, plan --pipeline --verify K's choice (default on)")
    parser.add_argument("--plan-boards", nargs="+", default=None, metavar="BOARD",
                        help=f"the boards plan --pipeline plans over (default all of {FLEET}'s)")
    parser.add_argument("--verify", type=int, default=VERIFY, metavar="K",
                        help=f"plan --pipeline --verify K: the K best plans by the model pre-trained (default {VERIFY})")
    parser.add_argument("--verify-rounds", type=int, default=DEFAULT_VERIFY_ROUNDS, metavar="R",
                        help=f"each pre-trained R times in turn (default {DEFAULT_VERIFY_ROUNDS})")
    parser.add_argument("--split", choices=("planned", "quota"), default="planned",
                        help="the batches of multi-board stage 0s and data-parallel runs: the planner's from a profile "
                             "taken in the run (default), or by CPU quota (no profile)")
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True, help="the speed runs (default on)")
    parser.add_argument("--recovery", action=argparse.BooleanOptionalAction, default=True,
                        help="the recovery runs, one per mode (default on)")
    parser.add_argument("--recovery-pipeline", default=RECOVERY_PIPELINE, metavar="PIPELINE",
                        help=f"the recovery run's --pipeline (default {RECOVERY_PIPELINE}; stage 0's batches "
                             f"{RECOVERY_BATCH})")
    parser.add_argument("--victim", default=RECOVERY_VICTIM, metavar="BOARD",
                        help=f"the later stage's board whose agent is killed (default {RECOVERY_VICTIM})")
    parser.add_argument("--kill-after", type=int, default=KILL_AFTER, metavar="STEPS",
                        help=f"kill it once this many steps are done (default {KILL_AFTER})")
    parser.add_argument("--recovery-steps", type=int, default=RECOVERY_STEPS, metavar="N",
                        help=f"the recovery run's length (default {RECOVERY_STEPS})")
    parser.add_argument("--slowdown", action=argparse.BooleanOptionalAction, default=True,
                        help="the revision run: the victim's CPU cut mid-run (default on)")
    parser.add_argument("--slowdown-factor", type=float, default=SLOWDOWN_FACTOR, metavar="F",
                        help=f"the victim's quota is cut to F of the fleet file's (default {SLOWDOWN_FACTOR:g})")
    parser.add_argument("--slowdown-steps", type=int, default=SLOWDOWN_STEPS, metavar="N",
                        help=f"the revision run's length (default {SLOWDOWN_STEPS})")
    parser.add_argument("--ballast", action=argparse.BooleanOptionalAction, default=True,
                        help="boards left out of a run spin at their quotas meanwhile (default on)")
    parser.add_argument("--max-minutes", type=float, default=25.0,
                        help="stop (exit 2, with the figures so far) after this long (default 25)")
    parser.add_argument("--keep-runs", type=Path, metavar="DIR",
                        help="keep every run directory and its log, and the agents' logs (lab-logs/), here")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write every figure here")
    args = parser.parse_args(argv)
    if args.victim not in _later_boards(args.recovery_pipeline):
        parser.error(f"--victim {args.victim}: not a later stage's board of --recovery-pipeline {args.recovery_pipeline}")
    if any(m < 1 for m in args.micro_batches) or args.kill_after < 1 or args.recovery_steps <= args.kill_after + 1:
        parser.error("--micro-batches must be >= 1, --kill-after >= 1 and --recovery-steps > --kill-after + 1")
    if any(TAIL_BOARD in g.split("+") for g in args.stage0):
        parser.error(f"--stage0: {TAIL_BOARD} takes the head ({CUT}@{TAIL_BOARD}); leave it out of stage 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("pipeline: needs root for the lab (network namespaces, cgroups)", file=sys.stderr)
        return 2
    from edgefleet.lab.lab import LabBusy, LabUnavailable

    session = Session()
    if args.modes is None:
        args.modes = list(PIPED_MODES) if _stage_sync_available() else ["piped"]
        if args.modes == ["piped"]:
            session.notes.append("piped-sync-checkpoint not measured: this train has no --stage-sync yet")
    elif "piped-sync-checkpoint" in args.modes and not _stage_sync_available():
        print("pipeline: mode piped-sync-checkpoint needs train's --stage-sync, which this checkout lacks; "
              "leave the mode out", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    started = time.monotonic()
    args.deadline = started + args.max_minutes * 60
    print(f"pipeline: {FLEET}, modes {', '.join(args.modes)}; at most {args.max_minutes:g} min", file=sys.stderr, flush=True)
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="efl-pipeline-") as tmp:
        # scaling's key (a legacy shared one): its warm-up, profile and data-parallel runs pass no --board-keys, which
        # an Ed25519 fleet key would require of boards that sign their events; the pipelines pass it (their TLS needs it)
        key_file = write_fleet_key(Path(tmp) / "fleet.key")
        try:
            _measure(args, key_file, Path(tmp), session)
        except (scaling.OutOfTime, LabUnavailable, LabBusy, TimeoutError, RuntimeError) as exc:
            session.failures.append(str(exc))
        except KeyboardInterrupt:
            interrupted = True
            print("pipeline: interrupted; the lab is down", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    with_ratios(session.speed)
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k not in ("deadline",)},
                                         "wall_s": wall, "speed": [asdict(r) for r in session.speed],
                                         "recovery": [asdict(r) for r in session.recovery],
                                         "slowdown": [asdict(r) for r in session.slowdown],
                                         "planned": session.planned,
                                         "failures": session.failures, "notes": session.notes,
                                         "interrupted": interrupted}, indent=1, default=str))
    print_figures(session, wall)
    if interrupted:
        return 130
    expected = (len(args.dp_boards) + len(args.modes) * len(args.stage0) * len(args.micro_batches)
                + args.planned) * args.speed
    made = (len(session.speed) == expected and len(session.recovery) == len(args.modes) * args.recovery
            and len(session.slowdown) == int(args.slowdown))
    return 0 if made and not session.failures else 2


if __name__ == "__main__":
    sys.exit(main())
