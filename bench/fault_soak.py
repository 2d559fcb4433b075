"""Fault soak: one training job on the lab while a board dies, the broker restarts, the coordinator
is paused and a hostile board publishes junk every second; then the same job while a board of it lies
in its gradient and another's worker is stopped and rejoins over a slow link; each must end as a
quiet run would.

What runs: the lab's ``mixed4`` fleet (lab/fleets/), a real ``edge-coordinator train`` (signed
Ed25519 commands, ``--board-keys``, the TCP exchange, Lightning on every board) of LeNet-5 on
digits over ``--boards`` (default pi4-1, pi5-1, x86-1; a global batch of ``--global-batch`` split
in proportion to their CPU quotas), seed 0, ``--no-rebalance`` (a re-split changes the summation
order, so two runs would no longer match bit for bit), a checkpoint every 10 steps.

1. A calibration job (30 steps, not counted; it also warms the boards' kept workers) measures the
   step period, which fixes the job's length: ``--minutes`` (10; ``--quick``: 2) of steps.
2. The quiet run: that job, nothing done to it. The reference.
3. The faulted run: the same job, while
   - the hostile board (``--hostile``, nano-1, not in the job: its agent runs beside it) publishes
     junk on ``--junk-board``'s topics every second for the whole run (bench/fault_soak_junk.py:
     nested JSON, 1 MiB of random bytes, bytes that are not msgpack, forged ``failed`` events and
     ``stop`` commands, replayed real commands, a forged ``offline`` status, absurd telemetry; the
     forged and replayed commands and the forged status from the job's first step on, unless
     ``--forge-during-join``: during the join one of them fails the job, a bug this soak found);
   - at 15% of the steps the broker is stopped, left down ``--broker-down`` (5 s) and started again
     on the same address;
   - at 35% the coordinator is SIGSTOPped for longer than the step deadline (max(--step-timeout,
     5 x the median step), plus 5 s), then SIGCONTed;
   - at 60% ``--kill``'s agent is killed with SIGKILL (its worker follows), and started again 10 s later.
4. The hostile run (bench/fault_soak_hostile.py; ``--no-hostile`` leaves it out): the same job, the same
   global batch and length, on ``--boards`` plus ``--liar`` (nano-1; 64 split 9,20,28,7: the liar's share
   taken so that the rollback's re-split, ``without_boards``, gives back the quiet run's 10,23,31), with
   the model ``tests.hostile.lying_module:LyingLeNet`` (LeNet-5; the repository goes on the coordinator's
   and the agents' PYTHONPATH) and ``--audit-every 4``, while
   - the liar's agent, started again with ``EDGEFLEET_TEST_LIE=scale:2000:FROM``, sends 2,000 x its
     gradient (its reported loss honest) from FROM = 80% of the steps on;
   - at 10% of the steps ``--stall``'s (x86-1's) training worker, the agent's child, is SIGSTOPped for
     3 step deadlines plus 5 s, then SIGCONTed;
   - just before that SIGCONT the board's link is narrowed with tc tbf to 150 KB/s both ways for 15 s,
     while its worker, live again, joins again and reads its welcome; then its own rates come back.
   Should ``train`` stop after the rollback without starting again (a board still ending the attempt
   thrown away was found busy: seen on the lab, 2026-11-29), the soak resumes the run with
   ``train --resume`` as an operator would, and fails the hostile run's exit-status check, saying why.
5. Checks, printed as a table last: every step once in each run's ``metrics.jsonl``; both runs exit
   0; the quiet run had every board in every step; the faulted run had every board in every step
   before the kill (the pause and the junk dropped none) and its losses equal the quiet run's bit
   for bit there; the model and optimizer equal the quiet run's (max abs diff 0) at the last
   checkpoint before the kill, which comes after the broker restart and the pause; from the kill on,
   what docs/training.md says of a board that dies (dropped, the job finishes on the others, its
   share not redone); the coordinator's resident memory, sampled every second, at most 1.5x its
   warm-up peak (the first 10% of the steps) afterwards; no traceback in the coordinator's output
   or the agents' logs; ``status`` still works after the run (junk left retained on the broker).
   The hostile run: exit 0; every step once in its ``metrics.jsonl`` (which the rollback writes again
   from step 0); the liar named ("failed its audit at step S", S >= FROM) and the run rolled back to
   step 0 once (``audits.json``); every step after it on the honest boards with the quiet run's global
   batch; its final model equal to the quiet run's (max abs diff 0; within 1e-5 relative L2, tensor by
   tensor, where the re-split is not the quiet run's split); the stopped
   board late in the steps while stopped, then dropped ("left: dropped from the job's steps" in the
   output) while the others step on, and back in the steps after its SIGCONT; while its link was
   narrow, the others stepped with no gap longer than 5 median step periods or the quiet run's longest
   gap (validation), whichever is longer, and the bytes that reached it are shown; and the board, never
   cut off meanwhile ("did not take its welcome or catch up"), back in the steps.

Where the mathematics is exact and where it is not: the hostile run's stopped worker leaves out its
share of the steps it misses, and its rejoin is timed by the host, but the rollback the liar causes
throws those steps away: the run is trained again from step 0 on the honest boards, the global
batches the quiet run's, re-split as the quiet run split them, so each step's average sums the same
gradients in the same order and the model can be compared bit for bit. Were the re-split another
(``--liar``/``--boards`` for which no liar's share gives the quiet split back), the same samples
would be summed in another order: equal up to float32 rounding per step, but Adam on a nearly fitted
model amplifies it (2026-11-29, split 10,24,30 against 10,23,31: losses equal to 1e-7 up to step 200,
final weights 0.13 apart relative after 475 steps), so only short runs meet 1e-5.

In the faulted run, a board that dies is dropped and its share of each global batch is not redone by
the others (the step averages over the boards that answered)
until its restarted agent, online again, is asked back by the coordinator and rejoins at a step
boundary. So between the kill and the rejoin the faulted run trains on a smaller global batch and
its final model differs from the quiet run's; that difference is printed, not failed. Everything
before the kill (the broker restart, the pause and a third of the run's junk included) is compared
exactly.

Run as root from the repository root: ``python bench/fault_soak.py`` (about 4 x --minutes plus
four minutes: the hostile run trains about 1.8 times the job's steps, rolled back once, and waits out
the stopped worker's deadlines), ``--quick`` (2-minute runs: 9 minutes in all on a busy 2-core machine,
2026-11-29). Progress goes to stderr; exit status 0 when every check
passes, 1 when one fails, 2 when the soak could not run (the lab, a job), 130 when interrupted.
The lab comes down on every exit path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent

from _harness import (  # bench/ is the script's folder, first on sys.path
    KEEP_WORKER,
    MetricsTail,
    log_tail,
    sigterm_as_ctrl_c,
    stop_job,
    train_command,
    wait_ready,
    write_fleet_key,
)
from _table import print_table
from fault_soak_checks import (
    compare_losses,
    count_steps,
    documented_drop_problems,
    first_step_without,
    incomplete_steps,
    late_steps,
    max_abs_diff,
    max_relative_l2,
    mib,
    rejoin_step,
    rss_bound,
    step_gaps,
)
from fault_soak_faults import (
    CheckpointKeeper,
    FaultLog,
    RssSampler,
    checkpoints_by_step,
    kill_agent,
    pause,
    restart_agent,
    restart_broker,
)
from fault_soak_hostile import LIAR_MODEL, HostileSchedule, RewindingTail, liar_split, start_liar
from scaling_figures import split_batch

if TYPE_CHECKING:
    from edgefleet.lab.lab import Lab

log = logging.getLogger("bench.fault_soak")

FLEET = ROOT / "lab/fleets/mixed4.toml"
CALIBRATION_STEPS = 30
CHECKPOINT_EVERY = 10
STEP_TIMEOUT_S = 10.0     # train's default, given explicitly: the pause is measured against it
PAUSE_MARGIN_S = 5.0      # the pause lasts this much longer than the step deadline
REJOIN_ROOM_S = 45.0      # a restarted agent left less of the run than this cannot be expected back (--quick)
RESTART_AFTER_S = 10.0    # the killed agent is started again this long after
WARM_SHARE = 0.10         # the coordinator's memory: the first 10% of the steps are its warm-up
RSS_LIMIT = 1.5           # ... and afterwards it may reach this multiple of the warm-up's peak
AT = {"broker": 0.15, "pause": 0.35, "kill": 0.60}  # share of the steps at which each fault starts
POLL_S = 0.2
AUDIT_EVERY = 4           # the hostile run audits each board once within every 4 steps (train --audit-every)
STALL_AT = 0.10           # share of the hostile run's steps at which the worker is stopped
LIE_FROM = 0.80           # ... and from which the liar lies (the stopped board has had time to come back)


@dataclass
class Job:
    """What every run of the soak shares."""

    lab: Lab
    key_file: Path
    boards: list[str]
    batch_sizes: list[int]
    runs_dir: Path
    model: str = "lenet5"
    extra: tuple[str, ...] = ()   # more train options (the hostile run's --audit-every)


@dataclass
class Run:
    """One finished run."""

    name: str
    run_dir: Path
    steps: int
    returncode: int
    wall_s: float
    output: str
    records: list[Mapping[str, Any]]
    rss: list[tuple[float, int]]
    checkpoints: dict[int, Path]
    faults: FaultLog = field(default_factory=FaultLog)
    notes: dict[str, Any] = field(default_factory=dict)   # what the faults measured (broker down, pause, steps)


def _train_command(job: Job, run_dir: Path, steps: int) -> list[str]:
    return train_command(job.lab, job.key_file, job.boards, job.batch_sizes,
                         "--model", job.model, "--dataset", "digits", "--steps", str(steps), "--seed", "0",
                         "--no-rebalance", "--checkpoint-every", str(CHECKPOINT_EVERY),
                         "--step-timeout", str(STEP_TIMEOUT_S), "--run-dir", str(run_dir), *job.extra, board_keys=True)


def _median_period(records: Sequence[Mapping[str, Any]], skip: int = 3) -> float | None:
    """The median time between consecutive steps (validation included), after ``skip`` warm-up steps."""
    times = [float(r["elapsed_s"]) for r in records[skip:]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def _deadline_s(records: Sequence[Mapping[str, Any]]) -> float:
    """The exchange's step deadline now: max(--step-timeout, 5 x the recent median step)."""
    recent = [float(r["wall_s"]) for r in records[-20:]]
    return max(STEP_TIMEOUT_S, 5 * statistics.median(recent)) if recent else STEP_TIMEOUT_S


