"""Runs the jobs the coordinator sends: verify, hand them to a worker process, relay its events.

The worker is a separate process (``python -m agent.worker``) so that torch and Lightning are
imported only while a job runs, and the agent returns to its idle memory when the job ends. This
module itself imports neither.

The worker reads one job per line on its stdin (``{"command": {...}, "board": {...}}``) and writes
events as JSON lines on its stdout. By default its stdin is closed after the job, so it runs that
one job and exits. With ``[training] keep_worker = true`` the worker is kept after a job that
finished and the next job goes to the same process, which saves the import (~20 s on a board
limited to a fraction of a CPU). A stop command during a job still ends the worker; the next job
starts a new one. A job that arrives while the last job's worker is exiting (it finished, the
process is still ending) starts as soon as it has exited, instead of being refused as busy.

A run is its job id and its exchange port: a re-planned run of a job (a pipeline revised around a
board) keeps the id on a new exchange. Its command replaces an earlier run still going here (that
worker is stopped and its events dropped: the coordinator has left that run), and a stop naming
the earlier run's port never ends the new one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.heap import worker_environment
from edgefleet.launch import module_command
from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.jobs import JobEvent, ProfileCommand, StopCommand, TrainCommand, command_from_dict
from edgefleet.protocol.signing import SignatureError, unverified_address
from edgefleet.transport.log_limit import LogLimiter, suppressed_text

log = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT_S = 10.0
STOP_GRACE_S = 2.0  # a kept worker whose job ends by itself this soon after a stop is kept
REFUSAL_LOG_BURST = 5     # "refused a command" warnings a minute; the rest are counted
REFUSAL_INTERVAL_S = 1.0  # at most one refusal event a second: junk on the command topic cannot make a board chatty
PROGRESS_JSON_INTERVAL_S = 1.0  # the JSON copy of the events carries at most one progress event a second
MAX_EVENT_JSON_BYTES = 16 * 1024  # over this, the JSON copy leaves out the event's data (the msgpack event has it)
_ENDING_PHASES = ("finished", "failed")
# A failed event's ``data["worker"]`` when the worker stays for the next job all the same (a pipeline neighbour's fault,
# ``protocol.errors.NeighbourFault``: the process is sound, and the re-planned job starts without a new one)
KEPT = "kept"


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (a diverged loss) as None: strict JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def event_json(event: JobEvent) -> bytes:
    """The JSON copy of a job event, for JSON tools: its fields as in the msgpack event, unsigned.

    A non-finite number becomes null; an event whose JSON would pass :data:`MAX_EVENT_JSON_BYTES`
    goes without its ``data`` and says so (``"data_omitted": true``).
    """
    fields = _finite(dataclasses.asdict(event))
    payload = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    if len(payload) > MAX_EVENT_JSON_BYTES:
        fields.update(data=None, data_omitted=True)
        payload = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    return payload


class ProgressLimiter:
    """Lets every event through but at most one ``progress`` event of a job per ``interval_s``.

    Progress can come every training step; JSON consumers (dashboards, Node-RED) want a pulse, not
    the firehose. The first progress of a job always passes; the other phases always do.
    """

    def __init__(self, interval_s: float = PROGRESS_JSON_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: tuple[str, float] | None = None  # (job, when) of the last progress let through

    def allow(self, event: JobEvent) -> bool:
        if event.phase != "progress":
            return True
        now = self.clock()
        with self._lock:
            if self._last is not None and self._last[0] == event.job_id and now - self._last[1] < self.interval_s:
                return False
            self._last = (event.job_id, now)
            return True


@dataclass(frozen=True, slots=True, kw_only=True)
class JobProgress:
    """What the board is doing, for its status and telemetry (Home Assistant's state and progress sensors)."""

    activity: str = ""              # "training" or "profiling" while a job runs (protocol.messages.ACTIVITIES); "" idle
    steps_done: int | None = None   # a training job's global steps done (its last progress event's step + 1)
    total_steps: int | None = None  # a training job's global steps in all; None for a profile job or idle


IDLE = JobProgress()


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerContext:
    """What the worker needs to know about its board, sent with every job (the agent's settings)."""

    power_source: str = "auto"   # power.source: the profile reads power from the same source as telemetry
    idle_w: float = 2.7          # power.idle_w, for the estimate
    max_w: float = 6.4           # power.max_w, for the estimate
    sysfs_root: str = "/sys"     # telemetry.sysfs_root
    board_key_file: str = ""     # security.board_key_file: proves this board to the exchange (protocol.exchange_auth)
    fleet_key_file: str = ""     # security.fleet_key_file: a legacy HMAC fleet key proves it instead

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> WorkerContext:
        return cls(power_source=cfg.power.source, idle_w=cfg.power.idle_w, max_w=cfg.power.max_w,
                   sysfs_root=cfg.telemetry.sysfs_root, board_key_file=cfg.security.board_key_file,
                   fleet_key_file=cfg.security.fleet_key_file)

    @classmethod
    def from_dict(cls, data: Any) -> WorkerContext:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


def job_line(command: TrainCommand | ProfileCommand, context: WorkerContext) -> bytes:
    """The line the worker reads for one job."""
    return (json.dumps({"command": command.to_dict(), "board": dataclasses.asdict(context)}) + "\n").encode()


@dataclass(eq=False)
class _Worker:
    """One worker process and what the agent keeps of its stderr."""

    proc: subprocess.Popen[bytes]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))
    jobs: int = 0
    superseded: bool = False  # its run was replaced by a re-planned run of the job: its events are dropped


