"""What TLS costs one gradient-exchange round on the lab's shaped links, against the same round in plaintext.

Issue 23: "The cost of TLS is in the exchange benchmark (target: <= 1.15x the plaintext round on lab links)."

What is measured: for N = 2 and 3 boards and gradients of 0.25 MB (LeNet-5, 61,706 float32) and
4.6 MB (1,150,000 float32), the time of one synchronous round, from the first board starting to
send its gradient until the last board has the average, with the exchange over TLS (the job's
certificate, pinned by the boards; ``transport.exchange_tls``) and in plaintext, measured in turns
in the same run. Both join the same way (an Ed25519 proof per board checked by ``HelloChecker``),
so the only difference is TLS. Every board sends g_i = (i + 1) * v with batch size 32; the first
and the last round's results are checked against sum(b_i g_i) / sum(b_i) on every board.

Links: the coordinator (the real ``ExchangeServer``, asyncio, in a thread of this process) lives in
a private network namespace ``eft-<pid>-c``; board i (a real ``ExchangeClient`` in its own process,
as in bench/exchange_round.py) runs its rounds in a thread that joined namespace ``eft-<pid>-b<i>``.
Each board has its own veth pair to the coordinator's namespace (10.241.<i+1>.2 to 10.241.<i+1>.1),
shaped on both ends by tc tbf at ``--rate-mbit`` (``lab.links.shape``: the lab's burst and queue),
like a board on its own switch port; nothing is added to the root namespace. The loopback rows,
context only, run the same cells inside the coordinator's namespace on 127.0.0.1 without shaping:
there the round is bound by CPU and TLS's crypto shows; the target does not apply to them.

Each cell takes ``--warmup`` untimed rounds, then K timed rounds, back to back (a board sends the
next gradient as soon as it has the average); K is chosen so that a turn lasts about
``TURN_S`` on the link (at least 3), scaled by ``--rounds-scale``. TLS and plaintext take turns,
``TURNS`` times per pass and cell, and alternate which goes first; ``--passes`` passes. The figure
per cell is the median round span over all timed rounds; "turn ratios" is the range of the
TLS/plain ratio of the turns run back to back (how much the shared machine moved the figure).
The link floor is the time the frames need at the shaped rate (both ways, Ethernet framing, less
tbf's burst, which lets the first 5 ms worth through at once after an idle moment). CPU
columns: CPU seconds per timed round of the coordinator process and of the N boards together.
The caption says how busy the rest of the machine was (other processes, hypervisor steal, load).

Measured 2026-11-26 (defaults, 100 Mbit/s; two runs on a quiet hour, other processes ~10 %, no
steal): every shaped cell passes. 0.25 MB 1.02-1.03x (N=2) and 1.05x (N=3), 4.6 MB 1.004-1.008x; the
link, not TLS, sets the round. Loopback (context): TLS 3-5.5x plain, the crypto and the copies on
2 CPUs. Earlier that day, with other work taking 60-90 % of the CPUs, 0.25 MB at N=3 ranged
1.02-1.20x over some twenty runs (6 above 1.15x; either build of transport/exchange_tls.py): there
the round follows the CPU the coordinator gets, and TLS needs more (it encrypts the average once
per board, one board after the other, before each board's link can start).
Before transport/exchange_tls.py set SO_RCVLOWAT under TLS, its coordinator took 110-270 ms of
CPU per 4.6 MB round of 3 boards (a wake-up and an OpenSSL call per TCP segment) against 35-57 ms
after, the 3 boards together 75-150 against 32-48 ms, in six interleaved A/B runs; spans moved
within the noise.

Exit code 0 if every shaped cell is <= 1.15x, 1 if not, 2 if the run could not be made (needs
root, ``ip`` and ``tc``). The run is bounded by ``--max-seconds``; board processes and namespaces
are removed on every exit path (SIGTERM and Ctrl-C included); namespaces left by a run that was
killed (kill -9) are removed by the next run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import math
import multiprocessing as mp
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
from _harness import BATCH, BenchError, Board, check_average, no_apply, serve_board, spans  # bench/: first on sys.path
from _table import print_table

from edgefleet.coordinator.exchange.server import ExchangeServer
from edgefleet.lab.links import LinkError, call_in_netns, delete_netns, shape, tbf_parameters
from edgefleet.lab.links import run as ip_run
from edgefleet.protocol.exchange_auth import HelloChecker, HelloProver
from edgefleet.protocol.signing import ed25519_public_key, generate_ed25519_seed
from edgefleet.transport.exchange_tls import make_job_certificate

SIZES: dict[str, int] = {"0.25 MB": 61_706, "4.6 MB": 1_150_000}  # float32 elements
TURNS: dict[str, int] = {"0.25 MB": 3, "4.6 MB": 1}       # turns of plain and TLS per pass and cell
TURN_S: dict[str, float] = {"0.25 MB": 1.5, "4.6 MB": 5.0}  # about how long one turn's timed rounds last on the link
LOOPBACK_ROUNDS: dict[str, int] = {"0.25 MB": 100, "4.6 MB": 20}
LOOPBACK_TURNS: dict[str, int] = {"0.25 MB": 3, "4.6 MB": 2}
MIN_ROUNDS, MAX_ROUNDS = 3, 40
TARGET_RATIO = 1.15
IMPLS = ("plain", "tls")
PREFIX = "eft-"
JOB = "bench-tls"
LOOPBACK = "loopback"
FRAME_OVERHEAD_BYTES = 128        # a gradient or average frame's header and fields (a bound)
WIRE_PER_PAYLOAD = 1514 / 1448    # Ethernet frame per TCP payload (MSS 1448 with timestamps): what tbf counts
now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process and namespace on the machine


# ----------------------------------------------------------------------------- pure parts (tests/planning)

def link_floor_s(elements: int, rate_bps: float) -> float:
    """The least time one round's frames need on a board's link: its gradient up, then the average down.

    Each frame's first ``burst`` bytes (tbf's bucket, full again after the direction was idle) go at
    once, the rest at the rate, in Ethernet frames.
    """
    burst, _limit = tbf_parameters(int(rate_bps))
    wire = (elements * 4 + FRAME_OVERHEAD_BYTES) * WIRE_PER_PAYLOAD
    return 2 * max(0.0, wire - burst) * 8 / rate_bps


def timed_rounds(label: str, rate_bps: float | None, scale: float = 1.0) -> int:
    """Timed rounds per turn: about ``TURN_S`` of the link's time (loopback: a fixed count), at least 3."""
    if rate_bps is None:
        return max(MIN_ROUNDS, round(LOOPBACK_ROUNDS[label] * scale))
    fit = TURN_S[label] * scale / (link_floor_s(SIZES[label], rate_bps) + 0.002)
    return max(MIN_ROUNDS, min(round(MAX_ROUNDS * scale), round(fit)))