class Schedule:
    """The faulted run's faults, each started once its step is reached."""

    def __init__(self, job: Job, steps: int, *, kill: str, broker_down_s: float) -> None:
        self.job, self.kill, self.broker_down_s = job, kill, broker_down_s
        self.at = {name: int(share * steps) for name, share in AT.items()}
        self.done: set[str] = set()
        self.killed_at: float | None = None

    def due(self, run: Run, tail: MetricsTail, pid: int) -> None:
        step = int(tail.records[-1]["step"]) if tail.records else -1
        if "broker" not in self.done and step >= self.at["broker"]:
            self.done.add("broker")
            run.faults.note(step, f"broker stopped for {self.broker_down_s:g} s")
            down = restart_broker(self.job.lab, self.broker_down_s)
            tail.read()
            after = int(tail.records[-1]["step"])
            run.notes.update(broker_step=step, broker_down_s=down, steps_while_broker_down=after - step)
            run.faults.note(after, f"broker back after {down:.1f} s; {after - step} steps taken meanwhile")
        elif "pause" not in self.done and step >= self.at["pause"]:
            self.done.add("pause")
            deadline = _deadline_s(tail.records)
            seconds = deadline + PAUSE_MARGIN_S
            run.faults.note(step, f"coordinator SIGSTOP for {seconds:.1f} s (step deadline {deadline:.1f} s)")
            pause(pid, seconds)
            run.notes.update(pause_step=step, pause_s=seconds, deadline_s=deadline)
            run.faults.note(step, "coordinator SIGCONT")
        elif "kill" not in self.done and step >= self.at["kill"]:
            self.done.add("kill")
            killed = kill_agent(self.job.lab, self.kill)
            self.killed_at = time.monotonic()
            run.notes.update(kill_step=step)
            run.faults.note(step, f"{self.kill}: agent (pid {killed}) killed with SIGKILL")
        elif "restart" not in self.done and self.killed_at is not None and time.monotonic() - self.killed_at >= RESTART_AFTER_S:
            self.done.add("restart")
            pid_new = restart_agent(self.job.lab, self.kill)
            run.notes.update(restart_step=step)
            run.faults.note(step, f"{self.kill}: agent started again (pid {pid_new})")


