"""What the benchmarks share: their error, their board processes, the lab's jobs and a few figures.

bench/ is a folder of scripts, not a package: a script runs with bench/ first on ``sys.path`` and
imports the shared modules beside it (``_harness``, ``_table``: the final table, ``_board_queue``:
a board process's result queue). No script imports another script; what two of them need lives
here. (``scaling_figures.py``, ``fault_soak_checks.py`` and ``fault_soak_faults.py`` are no scripts
but a script's parts, free of the lab, which tests load by their file names.) This module imports
the standard library only; edgefleet, numpy and torch are imported where they are used: a
script's ``--help``, and a board process before it has set itself up, pay for none of it.

Sections:

* errors and processes: ``BenchError``, ``die_with_parent`` (PR_SET_PDEATHSIG), ``sigterm_as_ctrl_c``
  (SIGTERM unwinds like Ctrl-C), ``quiet_lightning``, ``host_note``;
* exchange rounds (``exchange_round.py``, ``exchange_tls.py``): the boards' gradients and the
  average they must get, a round's span, the board process's command loop (``serve_board``) and
  the parent's handle on it (``Board``);
* the lab (``scaling.py``, ``fault_soak.py``, ``selection_accuracy.py``): a fleet key, a ``train``
  command line, a running job's metrics, stopping a job, waiting for the boards, the ballast that
  keeps idle boards busy, and when a stolen measurement is taken again (``Retakes``);
* figures: the selection's hit tolerance, and a profile's ceiling (``profile_bound.py``, the
  ceiling ``scaling.py`` prints under its table).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import numpy as np

    from edgefleet.lab.lab import Lab


# ----------------------------------------------------------------------------- errors and processes

class BenchError(Exception):
    """The run could not be made (a process failed or did not start, a phase ran out of time, a signal stopped it)."""


def die_with_parent() -> None:
    """SIGTERM this process if the bench dies (kill -9 included): no orphaned boards."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def sigterm_as_ctrl_c(signum: int, frame: Any) -> NoReturn:
    """A SIGTERM handler: it unwinds like Ctrl-C (the running job is stopped and the lab comes down)."""
    raise KeyboardInterrupt