def turn_order(pass_index: int, turns: int) -> list[str]:
    """Which implementation runs when in one pass of a cell: they alternate, and which goes first alternates too."""
    return [impl for t in range(turns)
            for impl in (IMPLS if (pass_index * turns + t) % 2 == 0 else IMPLS[::-1])]


def namespace_names(pid: int, boards: int) -> tuple[str, list[str]]:
    """(coordinator's namespace, boards' namespaces) of the run with process id ``pid``."""
    return f"{PREFIX}{pid}-c", [f"{PREFIX}{pid}-b{i}" for i in range(boards)]


def stale_namespaces(names: list[str], alive: Callable[[int], bool]) -> list[str]:
    """This bench's namespaces whose run is gone (killed before it could clean up)."""
    out = []
    for name in names:
        m = re.fullmatch(rf"{re.escape(PREFIX)}(\d+)-(?:c|b\d+)", name)
        if m and not alive(int(m.group(1))):
            out.append(name)
    return out


def link_addresses(index: int) -> tuple[str, str]:
    """(coordinator's side, board's side) of board ``index``'s link: 10.241.<index+1>.1 and .2."""
    return f"10.241.{index + 1}.1", f"10.241.{index + 1}.2"


def context_label(rate_mbit: float | None) -> str:
    return LOOPBACK if rate_mbit is None else f"{rate_mbit:g} Mbit/s"


