"""The fault soak's third run: a board of the job that lies in its gradient, a board whose training worker is
stopped, and that board's rejoin over a slow link (issue 36, items 2-4).

What it does to a running lab job (bench/fault_soak.py runs it, with these parts):

- the liar: ``--liar``'s agent is started again with ``EDGEFLEET_TEST_LIE=scale:2000:FROM`` in its
  environment, and the job's model is ``tests.hostile.lying_module:LyingLeNet`` (LeNet-5; on a board whose
  environment says so, its gradient is scaled from step FROM on, its reported loss stays honest). The
  coordinator's audits by recomputation must find it, leave it out and roll the run back to step 0
  (``metrics.jsonl`` is then written again from step 0: :class:`RewindingTail` keeps what it had);
- the stopped worker: ``--stall``'s training worker (the agent's child running ``edgefleet.agent.worker``)
  is SIGSTOPped for three step deadlines plus a margin, then SIGCONTed;
- the slow rejoin: just before that SIGCONT, the board's link is narrowed (``tc tbf``, both ways) to
  about 150 KB/s for :data:`SLOW_WINDOW_S` while its worker, live again, joins again and reads its
  welcome; then its own rates are put back.

Everything here but :class:`HostileSchedule` is free of the lab's state: pids, /proc, counters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _harness import MetricsTail

if TYPE_CHECKING:
    from fault_soak import Run

    from edgefleet.lab.lab import Lab

LIAR_MODEL = "tests.hostile.lying_module:LyingLeNet"   # importable with the repository on PYTHONPATH
LIE_VARIABLE = "EDGEFLEET_TEST_LIE"
STALL_DEADLINES = 3        # the exchange drops a board that misses this many step deadlines in a row ...
STALL_MARGIN_S = 5.0       # ... so the worker stays stopped this much longer than that
SLOW_RATE_BPS = 1_200_000  # the rejoining board's link while it reads its welcome: 150 KB/s, both ways
SLOW_WINDOW_S = 15.0       # how long the link stays that narrow after the SIGCONT
WORKER_MODULE = "edgefleet.agent.worker"


class RewindingTail(MetricsTail):
    """A :class:`MetricsTail` that notices the file being written anew (a rollback truncates it to step 0 with
    an atomic rename: a new inode): it starts over, keeping what it had read in :attr:`discarded`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.inode: int | None = None
        self.discarded: list[list[Mapping[str, Any]]] = []  # the records of each rewritten file, in order
        self.rewinds = 0

    def read(self) -> list[Mapping[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            self.discarded.append(self.records)
            self.records, self.offset, self.partial = [], 0, b""
            self.rewinds += 1
        self.inode = st.st_ino
        return super().read()

    @property
    def before_rollback(self) -> list[Mapping[str, Any]]:
        """The records of the run's first attempt (before its first rollback), else the current ones."""
        return self.discarded[0] if self.discarded else self.records


def children(pid: int) -> list[int]:
    """The process's children (every thread's), from /proc."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pid(agent_pid: int) -> int | None:
    """The agent's training worker (its child running ``python -m edgefleet.agent.worker``), or None."""
    return next((c for c in children(agent_pid) if WORKER_MODULE in cmdline(c)), None)


def bytes_to(host_if: str) -> int:
    """Bytes sent to a lab board so far: its veth's host end transmits what the board downloads."""
    return int(Path(f"/sys/class/net/{host_if}/statistics/tx_bytes").read_text())


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` in os.environ while the block runs (a lab agent started in it inherits them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_liar(lab: Lab, board: str, lie: str) -> int:
    """Start ``board``'s agent again with ``EDGEFLEET_TEST_LIE=lie`` (its workers inherit it). Returns its pid.

    The lab's ``start_agent`` passes the agent this process's environment, so the variable is put there for
    the moment the agent is started and taken out again: no lab change, and no other agent gets it.
    """
    old = lab.agent(board)
    lab.supervisor.stop(old)
    with environment(**{LIE_VARIABLE: lie}):
        return lab.start_agent(board).pid


class HostileSchedule:
    """The third run's stopped worker and slow rejoin, each started once its step or time is reached.

    What it measured goes to ``run.notes``: ``stall_step``, ``stall_s``, ``deadline_s``, ``cont_step`` (the
    last step before the SIGCONT), ``slow_to_step`` (the last step before the link was put back),
    ``slow_bytes`` / ``slow_window_s`` (sent to the board meanwhile) and ``worker_pid``.
    """

    def __init__(self, lab: Lab, *, stall: str, at_step: int, deadline: Any, slow_rate_bps: int = SLOW_RATE_BPS,
                 slow_window_s: float = SLOW_WINDOW_S) -> None:
        self.lab, self.stall, self.at_step, self.deadline = lab, stall, at_step, deadline
        self.slow_rate_bps, self.slow_window_s = slow_rate_bps, slow_window_s
        self.worker: int | None = None
        self.cont_at: float | None = None   # monotonic: when the worker is to be SIGCONTed
        self.slow_until: float | None = None
        self.bytes_before = 0
        self.done: set[str] = set()

    def due(self, run: Run, tail: MetricsTail, pid: int) -> None:
        step = int(tail.records[-1]["step"]) if tail.records else -1
        now = time.monotonic()
        if "stop" not in self.done and step >= self.at_step and not getattr(tail, "rewinds", 0):
            self.done.add("stop")
            agent = self.lab.agent(self.stall)
            self.worker = worker_pid(agent.pid)
            if self.worker is None:
                run.faults.note(step, f"{self.stall}: no training worker under its agent (pid {agent.pid}): not stopped")
                self.done.update({"cont", "restore"})
                return
            deadline = float(self.deadline(tail.records))
            seconds = STALL_DEADLINES * deadline + STALL_MARGIN_S
            os.kill(self.worker, signal.SIGSTOP)
            self.cont_at = now + seconds
            run.notes.update(stall_step=step, stall_s=seconds, deadline_s_stall=deadline, worker_pid=self.worker)
            run.faults.note(step, f"{self.stall}: training worker (pid {self.worker}) SIGSTOPped for {seconds:.1f} s "
                                  f"({STALL_DEADLINES} step deadlines of {deadline:.1f} s + {STALL_MARGIN_S:g} s)")
        elif "cont" not in self.done and self.cont_at is not None and now >= self.cont_at:
            self.done.add("cont")
            board = self.lab.board(self.stall)
            self.lab.set_link_rate(self.stall, rate_up_bps=self.slow_rate_bps, rate_down_bps=self.slow_rate_bps)
            self.bytes_before = bytes_to(board.host_if)
            self.slow_until = time.monotonic() + self.slow_window_s
            assert self.worker is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker, signal.SIGCONT)
            run.notes.update(cont_step=step)
            run.faults.note(step, f"{self.stall}: link narrowed to {self.slow_rate_bps / 8000:.0f} KB/s, worker SIGCONTed")
        elif "restore" not in self.done and self.slow_until is not None and now >= self.slow_until:
            self.restore(run, step)

    def restore(self, run: Run, step: int) -> None:
        """Put the board's own link rates back (also on every way out of the run)."""
        if "restore" in self.done or "cont" not in self.done:
            return
        self.done.add("restore")
        board = self.lab.board(self.stall)
        sent = bytes_to(board.host_if) - self.bytes_before
        self.lab.set_link_rate(self.stall, rate_up_bps=board.spec.rate_up_bps, rate_down_bps=board.spec.rate_down_bps)
        run.notes.update(slow_to_step=step, slow_bytes=sent, slow_window_s=self.slow_window_s)
        run.faults.note(step, f"{self.stall}: link back to its own rates; {sent / 1e3:.0f} KB sent to it meanwhile")

    def finish(self, run: Run) -> None:
        """Nothing left stopped or narrowed, whatever happened to the run."""
        if self.worker is not None and "cont" not in self.done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker, signal.SIGCONT)
            self.done.add("cont")
            self.slow_until = time.monotonic()
        if "cont" in self.done and "restore" not in self.done:
            step = int(run.records[-1]["step"]) if run.records else -1
            try:
                self.restore(run, step)
            except Exception:  # the link is the lab's; its teardown removes it anyway
                pass


def liar_split(batches: list[int], liar_share: float) -> list[int] | None:
    """Batch sizes for the job's boards plus the liar (last), the same global batch, whose re-split once the
    liar is left out (``coordinator.audit.rollback.without_boards``, the real one) is ``batches`` again: the
    rolled-back run then sums each step's gradients exactly as the quiet run does, so that its model can be
    compared bit for bit. The liar's size is the one nearest ``liar_share`` of the global batch that allows
    it; None when none does."""
    import itertools

    from edgefleet.coordinator.audit.rollback import without_boards
    from edgefleet.coordinator.run.job_spec import JobSpec

    total = sum(batches)
    names = (*(f"b{i}" for i in range(len(batches))), "liar")
    want = max(1, round(liar_share * total))
    for liar in sorted(range(1, total - len(batches) + 1), key=lambda n: (abs(n - want), n)):
        rest = total - liar
        start = [max(1, round(b * rest / total)) for b in batches]
        for nudge in itertools.product((-1, 0, 1), repeat=len(batches)):
            sizes = [s + d for s, d in zip(start, nudge)]
            if sum(sizes) != rest or min(sizes) < 1:
                continue
            spec = JobSpec(model="lenet5", dataset="digits", boards=names, batch_sizes=(*sizes, liar))
            if list(without_boards(spec, {"liar"}).batch_sizes) == list(batches):
                return [*sizes, liar]
    return None
