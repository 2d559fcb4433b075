"""Measure what the lab promises: each board's link rate both ways and each board's CPU quota.

Why measured rather than read back from tc and cgroupfs: a tbf with too small a burst, a veth
offload, or a busy host can all make a board slower than its file says while every setting reads
back correctly. The self-check tests, ``edge-lab`` users and benchmarks call these.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edgefleet.lab.lab import Lab
from edgefleet.lab.naming import SERVER, SERVER_ADDRESS
from edgefleet.lab.supervisor import BoardProcess

log = logging.getLogger(__name__)

SCRIPTS = Path(__file__).parent / "scripts"
BULK_TRANSFER = SCRIPTS / "bulk_transfer.py"
BUSY_LOOP = SCRIPTS / "busy_loop.py"
MEMORY_HOG = SCRIPTS / "memory_hog.py"

# A Python process starting on a board with a 0.09-CPU quota needs several seconds.
START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """One bulk TCP transfer through a board's link, counted after its warm-up.

    ``goodput_bps`` is TCP payload; the link's set rate also carries 66 bytes of Ethernet, IP and
    TCP headers per 1448-byte segment, so a perfect link shows a ratio of about 0.956.
    """

    board_id: str
    direction: str        # "up" (board -> host) or "down" (host -> board)
    set_bps: int
    goodput_bps: float
    bytes: int
    seconds: float
    stolen: float = 0.0   # share of the host's CPU the hypervisor took meanwhile (see HostSteal)

    @property
    def ratio(self) -> float:
        return self.goodput_bps / self.set_bps


@dataclass(frozen=True, slots=True)
class CpuMeasurement:
    """CPU time a board's cgroup used while a busy loop ran in it, per second of wall time."""

    board_id: str
    quota: float
    used_cores: float
    seconds: float
    throttled_periods: int
    stolen: float = 0.0   # share of the host's CPU the hypervisor took meanwhile (see HostSteal)

    @property
    def ratio(self) -> float:
        return self.used_cores / self.quota


STOLEN_LIMIT = 0.10  # above this, the host's CPU was not the lab's to measure
TOLERANCE = 0.15     # the tolerance for the whole lab: a rate or quota within 15 % of its setting
ATTEMPTS = 3         # a measurement off its mark is taken again up to this many times in all

M = TypeVar("M")


class HostSteal:
    """The share of the host's CPU time the hypervisor took between its creation and a read of :attr:`share`.

    A virtual machine whose hypervisor steals CPU (``steal`` in ``/proc/stat``; ``st`` in vmstat)
    cannot give its emulated boards their quotas, and their links slow with them: what the lab
    self-checks measure then is the neighbours, not the lab.
    """

    def __init__(self) -> None:
        self._start = _cpu_times()

    @property
    def share(self) -> float:
        end = _cpu_times()
        if self._start is None or end is None:
            return 0.0
        total = sum(end[:8]) - sum(self._start[:8])  # user .. steal; guest time is inside user already
        return (end[7] - self._start[7]) / total if total > 0 else 0.0


def _cpu_times() -> list[int] | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in fields[1:]]
    return values if fields[0] == "cpu" and len(values) >= 8 else None


def skip_if_stolen(*measurements: CpuMeasurement | LinkMeasurement | float) -> None:
    """Skip the calling test, saying why, when the hypervisor took over ``STOLEN_LIMIT`` of the CPU meanwhile.

    Each argument is a measurement or a share (``HostSteal().share`` over a window of one's own).
    """
    stolen = max((m if isinstance(m, float) else m.stolen for m in measurements), default=0.0)
    if stolen > STOLEN_LIMIT:
        import pytest  # only the lab's tests get here; edge-lab runs without pytest

        pytest.skip(f"the hypervisor took {stolen:.0%} of this machine's CPU during the measurement (over "
                    f"{STOLEN_LIMIT:.0%}): the boards' quotas and rates cannot be checked on a CPU that is not ours")


def on_mark(*measurements: CpuMeasurement | LinkMeasurement) -> bool:
    """Every measurement within ``TOLERANCE`` of what it was set to."""
    return all(abs(m.ratio - 1) <= TOLERANCE for m in measurements)


def first_that_holds(measure: Callable[[], M], holds: Callable[[M], bool], *, attempts: int = ATTEMPTS) -> M:
    """Take ``measure()`` up to ``attempts`` times; the first result that ``holds``, else the last one.

    A lab setting that is wrong (a tbf burst too small, a quota not written) is off on every
    attempt, so the check still fails; a host whose hypervisor took the CPU for a second (steal
    just under ``STOLEN_LIMIT`` is enough to slow a 90 Mbit/s link by a fifth) is off on one.
    A result that holds counts however much was stolen meanwhile. When none holds and the
    hypervisor took over ``STOLEN_LIMIT`` during the last, the calling test is skipped, saying so.
    ``measure`` returns a measurement or a dict of them (one per board).
    """
    result = measure()
    for attempt in range(2, attempts + 1):
        if holds(result):
            return result
        log.warning("measurement off its mark (%r); taking it again (%d of %d)", result, attempt, attempts)
        result = measure()
    if not holds(result):
        skip_if_stolen(*(result.values() if isinstance(result, dict) else [result]))
    return result