@dataclass
class Cell:
    """The figures of one (link, N, gradient size) cell, pooled over turns and passes."""

    context: str
    n: int
    label: str
    floor_s: float | None = None
    spans: dict[str, list[float]] = field(default_factory=dict)       # impl -> timed round spans (s)
    turns: dict[str, list[float]] = field(default_factory=dict)       # impl -> median span of each turn (s)
    server_cpu: dict[str, list[float]] = field(default_factory=dict)  # impl -> coordinator CPU s per round, per turn
    board_cpu: dict[str, list[float]] = field(default_factory=dict)   # impl -> all boards' CPU s per round, per turn

    def add(self, impl: str, round_spans: list[float], server_cpu: float, boards_cpu: float) -> None:
        self.spans.setdefault(impl, []).extend(round_spans)
        self.turns.setdefault(impl, []).append(statistics.median(round_spans))
        self.server_cpu.setdefault(impl, []).append(server_cpu)
        self.board_cpu.setdefault(impl, []).append(boards_cpu)

    def median(self, impl: str) -> float:
        return statistics.median(self.spans[impl]) if self.spans.get(impl) else math.nan

    def ratio(self) -> float:
        return self.median("tls") / self.median("plain")

    def turn_ratios(self) -> list[float]:
        """TLS/plain of the turns run back to back (turn k of each)."""
        return [t / p for t, p in zip(self.turns.get("tls", []), self.turns.get("plain", []))]

    def cpu(self, impl: str, which: str) -> float:
        values = (self.server_cpu if which == "server" else self.board_cpu).get(impl)
        return statistics.median(values) if values else math.nan

    @property
    def shaped(self) -> bool:
        return self.context != LOOPBACK

    def passes(self) -> bool:
        return not self.shaped or self.ratio() <= TARGET_RATIO


# ----------------------------------------------------------------------------- board processes

def _rounds_in_netns(client_class: Any, index: int, cmd: dict[str, Any], v: np.ndarray) -> Any:
    grad = v * np.float32(index + 1)
    return call_in_netns(cmd["netns"], functools.partial(board_rounds, client_class, index, cmd, grad, v))


def board_main(index: int, conn: Any) -> None:
    """A board: runs a series of rounds in the namespace each command names, replies."""
    serve_board(index, conn, _rounds_in_netns)


def board_rounds(client_class: Any, index: int, cmd: dict[str, Any], grad: np.ndarray, v: np.ndarray) -> dict[str, Any]:
    """Join (TLS or not, with this board's Ed25519 proof), run ``total`` rounds, time each; check the averages."""
    board_id = f"board-{index}"
    client = client_class(cmd["host"], cmd["port"], connect_timeout_s=cmd["timeout"], result_timeout_s=cmd["timeout"],
                          tls_sha256=cmd["sha256"])
    try:
        proof = HelloProver("ed25519", cmd["seed"]).prove(JOB, board_id, cmd["sha256"])
        welcome = client.hello(job_id=JOB, board_id=board_id, token="", param_count=grad.size, proof=proof)
        step = welcome.step
        del welcome
        starts, ends, cpu0 = [], [], 0.0
        last = cmd["total"] - 1
        for k in range(cmd["total"]):
            if k == cmd["warmup"]:
                cpu0 = time.process_time()
            t0 = now()
            avg = client.exchange(step=step + k, grad=grad, n=BATCH, loss=1.0, compute_s=0.0)
            t1 = now()
            if k in (0, last):
                check_average(avg, v, cmd["n"], "float32")
            del avg  # a view into the client's receive buffer: release it so the buffer is reused
            starts.append(t0)
            ends.append(t1)
        cpu = (time.process_time() - cpu0) / (cmd["total"] - cmd["warmup"])
    finally:
        client.close()
    return {"starts": starts, "ends": ends, "cpu": cpu}


# ----------------------------------------------------------------------------- the coordinator's side

@dataclass(frozen=True)
class Setup:
    """What one cell's server and boards need to find and trust each other."""

    tls: Any                  # the server's ssl.SSLContext, or None
    sha256: str               # the certificate the boards pin ("" without TLS)
    checker: HelloChecker
    bind: str                 # the server's listening address (in the coordinator's namespace)
    hosts: list[str]          # board i connects to hosts[i]
    netns: list[str]          # board i runs its rounds in netns[i]