def run_port(command: TrainCommand | ProfileCommand | None) -> int:
    """The exchange port that tells a job's runs apart (0: a profile, or none)."""
    return command.exchange_port if isinstance(command, TrainCommand) else 0


class JobRunner:
    """At most one job at a time per board.

    Args:
        board_id: this board; a command addressed to another is refused.
        verify: turns a signed payload into its body, raising ProtocolError why not (having recorded
            its nonce, so that it is never accepted twice); None when no fleet key is configured
            (every command is then refused).
        publish_event: sends a JobEvent to the coordinator (over MQTT).
        set_busy: called with True when a job starts and False when it ends (the board's status).
        config: the agent's configuration: ``[training] keep_worker`` and what the worker needs
            to read power (defaults when None).
    """

    def __init__(self, *, board_id: str, verify: Callable[[bytes], dict[str, Any]] | None,
                 publish_event: Callable[[JobEvent], None], set_busy: Callable[[bool], None],
                 config: AgentConfig | None = None) -> None:
        self.board_id = board_id
        self._verify = verify
        self._refusal_log = LogLimiter(burst=REFUSAL_LOG_BURST)
        self._publish = publish_event
        self._set_busy = set_busy
        self.keep_worker = config.training.keep_worker if config is not None else False
        self.context = WorkerContext.from_config(config) if config is not None else WorkerContext()
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._job_id = ""                  # the running job; "" when idle
        self._run_port = 0                 # the running job's exchange port (run_port)
        self._progress = IDLE              # the running job's kind and steps
        self._job_ended = threading.Event()  # the running job's worker said finished or failed
        self._next: TrainCommand | ProfileCommand | None = None  # arrived while the ended job's worker exits
        self._refused_jobs: deque[str] = deque(maxlen=64)  # jobs told why their command was refused
        self._last_refusal = -REFUSAL_INTERVAL_S

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._job_id)

    def progress(self) -> JobProgress:
        """The running job's kind and steps (:data:`IDLE` when none runs); cheap enough for every sample."""
        with self._lock:
            return self._progress

    def handle(self, payload: bytes) -> None:
        """Called on the MQTT thread for each command; verifies it and never blocks for long."""
        if self._verify is None:
            log.warning("refused a command: no fleet key configured (set security.fleet_key_file)")
            self._tell_refusal(payload, f"board {self.board_id} has no fleet key (security.fleet_key_file is not set) and "
                                        "refuses every command: install the coordinator's public key on it (python -m "
                                        "edgefleet.transport.fleet_key --public fleet.key > fleet.pub) and restart edge-agent")
            return
        verified = False
        try:
            body = self._verify(payload)
            verified = True
            command = command_from_dict(body)
        except ProtocolError as exc:  # unsigned, forged, stale, replayed or malformed
            shown = self._refusal_log.allow()  # a flood of junk on the command topic must not fill the journal
            if shown is not None:
                log.warning("refused a command: %s%s", exc, suppressed_text(shown))
            if isinstance(exc, SignatureError) and exc.tell_sender:
                hint = f"; {exc.hint}" if exc.hint else ""
                self._tell_refusal(payload, f"board {self.board_id} refused the command: {exc}{hint}")
            elif verified:  # the fleet's own coordinator sent what this board cannot take (a newer version, say)
                self._tell_refusal(payload, f"board {self.board_id} refused the command: {exc}")
            return
        if command.board_id != self.board_id:
            log.warning("refused a command for board %r: this is %r", command.board_id, self.board_id)
            return
        if isinstance(command, StopCommand):
            self.stop(command.job_id, exchange_port=command.exchange_port)
        else:
            self._start(command)

    def _tell_refusal(self, payload: bytes, message: str) -> None:
        """Answer a command this board cannot accept with a ``rejected`` event, so that its job fails now
        with the reason instead of waiting for the board. Addressed by the ids the command claims (not
        trusted for anything else); once per job and at most one a second, so junk cannot make the board chatty."""
        address = unverified_address(payload)
        if address is None or address[1] != self.board_id:
            return
        job_id = address[0]
        now = time.monotonic()
        with self._lock:
            if job_id in self._refused_jobs or now - self._last_refusal < REFUSAL_INTERVAL_S:
                return
            self._refused_jobs.append(job_id)
            self._last_refusal = now
        self._event(job_id, "rejected", message)

    def _event(self, job_id: str, phase: str, message: str = "", **fields: Any) -> None:
        self._publish(JobEvent(job_id=job_id, board_id=self.board_id, phase=phase, message=message,
                               ts=round(time.time(), 3), **fields))

    def _start(self, command: TrainCommand | ProfileCommand) -> None:
        port = run_port(command)
        with self._lock:
            if self._job_id:
                if (command.job_id, port) == (self._job_id, self._run_port) or (
                        self._next is not None and (command.job_id, port) == (self._next.job_id, run_port(self._next))):
                    return  # a repeated delivery (QoS 1 may duplicate)
                replaced = self._worker if command.job_id == self._job_id and self._next is None else None
                if self._job_ended.is_set() and self._next is None:
                    # The last job is over and its worker is exiting: start this one when it has.
                    log.info("job %s: waits for the worker of job %s to exit", command.job_id, self._job_id)
                    self._next = command
                elif replaced is not None:
                    # The coordinator has left the earlier run of this job (its exchange is closed): end it, then this.
                    log.info("job %s: a re-planned run (exchange port %d) replaces the earlier run (port %d) still "
                             "going here; stopping its worker (pid %d)", command.job_id, port, self._run_port,
                             replaced.proc.pid)
                    replaced.superseded = True
                    self._next = command
                    threading.Thread(target=_end_worker, args=(replaced,), name=f"worker-{replaced.proc.pid}-end",
                                     daemon=True).start()
                else:
                    self._event(command.job_id, "rejected", f"board {self.board_id} is busy with job {self._job_id}")
                return
            worker = self._worker
            if worker is not None and worker.proc.poll() is None:
                log.info("job %s: %s; sending it to the running worker (pid %d)", command.job_id, _describe(command),
                         worker.proc.pid)
            else:
                log.info("job %s: %s; starting a worker", command.job_id, _describe(command))
                worker = self._worker = self._spawn()
            worker.jobs += 1
            worker.stderr_tail.clear()
            self._job_id = command.job_id
            self._run_port = port
            self._progress = (JobProgress(activity="training", total_steps=command.total_steps)
                              if isinstance(command, TrainCommand) else JobProgress(activity="profiling"))
            self._job_ended.clear()
        self._set_busy(True)
        self._event(command.job_id, "accepted")
        stdin = worker.proc.stdin
        assert stdin is not None
        try:
            stdin.write(job_line(command, self.context))
            stdin.flush()
            if not self.keep_worker:
                stdin.close()  # one job per worker: it exits when the job ends
        except (OSError, ValueError):
            pass  # the worker died (or closed its stdin); its exit code is reported by its reader thread

    def _spawn(self) -> _Worker:
        proc = subprocess.Popen(module_command("edgefleet.agent.worker"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=worker_environment())
        worker = _Worker(proc)
        assert proc.stderr is not None
        threading.Thread(target=_drain, args=(proc.stderr, worker.stderr_tail), name=f"worker-{proc.pid}-stderr",
                         daemon=True).start()
        threading.Thread(target=self._relay, args=(worker,), name=f"worker-{proc.pid}", daemon=True).start()
        return worker

    def _current_job(self, worker: _Worker) -> str:
        with self._lock:
            return self._job_id if self._worker is worker else ""

    def _relay(self, worker: _Worker) -> None:
        """Publish the worker's events as the running job's, until the worker exits."""
        proc = worker.proc
        assert proc.stdout is not None
        for line in proc.stdout:
            job_id = self._current_job(worker)
            if worker.superseded:
                continue  # a run the coordinator has left: a late event would read as the new run's
            try:
                fields = json.loads(line)
                event = JobEvent(job_id=job_id, board_id=self.board_id, ts=round(time.time(), 3), **fields)
            except (ValueError, TypeError, DecodeError) as exc:
                log.debug("worker %d printed a line that is not an event (%s): %r", proc.pid, exc, line[:200])
                continue
            if not job_id:
                log.debug("worker %d sent a %s event with no job running; dropped", proc.pid, event.phase)
                continue
            if event.phase == "progress" and event.step is not None:
                self._note_step(job_id, event.step)
            self._publish(event)
            if event.phase in _ENDING_PHASES:
                self._job_ended.set()
                kept = event.phase == "finished" or (event.data or {}).get("worker") == KEPT
                if self.keep_worker and kept:
                    self._end_job(job_id, f"{event.phase}; worker {proc.pid} stays for the next job")
        code = proc.wait()
        job_id = self._current_job(worker)
        if job_id and not self._job_ended.is_set() and not worker.superseded:
            tail = " | ".join(worker.stderr_tail)[-600:]
            reason = (f"the worker exited with code {code}" if code >= 0 else f"the worker was killed by signal {-code}"
                      + (" (SIGKILL: most often the kernel's out-of-memory killer; this board's memory may be too small "
                         "for the job: a smaller batch or model, or a pipeline that splits the model across boards)"
                         if -code == signal.SIGKILL else ""))
            log.warning("job %s: %s: %s", job_id, reason, tail)
            self._event(job_id, "failed", f"{reason}: {tail}" if tail else reason)
        with self._lock:
            if self._worker is worker:
                self._worker = None
            waiting, self._next = self._next, None
        if job_id:
            self._end_job(job_id, f"worker exit code {code}")
        else:
            log.info("worker %d exited (code %d) after %d job(s)", proc.pid, code, worker.jobs)
        if waiting is not None:
            self._start(waiting)

    def _note_step(self, job_id: str, step: int) -> None:
        with self._lock:
            if self._job_id == job_id and self._progress.total_steps is not None:
                self._progress = dataclasses.replace(self._progress, steps_done=step + 1)  # step: 0-based, just done

    def _end_job(self, job_id: str, how: str) -> None:
        with self._lock:
            if self._job_id != job_id:
                return
            self._job_id = ""
            self._progress = IDLE
        log.info("job %s: ended (%s); back to idle", job_id, how)
        self._set_busy(False)

    def stop(self, job_id: str | None = None, timeout_s: float = WORKER_STOP_TIMEOUT_S, *, exchange_port: int = 0) -> None:
        """Stop the running job and wait for its worker to exit.

        ``job_id`` None stops whatever runs and also ends a kept idle worker (the agent is stopping).
        ``exchange_port`` (non-zero) names the run: another run of the job goes on (:func:`run_port`).
        """
        with self._lock:
            worker = self._worker
            running, running_port = self._job_id, self._run_port
            if self._next is not None and job_id in (None, self._next.job_id) and exchange_port in (0, run_port(self._next)):
                log.info("job %s: stopped before it started", self._next.job_id)
                self._next = None
        if worker is None or (job_id is not None and job_id != running):
            return
        if job_id is not None and exchange_port and running_port and exchange_port != running_port:
            log.info("job %s: a stop for its earlier run (exchange port %d); the running one (port %d) goes on",
                     job_id, exchange_port, running_port)
            return
        if job_id is not None and self.keep_worker and self._job_ended.wait(STOP_GRACE_S):
            log.info("job %s: ended on its own; the worker stays", job_id)
            return
        if running:
            log.info("job %s: stopping the worker (pid %d)", running, worker.proc.pid)
        else:
            log.info("stopping the idle worker (pid %d)", worker.proc.pid)
        worker.proc.terminate()
        try:
            worker.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(timeout=5)


def _end_worker(worker: _Worker, timeout_s: float = WORKER_STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; its reader thread sees it exit."""
    worker.proc.terminate()
    try:
        worker.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        worker.proc.kill()


def _describe(command: TrainCommand | ProfileCommand) -> str:
    if isinstance(command, ProfileCommand):
        return (f"profile {command.model} on {command.dataset or command.datamodule} at batch sizes "
                f"{','.join(map(str, sorted(set(command.batch_sizes))))}")
    return f"train {command.model} on {command.dataset}, batch {command.batch_size}"


def _drain(stream: IO[bytes], tail: deque[str]) -> None:
    for raw in stream:
        tail.append(raw.decode(errors="replace").rstrip())


__all__ = ["IDLE", "KEPT", "MAX_EVENT_JSON_BYTES", "PROGRESS_JSON_INTERVAL_S", "JobProgress", "JobRunner", "ProgressLimiter",
           "WorkerContext", "event_json", "job_line", "run_port"]
