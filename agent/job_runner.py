"""Runs the training jobs the coordinator sends: verify, start a worker process, relay its events.

The worker is a separate process (``python -m agent.worker``) so that torch and Lightning are
imported only while a job runs, and the agent returns to its idle memory when the job ends. This
module itself imports neither.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from protocol.errors import DecodeError, ProtocolError
from protocol.jobs import JobEvent, StopCommand, TrainCommand, command_from_dict

log = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT_S = 10.0


class JobRunner:
    """At most one job at a time per board.

    Args:
        board_id: this board; a command addressed to another is refused.
        verify: turns a signed payload into its body, raising ProtocolError why not; None when no
            fleet key is configured (every command is then refused).
        publish_event: sends a JobEvent to the coordinator (over MQTT).
        set_busy: called with True when a job starts and False when it ends (the board's status).
    """

    def __init__(self, *, board_id: str, verify: Callable[[bytes], dict] | None,
                 publish_event: Callable[[JobEvent], None], set_busy: Callable[[bool], None]) -> None:
        self.board_id = board_id
        self._verify = verify
        self._publish = publish_event
        self._set_busy = set_busy
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._job_id = ""

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._proc is not None

    def handle(self, payload: bytes) -> None:
        """Called on the MQTT thread for each command; verifies it and never blocks for long."""
        if self._verify is None:
            log.warning("refused a command: no fleet key configured (set security.fleet_key_file)")
            return
        try:
            command = command_from_dict(self._verify(payload))
        except ProtocolError as exc:  # unsigned, forged, stale, replayed or malformed
            log.warning("refused a command: %s", exc)
            return
        if command.board_id != self.board_id:
            log.warning("refused a command for board %r: this is %r", command.board_id, self.board_id)
            return
        if isinstance(command, StopCommand):
            self.stop(command.job_id)
        else:
            self._start(command)

    def _event(self, job_id: str, phase: str, message: str = "", **fields: object) -> None:
        self._publish(JobEvent(job_id=job_id, board_id=self.board_id, phase=phase, message=message,
                               ts=round(time.time(), 3), **fields))  # type: ignore[arg-type]

    def _start(self, command: TrainCommand) -> None:
        with self._lock:
            if self._proc is not None:
                if command.job_id != self._job_id:
                    self._event(command.job_id, "rejected", f"board {self.board_id} is busy with job {self._job_id}")
                return  # a repeated delivery of the running job's command (QoS 1 may duplicate)
            log.info("job %s: starting the training worker (model %s, dataset %s, batch %d)",
                     command.job_id, command.model, command.dataset, command.batch_size)
            self._proc = subprocess.Popen([sys.executable, "-m", "agent.worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self._job_id = command.job_id
        self._set_busy(True)
        self._event(command.job_id, "accepted")
        threading.Thread(target=self._supervise, args=(command, self._proc), name=f"job-{command.job_id}", daemon=True).start()

    def _supervise(self, command: TrainCommand, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        stderr_tail: deque[str] = deque(maxlen=30)
        drain = threading.Thread(target=lambda: stderr_tail.extend(l.decode(errors="replace").rstrip() for l in proc.stderr),  # type: ignore[union-attr]
                                 daemon=True)
        drain.start()
        try:
            proc.stdin.write(json.dumps(command.to_dict()).encode())
            proc.stdin.close()
        except OSError:
            pass  # the worker died at once; its exit code says why below
        ended = False
        for line in proc.stdout:
            try:
                fields = json.loads(line)
                event = JobEvent(job_id=command.job_id, board_id=self.board_id, ts=round(time.time(), 3), **fields)
            except (ValueError, TypeError, DecodeError) as exc:
                log.debug("job %s: worker printed a line that is not an event (%s): %r", command.job_id, exc, line[:200])
                continue
            ended = ended or event.phase in ("finished", "failed")
            self._publish(event)
        code = proc.wait()
        drain.join(timeout=2)
        if not ended:
            tail = " | ".join(stderr_tail)[-600:]
            reason = f"the training worker exited with code {code}" if code >= 0 else f"the training worker was killed by signal {-code}"
            log.warning("job %s: %s: %s", command.job_id, reason, tail)
            self._event(command.job_id, "failed", f"{reason}: {tail}" if tail else reason)
        log.info("job %s: ended (worker exit code %d); back to idle", command.job_id, code)
        with self._lock:
            self._proc, self._job_id = None, ""
        self._set_busy(False)

    def stop(self, job_id: str | None = None, timeout_s: float = WORKER_STOP_TIMEOUT_S) -> None:
        """Stop the running job (all of them when ``job_id`` is None) and wait for its worker."""
        with self._lock:
            proc = self._proc if job_id is None or job_id == self._job_id else None
        if proc is None:
            return
        log.info("job %s: stopping the training worker", job_id or self._job_id)
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