async def server_cell(boards: list[Board], n: int, elements: int, total: int, warmup: int, timeout: float, setup: Setup,
                      profiler: cProfile.Profile | None = None) -> tuple[list[dict[str, Any]], float]:
    """One turn: the boards' timings and this process's CPU time per timed round."""
    server = ExchangeServer(job_id=JOB, token="unused", boards=[(f"board-{i}", BATCH) for i in range(n)],
                            param_count=elements, wire_dtype="float32", welcome_state=lambda: (0, {}, {}),
                            tls=setup.tls, checker=setup.checker)
    port = await server.start(setup.bind, 0)
    try:
        for i, board in enumerate(boards[:n]):
            board.send({"host": setup.hosts[i], "netns": setup.netns[i], "port": port, "sha256": setup.sha256,
                        "elements": elements, "n": n, "total": total, "warmup": warmup, "timeout": timeout})
        waiter = asyncio.ensure_future(server.wait_for_boards(timeout, need={f"board-{i}" for i in range(n)}))
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.2)
            problems = [p for p in (b.failed() for b in boards[:n]) if p]
            if problems:
                waiter.cancel()
                raise BenchError("; ".join(problems))
        waiter.result()
        if profiler is not None:
            profiler.enable()
        try:
            cpu0 = 0.0
            for step in range(total):
                if step == warmup:
                    cpu0 = time.process_time()
                server.finished = step == total - 1  # boards close their connection after the last average
                r = await server.run_step(step, apply=no_apply, minimum_deadline_s=timeout)
                if len(r.contributors) != n:
                    raise BenchError(f"step {step}: only {r.contributors} contributed (late {r.late}, refused {r.refused})")
            cpu = (time.process_time() - cpu0) / (total - warmup)
        finally:
            if profiler is not None:
                profiler.disable()
        return [b.reply(timeout) for b in boards[:n]], cpu
    finally:
        await server.close()


# ----------------------------------------------------------------------------- links

class Links:
    """The run's namespaces: the coordinator's, and one per board with a shaped veth pair to it."""

    def __init__(self, boards: int) -> None:
        self.coordinator, self.boards = namespace_names(os.getpid(), boards)
        self.created: list[str] = []

    def create(self) -> None:
        for name in (self.coordinator, *self.boards):
            ip_run(["ip", "netns", "add", name])
            self.created.append(name)
            ip_run(["ip", "-n", name, "link", "set", "lo", "up"])
        for i, board in enumerate(self.boards):
            host_side, board_side = link_addresses(i)
            dev = f"s{i}"
            ip_run(["ip", "-n", self.coordinator, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", board])
            for ns, ifname, address in ((self.coordinator, dev, host_side), (board, "eth0", board_side)):
                ip_run(["ip", "-n", ns, "link", "set", ifname, "addrgenmode", "none"])
                ip_run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname])
                ip_run(["ip", "-n", ns, "link", "set", ifname, "up"])

    def shape(self, rate_bps: int) -> None:
        """Both directions of every board's link at ``rate_bps`` (tbf, the lab's burst and queue)."""
        for i, board in enumerate(self.boards):
            shape(f"s{i}", rate_bps, netns=self.coordinator)  # towards the board: its download
            shape("eth0", rate_bps, netns=board)              # from the board: its upload

    def delete(self) -> None:
        for name in reversed(self.created):
            delete_netns(name)
        self.created.clear()


def remove_stale_namespaces() -> list[str]:
    out = ip_run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.split()]
    stale = stale_namespaces(names, psutil.pid_exists)
    for name in stale:
        delete_netns(name)
    return stale


# ----------------------------------------------------------------------------- the machine