def expect_line(bp: BoardProcess, prefix: str, *, timeout_s: float) -> str:
    """The next line of ``bp`` (started with ``capture_stdout=True``), which must start with ``prefix``.

    Raises:
        RuntimeError: another line, or none within ``timeout_s``, naming the process, whether it lives, and its log.
    """
    line = bp.readline(timeout_s=timeout_s)
    if not line.startswith(prefix):
        raise RuntimeError(f"board {bp.board_id}: {bp.name} said {line!r} instead of {prefix!r}... "
                           f"(alive: {bp.alive()}; log: {bp.log()[-500:]})")
    return line


def measure_link(lab: Lab, board_id: str, direction: str, *, seconds: float = 1.5) -> LinkMeasurement:
    """A bulk TCP transfer between the host (at the bridge address) and a board, in one direction.

    The board's end runs inside the board (namespace and cgroups), like any board process;
    ``board_id`` may also be ``naming.SERVER`` for the server namespace's link. The receiver
    skips the first quarter-second of traffic (TCP slow start and tbf's bucket), then counts for
    ``seconds``; the transfer is bounded by both time and bytes.
    """
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")
    if board_id == SERVER:
        assert lab.fleet.server is not None, "this fleet has no [server]"
        address, rates, start = SERVER_ADDRESS, lab.fleet.server, lab.start_in_server
        set_bps = rates.rate_up_bps if direction == "up" else rates.rate_down_bps
    else:
        board = lab.board(board_id)
        address = board.address
        set_bps = board.spec.rate_up_bps if direction == "up" else board.spec.rate_down_bps

        def start(name: str, argv: list[str], **kw: bool) -> BoardProcess:
            return lab.start_in_board(board_id, name, argv, **kw)
    warmup = max(128 * 1024, int(set_bps / 8 * 0.25))
    max_bytes = int(set_bps / 8 * (seconds + 2) * 1.5) + warmup
    common = ["--warmup-bytes", str(warmup), "--seconds", str(seconds), "--max-bytes", str(max_bytes),
              "--max-seconds", str(seconds + 20)]
    board_role, host_role = ("send", "recv") if direction == "up" else ("recv", "send")
    server = start(f"bulk-{direction}", [sys.executable, str(BULK_TRANSFER), "listen", "--bind", str(address),
                                         "--role", board_role, *common], capture_stdout=True, expect_exit=True)
    try:
        port = expect_line(server, "listening", timeout_s=START_TIMEOUT_S).split()[1]
        steal = HostSteal()
        client = subprocess.run([sys.executable, str(BULK_TRANSFER), "connect", "--to", f"{address}:{port}",
                                 "--role", host_role, *common], capture_output=True, text=True, timeout=seconds + 40, check=False)
        if client.returncode != 0:
            raise RuntimeError(f"host side of the transfer failed ({client.returncode}): {client.stderr.strip()[-500:]}")
        result_line = client.stdout.strip() if host_role == "recv" else server.readline(timeout_s=seconds + 20)
        result = json.loads(result_line)
    finally:
        lab.supervisor.stop(server)
    m = LinkMeasurement(board_id, direction, set_bps, float(result["bits_per_s"]), int(result["bytes"]), float(result["seconds"]),
                        steal.share)
    log.info("board %s %s: %.2f Mbit/s goodput for %.0f Mbit/s set (%.3f)", board_id, direction, m.goodput_bps / 1e6,
             set_bps / 1e6, m.ratio)
    return m


def measure_cpu(lab: Lab, board_ids: list[str], *, seconds: float = 2.0) -> dict[str, CpuMeasurement]:
    """Run a busy loop in each of ``board_ids`` at once; each board's cpuacct usage per wall second.

    The loop runs in ``ceil(quota)`` processes so a quota above one core can be reached. Usage is
    the whole cgroup's (the agent's share included): the quota caps the cgroup, not the loop.
    """
    procs: dict[str, BoardProcess] = {}
    try:
        for board_id in board_ids:
            quota = lab.board(board_id).spec.cpu
            procs[board_id] = lab.start_in_board(
                board_id, "busy-loop", [sys.executable, str(BUSY_LOOP), "--seconds", str(seconds + START_TIMEOUT_S),
                                        "--workers", str(max(1, math.ceil(quota)))], capture_stdout=True, expect_exit=True)
        for bp in procs.values():
            expect_line(bp, "started", timeout_s=START_TIMEOUT_S)
        groups = {b: lab.board(b).cgroup for b in board_ids}
        before = {b: (g.cpu_usage_ns(), g.throttled()[0]) for b, g in groups.items()}
        t0, steal = time.monotonic(), HostSteal()
        time.sleep(seconds)  # the measuring window itself, not a wait for anything
        elapsed, stolen = time.monotonic() - t0, steal.share
        after = {b: (g.cpu_usage_ns(), g.throttled()[0]) for b, g in groups.items()}
    finally:
        for bp in procs.values():
            lab.supervisor.stop(bp)
    out = {}
    for b in board_ids:
        used = (after[b][0] - before[b][0]) / 1e9 / elapsed
        out[b] = CpuMeasurement(b, lab.board(b).spec.cpu, used, elapsed, after[b][1] - before[b][1], stolen)
        log.info("board %s: %.3f cores used for a %.2f quota (%.3f; hypervisor steal %.0f%%)", b, used, out[b].quota,
                 out[b].ratio, 100 * stolen)
    return out


__all__ = ["BULK_TRANSFER", "BUSY_LOOP", "MEMORY_HOG", "STOLEN_LIMIT", "CpuMeasurement", "HostSteal", "LinkMeasurement",
           "expect_line", "measure_cpu", "measure_link", "skip_if_stolen"]