def run_job(job: Job, name: str, steps: int, *, schedule: Schedule | HostileSchedule | None = None,
            time_limit_s: float, tail: MetricsTail | None = None, command: list[str] | None = None,
            log_name: str | None = None) -> Run:
    """Run the job to its end (faults from ``schedule``, if any). Raises RuntimeError past ``time_limit_s``.

    ``command``: another train command for the run directory ``name`` (``--resume``), logged to ``log_name``.
    """
    run_dir = job.runs_dir / name
    log_path = job.runs_dir / f"{log_name or name}.log"
    tail = tail or MetricsTail(run_dir / "metrics.jsonl")
    run = Run(name, run_dir, steps, -1, 0.0, "", [], [], {})
    started = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(command or _train_command(job, run_dir, steps), stdout=out, stderr=subprocess.STDOUT,
                                cwd=job.runs_dir)
    run.faults = FaultLog(started)
    sampler = RssSampler(proc.pid, lambda: float(tail.records[-1]["step"]) if tail.records else -1.0)
    keeper = CheckpointKeeper(run_dir, job.runs_dir / f"{log_name or name}-checkpoints")
    last_progress = started
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            tail.read()
            if schedule is not None:
                schedule.due(run, tail, proc.pid)
            now = time.monotonic()
            if now - started > time_limit_s:
                stop_job(proc)
                raise RuntimeError(f"{name}: stopped after {time_limit_s:.0f} s, at step "
                                   f"{tail.records[-1]['step'] if tail.records else 'none'} of {steps}")
            if now - last_progress >= 30:
                last_progress = now
                where = f"step {int(tail.records[-1]['step']) + 1}/{steps}" if tail.records else "boards joining"
                print(f"    {name}: {where}, {now - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        if proc.poll() is None:
            stop_job(proc)
        sampler.stop()
        keeper.stop()
        if isinstance(schedule, HostileSchedule):
            run.records = tail.records
            schedule.finish(run)
    tail.read()
    run.returncode, run.wall_s = proc.returncode, time.monotonic() - started
    run.output = log_path.read_text(errors="replace")
    run.records, run.rss = tail.records, sampler.samples
    run.checkpoints = checkpoints_by_step(keeper.kept)
    return run


def _calibrate(job: Job, minutes: float) -> tuple[int, float]:
    """The steps that make ``minutes`` of the job, from a short run's step period (the run also warms the workers)."""
    run = run_job(job, "calibration", CALIBRATION_STEPS, time_limit_s=600)
    period = _median_period(run.records) if run.returncode == 0 else None
    if period is None:
        raise RuntimeError(f"the calibration job exited with {run.returncode}:\n{log_tail(job.runs_dir / 'calibration.log')}")
    pause_s = max(STEP_TIMEOUT_S, 5 * period) + PAUSE_MARGIN_S
    steps = max(60, int((minutes * 60 - pause_s - RESTART_AFTER_S) / period))
    return steps, period


# ----------------------------------------------------------------------------- the verdicts

@dataclass
class Verdict:
    check: str
    ok: bool | None      # None: shown, not judged
    detail: str


def _replica(path: Path) -> Any:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["replica"]
    return {"model": state["model"], "optimizer": state["optimizer"], "step": state["step"]}


def _model(run: Run) -> Any:
    import torch

    path = run.run_dir / "model.pt"
    return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def _tracebacks(texts: dict[str, str]) -> list[str]:
    return [name for name, text in texts.items() if "Traceback" in text]


def verdicts(job: Job, quiet: Run, faulted: Run, *, kill: str, junk_board: str, junk: dict[str, Any],
             after_status: dict[str, dict[str, Any]], agent_logs: dict[str, str],
             extra_outputs: dict[str, str] | None = None) -> list[Verdict]:
    out = [Verdict("exit status", quiet.returncode == 0 and faulted.returncode == 0,
                   f"quiet {quiet.returncode}, faulted {faulted.returncode}")]
    for run in (quiet, faulted):
        steps = count_steps(run.records, run.steps)
        out.append(Verdict(f"every step once in metrics.jsonl ({run.name})", steps.ok, steps.describe()))
    not_quiet = incomplete_steps(quiet.records, job.boards)
    out.append(Verdict("quiet run: every board in every step", not not_quiet,
                       "yes" if not not_quiet else f"{len(not_quiet)} steps missed a board (host too busy?): {not_quiet[:8]}"))
    drop = first_step_without(faulted.records, kill)
    if drop is None:
        out.append(Verdict(f"{kill} killed: dropped from the job", False, "it contributed to every step"))
        return out
    notes = faulted.notes
    early = incomplete_steps(faulted.records, job.boards, before=drop)
    out.append(Verdict("faulted run before the kill: every board in every step", not early,
                       f"steps 0-{drop - 1}: broker restart at {notes.get('broker_step')}, pause at {notes.get('pause_step')}, "
                       f"junk throughout" + ("" if not early else f"; missed at {early[:8]}")))
    losses = compare_losses(quiet.records, faulted.records, before=drop)
    out.append(Verdict("losses equal the quiet run's before the kill", losses.ok,
                       f"{losses.identical}/{losses.compared} steps bit for bit"
                       + ("" if losses.ok else f"; first difference at step {losses.first_difference}, "
                                               f"max {losses.max_abs_diff:.3g}")))
    common = sorted(s for s in set(quiet.checkpoints) & set(faulted.checkpoints) if s <= drop)
    covered = max(int(notes.get("pause_step", 0)), int(notes.get("broker_step", 0)))
    if not common:
        out.append(Verdict("model equal to the quiet run's before the kill", False, "no checkpoint of the same step in both runs"))
    else:
        at = common[-1]
        diff = max_abs_diff(_replica(quiet.checkpoints[at]), _replica(faulted.checkpoints[at]))
        out.append(Verdict("model equal to the quiet run's before the kill", diff == 0.0 and at > covered,
                           f"checkpoint of step {at} (model + optimizer): max abs diff {diff:.3g}"
                           + ("" if at > covered else f"; before the last fault's step {covered}: too early to tell")))
    batches = dict(zip(job.boards, job.batch_sizes))
    problems = documented_drop_problems(faulted.records, job.boards, job.batch_sizes, kill, drop)
    others = [b for b in job.boards if b != kill]
    back = rejoin_step(faulted.records, job.boards, drop)
    out.append(Verdict("after the kill: as docs/training.md says", not problems,
                       f"{kill} killed at step {notes.get('kill_step')}, dropped from step {drop}; steps {drop}-"
                       f"{(back if back is not None else faulted.steps) - 1} on {'+'.join(others)}, "
                       f"n={sum(batches[b] for b in others)} of {sum(job.batch_sizes)}"
                       + ("" if back is None else f"; every board again from step {back}")
                       + ("" if not problems else "; " + "; ".join(problems))))
    final_q, final_f = _model(quiet), _model(faulted)
    final = max_abs_diff(final_q, final_f) if final_q is not None and final_f is not None else None
    out.append(Verdict("final model vs the quiet run's", None if final is not None else False,
                       "no model.pt" if final is None else
                       f"max abs diff {final:.3g}: not comparable, {batches[kill]} of {sum(job.batch_sizes)} samples of each "
                       f"global batch from step {drop} on are not redone (documented)"))
    state = after_status.get(kill, {}).get("state", "unknown")
    restart = notes.get("restart_step")
    left_s = (faulted.steps - int(restart)) * (_median_period(faulted.records) or 0.0) if restart is not None else 0.0
    too_late = back is None and left_s < REJOIN_ROOM_S  # --quick: the run ends seconds after the restart
    out.append(Verdict(f"{kill} restarted: asked back, rejoined the job",
                       None if too_late else back is not None and state == "online",
                       f"agent started again at step {restart}; "
                       + (f"back in every step from step {back}" if back is not None else
                          f"the run ended {left_s:.0f} s later, too soon to start, import torch and rejoin" if too_late
                          else "never rejoined")
                       + f"; status {state} after the run"))
    offline = [b for b in job.lab.boards if after_status.get(b, {}).get("state") != "online"]
    out.append(Verdict("status after the run (retained junk on the broker)", not offline,
                       f"{len(after_status)} boards listed" + (f"; not online: {', '.join(offline)}" if offline else ", all online")))
    dropped_warnings = faulted.output.count(f"dropped a job event on board {junk_board}'s topic")
    forged_effect = any(text in faulted.output for text in (f"board {junk_board} failed", "forged: out of memory",
                                                             "forged: another board"))
    sent = sum(junk.get("counts", {}).values())
    out.append(Verdict(f"junk on {junk_board}'s topics", junk.get("rounds", 0) > 0.5 * faulted.wall_s and not forged_effect,
                       f"{junk.get('rounds', 0)} rounds, {sent} messages ({len(junk.get('counts', {}))} kinds, "
                       f"{junk.get('captured_commands', 0)} real commands replayed, {junk.get('connects', 0)} connects); "
                       f"{junk_board} in every step; {dropped_warnings} 'dropped a job event' warning(s)"
                       + ("; a forged message took effect" if forged_effect else "")))
    out.append(Verdict("broker restart", notes.get("broker_down_s") is not None,
                       f"down {notes.get('broker_down_s', 0):.1f} s at step {notes.get('broker_step')}; "
                       f"{notes.get('steps_while_broker_down')} steps taken meanwhile"))
    out.append(Verdict("coordinator paused past the step deadline", notes.get("pause_s") is not None and not early,
                       f"{notes.get('pause_s', 0):.1f} s at step {notes.get('pause_step')} (deadline {notes.get('deadline_s', 0):.1f} s); "
                       "no board left out"))
    for run in (quiet, faulted):
        bound = rss_bound(run.rss, warm_until=WARM_SHARE * run.steps, limit=RSS_LIMIT)
        judged = None if run is quiet else (bound.ok if bound else False)
        out.append(Verdict(f"coordinator memory ({run.name})", judged,
                           "too few samples" if bound is None else
                           f"start {mib(bound.start)}, warm-up peak {mib(bound.warm)}, peak {mib(bound.peak)} "
                           f"({bound.ratio:.2f}x, limit {RSS_LIMIT}x), end {mib(bound.end)}; {len(run.rss)} samples"))
    bad = _tracebacks({"quiet": quiet.output, "faulted": faulted.output, **(extra_outputs or {}), **agent_logs})
    out.append(Verdict("no traceback (coordinator, agents)", not bad, "none" if not bad else f"in {', '.join(bad)}"))
    return out


def _refused_after_rollback(run: Run) -> str | None:
    """The line saying why train stopped after rolling the run back and failing to start it again, if it did."""
    from edgefleet.coordinator.audit.rollback import audit_record

    if run.returncode == 0 or not audit_record(run.run_dir).get("rollbacks"):
        return None
    after = run.output.split("rolled the run back to step 0", 1)[-1]
    return next((line.strip() for line in after.splitlines() if "cannot start" in line), None)


def train_resume_command(lab: Lab, key_file: Path, run_dir: Path) -> list[str]:
    from edgefleet.launch import module_command

    return module_command("edgefleet.coordinator.cli", "--broker", lab.broker_address, "train", "--fleet-key", str(key_file),
                          "--board-keys", str(lab.board_keys_dir), "--resume", str(run_dir))


def _board_lines(output: str, board: str, *texts: str) -> dict[str, int]:
    """How many lines of ``output`` name ``board`` and hold each of ``texts``."""
    lines = [line for line in output.splitlines() if board in line]
    return {text: sum(text in line for line in lines) for text in texts}


def _all_records(run: Run) -> list[Mapping[str, Any]]:
    """The run's metrics.jsonl as it ended (after any rollback), read whole."""
    path = run.run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def hostile_verdicts(job: Job, quiet: Run, hostile: Run, tail: RewindingTail, *, liar: str, stall: str,
                     lie_from: int, quiet_batches: list[int]) -> list[Verdict]:
    """The third run: the liar found and the run rolled back, the stopped worker dropped and back, the slow rejoin."""
    from edgefleet.coordinator.audit.rollback import audit_record

    honest = [b for b in job.boards if b != liar]
    notes, out = hostile.notes, []
    records = _all_records(hostile)
    first_rc = notes.get("first_rc")
    out.append(Verdict("exit status (hostile run)", hostile.returncode == 0 and first_rc is None,
                       f"{hostile.returncode}" if first_rc is None else
                       f"{first_rc} after the rollback: \"{notes.get('refusal')}\" (the run, started again from step 0 "
                       f"without the liar, checks that its boards are idle while they still end the attempt it threw "
                       f"away); `train --resume` then: {hostile.returncode}"))
    steps = count_steps(records, hostile.steps)
    out.append(Verdict("every step once in metrics.jsonl (hostile)", steps.ok,
                       steps.describe() + f" (the file written again from step 0 {tail.rewinds} time(s))"))
    record = audit_record(hostile.run_dir)
    rollbacks = record.get("rollbacks") or []
    failure = rollbacks[0]["failures"][0] if rollbacks and rollbacks[0].get("failures") else {}
    named = f"board {liar} failed its audit at step" in hostile.output
    rolled = "rolled the run back to step 0" in hostile.output
    ok = named and rolled and failure.get("board_id") == liar and len(rollbacks) == 1 and lie_from <= int(failure.get("step", -1))
    out.append(Verdict(f"liar {liar}: failed its audit, run rolled back", ok,
                       (f"lies x{failure.get('scale', 0):.0f} from step {lie_from}; failed its audit at step "
                        f"{failure.get('step')} ({failure.get('part')}, relative distance {failure.get('distance', 0):.3g}); "
                        f"rolled back to step {rollbacks[0].get('to_step')}, on with {'+'.join(rollbacks[0].get('boards_left', []))} "
                        f"at {','.join(map(str, rollbacks[0].get('batch_sizes', [])))}" if rollbacks else
                        "no rollback in audits.json")
                       + ("" if named else "; not named in the output") + ("" if rolled else "; no rollback note")
                       + (f"; {len(rollbacks)} rollbacks" if len(rollbacks) > 1 else "")))
    wrong = [int(r["step"]) for r in records if list(r["boards"]) != honest or int(r["n"]) != sum(job.batch_sizes)]
    global_batch = int(quiet.records[0]["n"]) if quiet.records else 0
    out.append(Verdict("after the rollback: the honest boards, the quiet run's global batch",
                       bool(not wrong and records and int(records[0]["n"]) == global_batch),
                       f"{len(records)} steps on {'+'.join(honest)}, n={records[0]['n'] if records else '?'} "
                       f"(quiet n={global_batch})" + ("" if not wrong else f"; other boards or n at {wrong[:8]}")))
    final_q, final_h = _model(quiet), _model(hostile)
    resplit = list(rollbacks[0].get("batch_sizes", [])) if rollbacks else []
    if final_q is None or final_h is None:
        out.append(Verdict("final model vs the quiet run's", False, "no model.pt"))
    elif resplit == list(quiet_batches):
        rel, diff = max_relative_l2(final_h, final_q), max_abs_diff(final_h, final_q)
        out.append(Verdict("final model vs the quiet run's (the liar changed nothing)", diff == 0.0 or rel <= 1e-5,
                           f"max abs diff {diff:.3g}, largest relative L2 difference of a tensor {rel:.2g}: the rollback's "
                           f"re-split {','.join(map(str, resplit))} is the quiet run's split, so each step sums the same "
                           "gradients in the same order" + (" (bit for bit)" if diff == 0.0 else
                                                            "; not bit for bit, within 1e-5 relative")))
    else:
        rel, diff = max_relative_l2(final_h, final_q), max_abs_diff(final_h, final_q)
        out.append(Verdict("final model vs the quiet run's (the liar changed nothing)", rel <= 1e-5,
                           f"largest relative L2 difference of a tensor {rel:.2g} (limit 1e-5), max abs diff {diff:.2g}: "
                           f"the global batches are the quiet run's, split {','.join(map(str, resplit))} instead of "
                           f"{','.join(map(str, quiet_batches))}, so the sums run in another order (equal up to rounding, "
                           "which Adam amplifies over a long run on a nearly fitted model)"))
    first = tail.before_rollback  # the stall and the slow rejoin happened before the rollback rewrote the file
    stall_step = notes.get("stall_step")
    late = late_steps(first, stall)
    dropped_note = f"board {stall} left: dropped from the job's steps" in hostile.output
    drop = next((int(r["step"]) for r in sorted(first, key=lambda r: int(r["step"]))
                 if stall_step is not None and int(r["step"]) > int(stall_step) and stall not in r["boards"]
                 and stall not in (r.get("late") or [])), None)
    out.append(Verdict(f"stopped worker ({stall}): dropped", stall_step is not None and dropped_note and drop is not None
                       and len(late) >= 1,
                       f"SIGSTOP at step {stall_step} for {notes.get('stall_s', 0):.1f} s (deadline "
                       f"{notes.get('deadline_s_stall', 0):.1f} s); late in steps {late[:6]}; left out from step {drop}; "
                       + ("'left: dropped from the job's steps' in the output" if dropped_note else "no drop note in the output")))
    cont = notes.get("cont_step")
    back = next((int(r["step"]) for r in sorted(first, key=lambda r: int(r["step"]))
                 if cont is not None and int(r["step"]) > int(cont) and stall in r["boards"]), None)
    without = [r for r in first if drop is not None and int(r["step"]) >= drop and (back is None or int(r["step"]) < back)]
    out.append(Verdict("while it is out: the others step on", drop is not None and len(without) > 0
                       and all(list(r["boards"]) == [b for b in job.boards if b != stall] for r in without),
                       f"{len(without)} steps on {'+'.join(b for b in job.boards if b != stall)}"
                       + (f" (steps {drop}-{(back if back is not None else '?')})" if drop is not None else "")))
    said = _board_lines(hostile.output, stall, "failed:", "asked it to rejoin", "did not take its welcome")
    end = max((int(r["step"]) for r in first), default=0)
    out.append(Verdict(f"stopped worker ({stall}): rejoined", back is not None,
                       f"SIGCONT after step {cont}; " + (f"in the steps again from step {back}" if back is not None else
                                                         f"not back in the {end - int(cont or 0)} steps to the rollback")
                       + f"; the output: {said['failed:']} 'board {stall} failed' (its worker's job), "
                         f"{said['asked it to rejoin']} 'asked it to rejoin', {said['did not take its welcome']} "
                         "'did not take its welcome or catch up'"))
    period = _median_period(first[: int(stall_step)] if stall_step else first) or 0.0
    quiet_gap = step_gaps(quiet.records, 3, quiet.steps).longest_s
    limit = max(5 * period, quiet_gap)
    slow_to = notes.get("slow_to_step")
    if cont is None or slow_to is None:
        out.append(Verdict("slow rejoin: the steps go on during the welcome", False, "the link was never narrowed"))
    else:
        gaps = step_gaps(first, int(cont), int(slow_to) + 1)
        sent, window = int(notes.get("slow_bytes", 0)), float(notes.get("slow_window_s", 1.0))
        out.append(Verdict("slow rejoin: the steps go on during the welcome", gaps.steps >= 2 and gaps.longest_s <= limit,
                           f"{stall}'s link at 150 KB/s for {window:.0f} s from its SIGCONT: {gaps.steps} steps meanwhile "
                           f"(steps {cont}-{int(slow_to) + 1}), longest gap {gaps.longest_s:.2f} s at step {gaps.at_step} "
                           f"(limit {limit:.2f} s: 5 step periods of {period * 1000:.0f} ms, or the quiet run's longest gap "
                           f"{quiet_gap:.2f} s); {sent / 1e3:.0f} KB reached it ({sent / window / 1e3:.0f} KB/s)"))
        cut = said["did not take its welcome"]
        out.append(Verdict("slow rejoin: welcomed, back in the steps", back is not None and not cut,
                           ("back in the steps from step " + str(back) if back is not None else "never back before the rollback")
                           + (f"; cut off {cut} time(s): 'did not take its welcome or catch up'" if cut else "")))
    return out


def print_verdicts(rows: list[Verdict], quiet: Run, faulted: Run, job: Job, wall_s: float, *, forge_during_join: bool,
                   hostile: Run | None = None, hostile_job: Job | None = None) -> None:
    cells = [[v.check, "pass" if v.ok else "info" if v.ok is None else "FAIL", v.detail] for v in rows]
    timeline = "; ".join(f"{at:.0f} s step {step}: {what}" for at, step, what in faulted.faults.events)
    third = [] if hostile is None or hostile_job is None else [
        f"Hostile run ({hostile.wall_s / 60:.1f} min): {LIAR_MODEL} on {'+'.join(hostile_job.boards)}, batches "
        f"{','.join(map(str, hostile_job.batch_sizes))}, {' '.join(hostile_job.extra)}; "
        + "; ".join(f"{at:.0f} s step {step}: {what}" for at, step, what in hostile.faults.events) + ".",
        "Its split gives the liar a share the rollback's re-split hands back to the others exactly as the quiet run "
        "split them, so its model is compared with the quiet run's bit for bit (within 1e-5 relative where the "
        "re-split differs: another summation order)."]
    caption = "\n".join([
        f"LeNet-5 on digits, boards {'+'.join(job.boards)}, batches {','.join(map(str, job.batch_sizes))}, "
        f"{faulted.steps} steps, seed 0, --no-rebalance. Quiet run {quiet.wall_s / 60:.1f} min, faulted run "
        f"{faulted.wall_s / 60:.1f} min; {wall_s / 60:.1f} min in all.",
        f"Faults: {timeline}.", *third,
        "Exact comparison: everything before the kill (bit for bit). After it the global batch is smaller by the dead "
        "board's share (docs/training.md: a board that dies is dropped and the job finishes on the others).",
        "Junk: malformed messages from the start; forged and replayed commands and a forged offline status "
        + ("from the start (--forge-during-join)." if forge_during_join else
           "from the first step on: while boards join, one of them fails the job (the board's signed refusal of a forged "
           "command, or a forged offline status, drops it; --forge-during-join shows it)."),
    ])
    print_table("Fault soak: a board killed, the broker restarted, the coordinator paused, junk every second; "
                "a lying board, a stopped worker, a slow rejoin",
                ["check", "result", "detail"], cells, caption=caption, left_columns=3, min_width=160)


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each run (default 10)")
    parser.add_argument("--quick", action="store_true", help="2-minute runs, for trying the soak")
    parser.add_argument("--boards", default="pi4-1,pi5-1,x86-1", help="the job's boards, of mixed4 (default pi4-1,pi5-1,x86-1)")
    parser.add_argument("--global-batch", type=int, default=64, help="split in proportion to the CPU quotas (default 64)")
    parser.add_argument("--kill", default="pi4-1", help="the board whose agent is killed and restarted (default pi4-1)")
    parser.add_argument("--junk-board", default="pi5-1", help="the board whose topics get the junk (default pi5-1)")
    parser.add_argument("--hostile", default="nano-1", help="the lab board the junk comes from, not in the job (default nano-1)")
    parser.add_argument("--forge-during-join", action="store_true",
                        help="forged commands and statuses while the boards join too (by default from the first step "
                             "on): shows how one forged command fails the job there")
    parser.add_argument("--broker-down", type=float, default=5.0, help="seconds the broker stays down (default 5)")
    parser.add_argument("--liar", default="nano-1", help="the board that joins the hostile run and lies in its gradient, "
                                                         "not in --boards (default nano-1)")
    parser.add_argument("--lie-factor", type=float, default=2000.0, help="the liar's gradient is this many times the "
                                                                          "honest one (default 2000)")
    parser.add_argument("--stall", default="x86-1", help="the board whose training worker is stopped, then rejoins over a "
                                                         "slow link, in the hostile run (default x86-1)")
    parser.add_argument("--audit-every", type=int, default=AUDIT_EVERY,
                        help=f"the hostile run's train --audit-every (default {AUDIT_EVERY})")
    parser.add_argument("--no-hostile", action="store_true", help="leave the third run (the liar, the stopped worker, "
                                                                  "the slow rejoin) out")
    parser.add_argument("--keep-runs", type=Path, metavar="DIR", help="keep the run directories, logs and checkpoints here")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes = 2.0
    boards = [b.strip() for b in args.boards.split(",") if b.strip()]
    if args.kill not in boards or args.junk_board not in boards or args.kill == args.junk_board:
        parser.error(f"--kill and --junk-board must be two different boards of --boards ({','.join(boards)})")
    if args.hostile in boards:
        parser.error(f"--hostile {args.hostile} must not be in --boards: it is the attacker")
    if len(boards) < 2:
        parser.error("--boards needs at least two boards: the job must go on once one is killed")
    if args.liar in boards:
        parser.error(f"--liar {args.liar} must not be in --boards: it joins the hostile run only")
    if args.stall not in boards:
        parser.error(f"--stall must be one of --boards ({','.join(boards)})")
    args.boards = boards
    return args


def _soak(args: argparse.Namespace, tmp: Path) -> int:
    from edgefleet.lab.fleet_file import load_fleet
    from edgefleet.lab.lab import Lab

    started = time.monotonic()
    fleet = load_fleet(FLEET)
    quotas = {b.id: b.cpu for b in fleet.boards}
    unknown = [b for b in [*args.boards, args.hostile, args.liar] if b not in quotas]
    if unknown:
        print(f"fault_soak: {', '.join(unknown)} not in {FLEET.name} (its boards: {', '.join(quotas)})", file=sys.stderr)
        return 2
    key_file = write_fleet_key(tmp / "fleet.key", ed25519=True)
    # the hostile run's model is tests.hostile.lying_module: the coordinator and the agents (which run in the
    # boards' homes and inherit this environment) import it from the repository
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    batches = split_batch([quotas[b] for b in args.boards], args.global_batch)
    print(f"fault_soak: {args.minutes:g}-minute runs on {'+'.join(args.boards)} (batches {','.join(map(str, batches))}); "
          f"kill {args.kill}, junk on {args.junk_board} from {args.hostile}", file=sys.stderr, flush=True)
    with Lab(fleet, fleet_key_file=key_file, agent_settings=KEEP_WORKER, logs_dir=tmp / "lab-logs") as lab:
        lab.wait_online(timeout_s=120)
        job = Job(lab, key_file, list(args.boards), batches, tmp)
        steps, period = _calibrate(job, args.minutes)
        print(f"  calibration: {period * 1000:.0f} ms a step: {steps} steps", file=sys.stderr, flush=True)
        limit = 3 * args.minutes * 60 + 300
        wait_ready(lab, args.boards)
        print("  quiet run", file=sys.stderr, flush=True)
        quiet = run_job(job, "quiet", steps, time_limit_s=limit)
        wait_ready(lab, args.boards)
        stats = tmp / "junk-stats.json"
        hostile = lab.start_in_board(args.hostile, "hostile-junk", [
            sys.executable, str(BENCH / "fault_soak_junk.py"), "--broker", lab.broker_address, "--board", args.junk_board,
            "--other", next(b for b in args.boards if b != args.junk_board), "--run-dir", str(tmp / "faulted"),
            "--stats", str(stats), *(["--forge-during-join"] if args.forge_during_join else [])])
        print("  faulted run", file=sys.stderr, flush=True)
        try:
            faulted = run_job(job, "faulted", steps, time_limit_s=limit,
                              schedule=Schedule(job, steps, kill=args.kill, broker_down_s=args.broker_down))
        finally:
            lab.supervisor.stop(hostile)
        junk = json.loads(stats.read_text()) if stats.exists() else {}
        hostile_run = hostile_job = hostile_tail = None
        lie_from = int(LIE_FROM * steps)
        if not args.no_hostile:
            hostile_boards = [*args.boards, args.liar]
            # the liar's batch taken from the others so that the rollback's re-split gives back the quiet run's split
            share = quotas[args.liar] / sum(quotas[b] for b in hostile_boards)
            hostile_batches = liar_split(batches, share) or split_batch([quotas[b] for b in hostile_boards], args.global_batch)
            hostile_job = Job(lab, key_file, hostile_boards, hostile_batches, tmp, model=LIAR_MODEL,
                              extra=("--audit-every", str(args.audit_every)))
            wait_ready(lab, args.boards)
            liar_pid = start_liar(lab, args.liar, f"scale:{args.lie_factor:g}:{lie_from}")
            time.sleep(2)  # its old status is retained as online: let the new agent's own come first
            wait_ready(lab, hostile_boards)
            print(f"  hostile run: {args.liar} lies x{args.lie_factor:g} from step {lie_from} (agent pid {liar_pid}); "
                  f"{args.stall}'s worker stopped at step {int(STALL_AT * steps)}", file=sys.stderr, flush=True)
            hostile_tail = RewindingTail(tmp / "hostile" / "metrics.jsonl")
            schedule = HostileSchedule(lab, stall=args.stall, at_step=int(STALL_AT * steps), deadline=_deadline_s)
            hostile_run = run_job(hostile_job, "hostile", steps, time_limit_s=2 * limit, schedule=schedule,
                                  tail=hostile_tail)
            refusal = _refused_after_rollback(hostile_run)
            if refusal:  # the rollback's restart found a board still ending the attempt it threw away: resume, as an operator would
                hostile_run.notes.update(first_rc=hostile_run.returncode, refusal=refusal)
                print(f"  hostile run: {refusal}; train --resume", file=sys.stderr, flush=True)
                wait_ready(lab, args.boards)
                resumed = run_job(hostile_job, "hostile", steps, time_limit_s=limit, tail=hostile_tail,
                                  command=train_resume_command(lab, key_file, tmp / "hostile"), log_name="hostile-resume")
                hostile_run.returncode, hostile_run.output = resumed.returncode, hostile_run.output + resumed.output
                hostile_run.wall_s += resumed.wall_s
        if args.kill not in [b for b, row in lab.status_json().items() if row.get("state") == "online"]:
            time.sleep(5)  # a restarted agent that came back late in the run: one more look
        after = lab.status_json()
        agent_logs = {p.name: p.read_text(errors="replace") for p in (tmp / "lab-logs").glob("*.log")}
    rows = verdicts(job, quiet, faulted, kill=args.kill, junk_board=args.junk_board, junk=junk, after_status=after,
                    agent_logs=agent_logs, extra_outputs={"hostile": hostile_run.output} if hostile_run else {})
    if hostile_run is not None and hostile_job is not None and hostile_tail is not None:
        rows += hostile_verdicts(hostile_job, quiet, hostile_run, hostile_tail, liar=args.liar, stall=args.stall,
                                 lie_from=lie_from, quiet_batches=batches)
    print_verdicts(rows, quiet, faulted, job, time.monotonic() - started, forge_during_join=args.forge_during_join,
                   hostile=hostile_run, hostile_job=hostile_job)
    return 0 if all(v.ok is not False for v in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("fault_soak: needs root for the lab (network namespaces, cgroups)", file=sys.stderr)
        return 2
    from edgefleet.lab.lab import LabBusy, LabUnavailable

    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    if args.keep_runs:
        args.keep_runs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="efl-soak-") as scratch:
        tmp = Path(args.keep_runs or scratch).resolve()
        try:
            return _soak(args, tmp)
        except (LabUnavailable, LabBusy, TimeoutError, RuntimeError) as exc:
            print(f"fault_soak: could not run: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("fault_soak: interrupted; the lab is down", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