class MachineMeter:
    """How much of the machine other processes and the hypervisor (steal) took during a phase, as vmstat counts it."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(pid) for pid in pids]
        self.totals: dict[str, list[float]] = {}  # phase -> [everything, others, steal, ours]
        self.loads: list[float] = []
        self._t0: Any = None
        self._ours0 = 0.0

    def _ours(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def start(self) -> None:
        self._t0, self._ours0 = psutil.cpu_times(), self._ours()

    def stop(self, phase: str) -> None:
        t1, ours1 = psutil.cpu_times(), self._ours()
        delta = {k: getattr(t1, k) - getattr(self._t0, k) for k in t1._fields}
        everything = sum(delta.values())
        busy = everything - delta.get("idle", 0.0) - delta.get("iowait", 0.0) - delta.get("steal", 0.0)
        ours = ours1 - self._ours0
        sums = self.totals.setdefault(phase, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((everything, max(0.0, busy - ours), delta.get("steal", 0.0), ours)):
            sums[i] += value
        self.loads.append(os.getloadavg()[0])

    def note(self) -> str:
        parts = []
        for phase, (everything, others, steal, ours) in self.totals.items():
            e = everything or 1.0
            parts.append(f"{phase}: the bench {100 * ours / e:.0f} %, other processes {100 * others / e:.0f} %, "
                         f"steal {100 * steal / e:.0f} %")
        load = f"; 1-min load {min(self.loads):.1f}-{max(self.loads):.1f}" if self.loads else ""
        return f"CPU of the machine's {psutil.cpu_count()} CPUs during the timed turns: " + "; ".join(parts) + load


# ----------------------------------------------------------------------------- driving

class Trust:
    """The job's certificate and the boards' keys: a Setup per implementation and context."""

    def __init__(self, links: Links, boards: list[Board]) -> None:
        self.links = links
        self.cert = make_job_certificate(JOB)
        self.keys = {f"board-{b.index}": (ed25519_public_key(b.extra["seed"]),) for b in boards}

    def setup(self, impl: str, shaped: bool) -> Setup:
        sha = self.cert.sha256 if impl == "tls" else ""
        n = len(self.keys)
        if shaped:
            bind, hosts, netns = "0.0.0.0", [link_addresses(i)[0] for i in range(n)], self.links.boards
        else:
            bind, hosts, netns = "127.0.0.1", ["127.0.0.1"] * n, [self.links.coordinator] * n
        return Setup(tls=self.cert.server_context() if impl == "tls" else None, sha256=sha,
                     checker=HelloChecker(board_keys=self.keys, tls_sha256=sha), bind=bind, hosts=hosts, netns=netns)


def run_turn(boards: list[Board], links: Links, setup: Setup, n: int, elements: int, total: int, warmup: int,
             timeout: float, profiler: cProfile.Profile | None = None) -> tuple[list[dict[str, Any]], float]:
    """One turn, the server in a thread that joined the coordinator's namespace."""
    return call_in_netns(links.coordinator, lambda: asyncio.run(
        server_cell(boards, n, elements, total, warmup, timeout, setup, profiler)))


def start_boards(count: int, timeout: float) -> list[Board]:
    """The board processes, ready (torch and the client imported); on failure the ones started are in the list."""
    ctx = mp.get_context("spawn")
    boards: list[Board] = []
    try:
        for i in range(count):
            # Started in the root namespace; each command names the namespace a board runs its rounds in.
            boards.append(Board(ctx, i, board_main, name=f"eft-board-{i}", extra={"seed": generate_ed25519_seed()}))
        for b in boards:
            b.reply(timeout)
    except BaseException:
        stop_boards(boards)
        raise
    return boards


def stop_boards(boards: list[Board]) -> None:
    for b in boards:
        b.stop()
    boards.clear()