def quiet_lightning() -> None:
    """Lightning's notes and warnings off (errors stay): a benchmark's output is its figures."""
    import pytorch_lightning  # noqa: F401 - it sets its loggers to INFO on import: import first, then quieten

    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*(GPU|TPU|HPU|IPU).*")
    warnings.filterwarnings("ignore", message=r".*defined a `validation_step` but have no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    lightning = ("pytorch_lightning", "lightning", "lightning_fabric")
    for name in dict.fromkeys([*lightning, "lightning.pytorch", *logging.root.manager.loggerDict]):
        if name.split(".")[0] in lightning:
            logging.getLogger(name).setLevel(logging.ERROR)


def host_note(t0: Any, t1: Any, own_s: float) -> str:
    """Other processes' share of the host while it ran (``psutil.cpu_times`` before and after; ours and our children's out)."""
    delta = {k: getattr(t1, k) - getattr(t0, k) for k in t1._fields}
    everything = sum(delta.values()) or 1.0
    busy = everything - delta.get("idle", 0.0) - delta.get("iowait", 0.0) - delta.get("steal", 0.0)
    return (f"While it ran, other processes used {100 * max(0.0, busy - own_s) / everything:.0f}% of the "
            f"{os.cpu_count()} CPUs and the hypervisor stole {100 * delta.get('steal', 0.0) / everything:.0f}%.")


# ----------------------------------------------------------------------------- exchange rounds

BATCH = 32  # every board's batch size in an exchange round: the average weighs the gradients by it


def base_vector(elements: int) -> np.ndarray:
    """The shared direction v: every board's gradient is (i + 1) * v."""
    import numpy as np

    v: np.ndarray = np.random.default_rng(20240601).standard_normal(elements, dtype=np.float32) * np.float32(1e-2)
    return v


def expected_average(v: np.ndarray, n: int) -> np.ndarray:
    import numpy as np

    weights = [BATCH] * n
    average: np.ndarray = v * np.float32(sum(b * (i + 1) for i, b in enumerate(weights)) / sum(weights))
    return average


def check_average(got: np.ndarray, v: np.ndarray, n: int, dtype: str) -> None:
    import numpy as np

    want = expected_average(v, n)
    got32 = np.asarray(got, dtype=np.float32)
    tol = 1e-6 + (2e-3 if dtype == "float16" else 1e-5) * np.abs(want)
    bad = int(np.count_nonzero(np.abs(got32 - want) > tol))
    if bad:
        raise AssertionError(f"{bad} of {want.size} elements of the average are wrong")


def spans(starts: list[list[float]], ends: list[list[float]], warmup: int) -> tuple[list[float], float]:
    """Per timed round: last board done - first board started; and the steady-state period."""
    rounds = len(starts[0])
    out = [max(e[k] for e in ends) - min(s[k] for s in starts) for k in range(warmup, rounds)]
    period = (max(e[-1] for e in ends) - max(e[warmup - 1] for e in ends)) / (rounds - warmup)
    return out, period


def no_apply(avg: np.ndarray, result: Any) -> None:
    """An ExchangeServer's ``apply`` that does nothing: the bench times the round, not the optimizer."""


def serve_board(index: int, conn: Any, run: Callable[[Any, int, dict[str, Any], np.ndarray], Any]) -> None:
    """A board process: waits for commands on ``conn``, answers each with ``run(ExchangeClient, index, cmd, v)``
    (``v`` the command's base vector, made once per size), until ``None`` comes or the parent dies."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    import torch

    torch.set_num_threads(1)
    from edgefleet.agent.worker_exchange import ExchangeClient

    vectors: dict[int, np.ndarray] = {}
    conn.send(("ready", os.getpid()))
    while conn.poll(3600):
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            v = vectors.get(cmd["elements"])
            if v is None:
                vectors.clear()
                v = vectors[cmd["elements"]] = base_vector(cmd["elements"])
            conn.send(("ok", run(ExchangeClient, index, cmd, v)))
        except BaseException as exc:  # reported to the parent, which fails the run with it
            conn.send(("error", f"board {index}: {type(exc).__name__}: {exc}"))


class Board:
    """Handle on one board process: ``target(index, conn)``, which answers every command (``serve_board``).

    ``extra`` goes with every command sent (exchange_tls.py: the board's Ed25519 seed)."""

    def __init__(self, ctx: Any, index: int, target: Callable[[int, Any], None], *, name: str,
                 extra: dict[str, Any] | None = None) -> None:
        self.index = index
        self.extra = dict(extra or {})
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(index, child), name=name, daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: dict[str, Any]) -> None:
        self.conn.send({**cmd, **self.extra} if self.extra else cmd)

    def reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise BenchError(f"board {self.index} did not answer within {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status == "error":
            raise BenchError(payload)
        return payload

    def failed(self) -> str:
        """A pending error reply, if the board already gave up."""
        if self.conn.poll(0):
            status, payload = self.conn.recv()
            return payload if status == "error" else f"board {self.index} answered early: {payload!r:.80}"
        return ""

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        for end in (None, self.proc.terminate, self.proc.kill):
            if end is not None and self.proc.is_alive():
                end()
            self.proc.join(3)
        self.conn.close()


# ----------------------------------------------------------------------------- the lab

KEEP_WORKER = "[training]\nkeep_worker = true\n"  # the agents' settings: one warm training worker per board
STOP_GRACE_S = 60.0      # a job asked to stop (target reached, or out of time) has this long to end
READY_TIMEOUT_S = 120.0  # boards back to online after the previous job
BALLAST_S = 86_400       # how long a ballast would spin if nothing stopped it; it is killed after its run
RECENT_MEASUREMENTS = 6  # retakes pause while none of this many latest measurements was under the steal limit


def write_fleet_key(path: Path, *, ed25519: bool = False) -> Path:
    """A new fleet key at ``path`` (which must not exist), readable by its owner only: a shared HMAC secret
    (legacy), or an Ed25519 private key (the boards then sign their events: ``train --board-keys``)."""
    from edgefleet.transport.fleet_key import generate_key_hex, private_key_text, write_new_key

    write_new_key(path, private_key_text() if ed25519 else generate_key_hex() + "\n")
    return path


def in_coordinator_netns(lab: Lab, cmd: list[str]) -> list[str]:
    """``cmd`` where the fleet file puts the coordinator (its [server] namespace, if any)."""
    if lab.coordinator_netns is not None:
        return ["nsenter", f"--net=/run/netns/{lab.coordinator_netns}", "--", *cmd]
    return cmd


def train_command(lab: Lab, key_file: Path, boards: Sequence[str], batch_sizes: Sequence[int], *options: str,
                  board_keys: bool = False) -> list[str]:
    """``edge-coordinator train`` on the lab's broker with the fleet key, ``boards`` at ``batch_sizes``, then
    ``options`` (model, dataset, length, run directory, ...); ``board_keys``: the lab's board keys too."""
    from edgefleet.launch import module_command

    return module_command("edgefleet.coordinator.cli", "--broker", lab.broker_address, "train", "--fleet-key", str(key_file),
                          *(["--board-keys", str(lab.board_keys_dir)] if board_keys else []),
                          "--boards", ",".join(boards), "--batch", ",".join(map(str, batch_sizes)), *options)


class MetricsTail:
    """The records a running job has appended to its metrics.jsonl so far (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.records: list[Mapping[str, Any]] = []

    def read(self) -> list[Mapping[str, Any]]:
        """The records appended since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.records += new
        return new


def stop_job(proc: subprocess.Popen[bytes], *, grace_s: float = STOP_GRACE_S) -> int:
    """Ask a train job to stop at a step boundary (its Ctrl-C), then kill it if it does not in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def log_tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(lab: Lab, boards: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every board reports itself online and not busy (a job just stopped ends on a slow board a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = lab.status_json()  # edge-coordinator status --json, which waits for the retained statuses
        waiting = [b for b in boards if status.get(b, {}).get("state") != "online"]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"boards not ready after {timeout_s:.0f} s: "
                               + ", ".join(f"{b} {status.get(b, {}).get('state', 'unknown')}" for b in waiting))


@contextlib.contextmanager
def ballast(info: dict[str, dict[str, Any]], idle: list[str]) -> Iterator[None]:
    """Every board in ``idle`` spins at its quota while the block runs (``--ballast``): the lab's
    busy loop in the board's cpu group (its memory limit stays the training worker's), one process
    per core of quota, killed as a process group."""
    from edgefleet.lab.measurements import BUSY_LOOP
    from edgefleet.lab.supervisor import in_cgroups

    procs = [subprocess.Popen(in_cgroups(info[b]["procs_files"], [
        sys.executable, str(BUSY_LOOP), "--seconds", str(BALLAST_S), "--workers", str(max(1, math.ceil(info[b]["cpus"])))],
        name=f"ballast@{b}"), stdout=subprocess.DEVNULL, start_new_session=True) for b in idle]
    try:
        yield
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()


@dataclass
class Retakes:
    """When a measurement the hypervisor stole from is taken again.

    A retake pays only if the host has quiet spells: when none of the last ``RECENT_MEASUREMENTS``
    measurements (first attempts and retakes alike) came under the limit, the host is stolen
    throughout, a retake would cost its time for nothing, and none is made until one does."""

    limit: float      # the share of the CPU above which a measurement is stolen
    most: int         # retakes per measurement
    deadline: float   # time.time() after which none is made
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=RECENT_MEASUREMENTS))  # under the limit?

    def note(self, stolen: float) -> bool:
        """Record one measurement's steal; True when it is under the limit."""
        self.recent.append(stolen <= self.limit)
        return self.recent[-1]

    def again(self, attempts: int) -> bool:
        """Whether a stolen measurement taken ``attempts`` times so far is taken once more."""
        quiet_lately = any(self.recent) or len(self.recent) < RECENT_MEASUREMENTS
        return attempts <= self.most and time.time() < self.deadline and quiet_lately


# ----------------------------------------------------------------------------- figures

HIT_TOLERANCE = 0.03  # a selection is a hit within 3% of the best measured configuration


@dataclass(frozen=True, slots=True)
class BoardCost:
    """One board's step: ``fixed_s + per_sample_s * n``, and its exchange round."""

    board_id: str
    fixed_s: float
    per_sample_s: float
    round_s: float


def board_costs(profile: dict[str, Any], variant: str = "default") -> list[BoardCost]:
    """Fit ``a + b*n`` per board over the profile's points (at least two batch sizes)."""
    import numpy as np

    boards = profile["variants"][variant]["boards"]
    costs = []
    for board in boards:
        points = board["points"]
        sizes = np.array([p["batch_size"] for p in points], dtype=float)
        times = np.array([p["step_time_s"] for p in points], dtype=float)
        per_sample, fixed = np.polyfit(sizes, times, 1)
        size = board["link_round_bytes"]
        round_s = size / board["link_bytes_per_s"] + size / board.get("link_down_bytes_per_s", board["link_bytes_per_s"])
        costs.append(BoardCost(board["board_id"], max(float(fixed), 0.0), float(per_sample), round_s))
    return costs


def period(boards: list[BoardCost], extra_s: dict[str, float], global_batch: int) -> float:
    """The shortest step period ``boards`` can share ``global_batch`` in, each paying ``extra_s`` on top."""
    active = list(boards)
    while True:
        fixed = {b.board_id: b.fixed_s + extra_s[b.board_id] for b in active}
        t = (global_batch + sum(fixed[b.board_id] / b.per_sample_s for b in active)) / sum(1 / b.per_sample_s for b in active)
        slow = [b for b in active if fixed[b.board_id] >= t]
        if not slow or len(slow) == len(active):
            return t
        active = [b for b in active if b not in slow]


def best_by_size(costs: list[BoardCost], extra_s: dict[str, float], global_batch: int) -> dict[int, tuple[float, tuple[str, ...]]]:
    """For each board count, the subset with the shortest period."""
    best: dict[int, tuple[float, tuple[str, ...]]] = {}
    for size in range(1, len(costs) + 1):
        for subset in itertools.combinations(costs, size):
            t = period(list(subset), extra_s, global_batch)
            if size not in best or t < best[size][0]:
                best[size] = (t, tuple(b.board_id for b in subset))
    return best