def measure(args: argparse.Namespace, links: Links, boards: list[Board], cells: dict[tuple[str, int, str], Cell]) -> str:
    """Every context, cell and implementation, ``--passes`` times; returns the profile's text (if asked for)."""
    trust = Trust(links, boards)
    contexts: list[float | None] = [*args.rate_mbit, *([] if args.no_loopback else [None])]
    meter = args.meter = MachineMeter([os.getpid(), *(b.proc.pid for b in boards)])
    for p in range(args.passes):
        for rate in contexts:
            rate_bps = rate * 1e6 if rate is not None else None
            if rate_bps is not None:
                links.shape(int(rate_bps))
            where = context_label(rate)
            for n in args.boards:
                for label in args.sizes:
                    total = args.warmup + timed_rounds(label, rate_bps, args.rounds_scale)
                    cell = cells.setdefault((where, n, label), Cell(
                        where, n, label, link_floor_s(SIZES[label], rate_bps) if rate_bps else None))
                    meter.start()
                    for impl in turn_order(p, (TURNS if rate_bps else LOOPBACK_TURNS)[label]):
                        replies, cpu = run_turn(boards, links, trust.setup(impl, rate_bps is not None), n, SIZES[label],
                                                total, args.warmup, args.timeout)
                        round_spans, _ = spans([r["starts"] for r in replies], [r["ends"] for r in replies], args.warmup)
                        cell.add(impl, round_spans, cpu, sum(r["cpu"] for r in replies))
                    meter.stop("shaped links" if rate_bps else LOOPBACK)
                    print(f"pass {p + 1}/{args.passes}  {where:>12}  N={n}  {label:>7}:  plain "
                          f"{cell.median('plain') * 1e3:8.2f} ms  TLS {cell.median('tls') * 1e3:8.2f} ms  "
                          f"({cell.ratio():.3f}x)", flush=True)
    if not args.profile:
        return ""
    rate = args.rate_mbit[0]
    links.shape(int(rate * 1e6))
    n, label = max(args.boards), args.sizes[-1]
    total = args.warmup + timed_rounds(label, rate * 1e6, args.rounds_scale)
    profiler = cProfile.Profile()
    run_turn(boards, links, trust.setup("tls", True), n, SIZES[label], total, args.warmup, args.timeout, profiler)
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
    return (f"cProfile of the coordinator's exchange thread during {total} TLS rounds, N={n}, {label}, {rate:g} Mbit/s "
            f"(untimed run), by own time:\n{buf.getvalue()}")


def report(cells: dict[tuple[str, int, str], Cell], args: argparse.Namespace) -> bool:
    rows = []
    passed = True
    order = {context_label(r): i for i, r in enumerate([*args.rate_mbit, None])}
    for (context, n, label), cell in sorted(cells.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], SIZES[kv[0][2]])):
        ratio = cell.ratio()
        ok = cell.passes()
        passed &= ok
        turn_ratios = cell.turn_ratios()
        rows.append([context, str(n), label,
                     f"{cell.floor_s * 1e3:.1f}" if cell.floor_s else "-",
                     f"{cell.median('plain') * 1e3:.2f}", f"{cell.median('tls') * 1e3:.2f}", f"{ratio:.3f}x",
                     ("PASS" if ok else "FAIL") if cell.shaped else "(context)",
                     f"{min(turn_ratios):.2f}-{max(turn_ratios):.2f}" if turn_ratios else "-",
                     f"{cell.cpu('plain', 'server') * 1e3:.1f} | {cell.cpu('tls', 'server') * 1e3:.1f}",
                     f"{cell.cpu('plain', 'board') * 1e3:.1f} | {cell.cpu('tls', 'board') * 1e3:.1f}"])
    rounds = "; ".join(f"{context_label(r)}: " + ", ".join(
        f"{label} {(TURNS if r is not None else LOOPBACK_TURNS)[label]} x "
        f"{timed_rounds(label, r * 1e6 if r is not None else None, args.rounds_scale)}" for label in args.sizes)
        for r in [*args.rate_mbit, *([] if args.no_loopback else [None])])
    title = (f"one exchange round, TLS vs plaintext, boards on shaped veth links (tbf both ways), {os.cpu_count()} CPUs: "
             f"median over {args.passes} passes x turns x timed rounds ({rounds}) of (last board has the average - first board "
             "starts sending); ms")
    caption = (f"Target: TLS <= {TARGET_RATIO}x plain on every shaped link (loopback rows: context, CPU-bound). link floor: "
               "both frames at the link rate with Ethernet framing, less tbf's burst. turn ratios: TLS/plain of the turns run "
               "back to back. "
               "CPU: ms of CPU per timed round of the coordinator process | of all N boards together, plain | TLS. "
               + (args.meter.note() + "." if getattr(args, "meter", None) else ""))
    print_table(title, ["link", "N", "gradient", "link floor", "plain", "TLS", "TLS / plain", f"<= {TARGET_RATIO}x",
                        "turn ratios", "server CPU plain|TLS", "boards CPU plain|TLS"], rows, caption=caption,
                left_columns=3, min_width=175)
    return passed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time one gradient-exchange round over TLS and in plaintext (real ExchangeServer, ExchangeClient "
                    "boards in separate processes), N = 2, 3 boards, 0.25 / 4.6 MB gradients, each board on its own "
                    "tc-shaped veth link; loopback rows as context (target: TLS <= 1.15x plain on the shaped links).",
        epilog="Needs root, `ip` and `tc`: everything runs in private network namespaces eft-<pid>-*, removed at the end. "
               "Exit code 0 if every shaped cell meets the target, 1 if not, 2 if the run failed.")
    parser.add_argument("--rate-mbit", type=float, nargs="+", default=[100.0], metavar="MBIT",
                        help="link rate(s) of every board, both ways, in Mbit/s (default 100; the lab's boards have 20-100)")
    parser.add_argument("--boards", type=int, nargs="+", default=[2, 3], metavar="N", help="board counts (default 2 3)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), metavar="SIZE",
                        help=f"gradient sizes, of {', '.join(SIZES)} (default both)")
    parser.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed rounds per turn (default 2, minimum 1)")
    parser.add_argument("--rounds-scale", type=float, default=1.0, metavar="X",
                        help="scale the timed rounds per turn (default 1: about 1.5 s of link time per turn at 0.25 MB, "
                             "5 s at 4.6 MB, at least 3 rounds)")
    parser.add_argument("--passes", type=int, default=2, metavar="P",
                        help="passes over all cells; plain and TLS alternate which goes first (default 2)")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback rows")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the coordinator during an extra untimed TLS turn of the largest shaped cell")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="bound on each turn (default 60 s)")
    parser.add_argument("--max-seconds", type=float, default=300.0, metavar="S",
                        help="bound on the whole run; cleans up and exits 2 past it (default 300)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.passes < 1 or args.rounds_scale <= 0:
        parser.error("--warmup and --passes must be >= 1, --rounds-scale > 0")
    if any(not 1 <= n <= 8 for n in args.boards):
        parser.error("--boards must be within 1-8")
    if any(not 0.1 <= r <= 10_000 for r in args.rate_mbit):
        parser.error("--rate-mbit must be within 0.1-10000 Mbit/s")
    args.sizes = sorted(set(args.sizes), key=list(SIZES).index)
    args.boards = sorted(set(args.boards))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        print(f"exchange_tls: needs root and iproute2 ({'missing ' + ', '.join(missing) if missing else 'not root'}); "
              "run it as root with `ip` and `tc` on the PATH", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signum}" if signum != signal.SIGALRM
                         else f"the run exceeded --max-seconds {args.max_seconds:.0f}")

    for sig in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, args.max_seconds)
    cells: dict[tuple[str, int, str], Cell] = {}
    links = Links(max(args.boards))
    boards: list[Board] = []
    started = now()
    try:
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed namespaces of an earlier run that was killed: {', '.join(stale)}", flush=True)
        links.create()
        print(f"{os.cpu_count()} CPUs; N = {args.boards}; sizes {', '.join(args.sizes)}; links "
              f"{', '.join(context_label(r) for r in args.rate_mbit)}{'' if args.no_loopback else ' + loopback'}; "
              f"{args.passes} passes; namespaces {links.coordinator}, {', '.join(links.boards)}", flush=True)
        boards = start_boards(max(args.boards), args.timeout)
        profile_text = measure(args, links, boards, cells)
    except (BenchError, LinkError, OSError, subprocess.SubprocessError, AssertionError) as exc:
        print(f"exchange_tls: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("exchange_tls: interrupted", file=sys.stderr)
        return 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # a second signal must not cut the cleanup short
        stop_boards(boards)
        links.delete()
    if profile_text:
        print()
        print(profile_text)
    print(f"\nrun took {now() - started:.0f} s")
    return 0 if report(cells, args) else 1


if __name__ == "__main__":
    sys.exit(main())
