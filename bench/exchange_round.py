"""One gradient-exchange round on loopback: the real ExchangeServer against a raw-socket round and gloo.

What is measured: for N = 2 and 3 boards and gradients of 0.25 MB (LeNet-5, 61,706 floats),
4.6 MB and 45 MB of float32 (1 MB = 10^6 bytes), the time of one synchronous round, from the first
board starting to send its gradient until the last board has the average. Every board sends a
distinct gradient g_i = (i + 1) * v with batch size b_i = 32; the first round's result is checked
against sum(b_i g_i) / sum(b_i) on every board.

Three implementations, measured in the same run on the same machine:

* ours: the real ``coordinator.exchange.server.ExchangeServer`` (asyncio, in this process, on 127.0.0.1,
  ``apply`` a no-op) and N real ``agent.worker_exchange.ExchangeClient`` boards, each in its own
  process (spawned by multiprocessing; threads would share the GIL with the server). Frames,
  msgpack, validation (shape, dtype, NaN/Inf and norm check) and the weighted reduce included.
* raw (the target's baseline): the same shape with bytes only. Each board sends its buffer over a
  plain TCP socket with ``sendall`` and ``recv_into``s the result; the server (a selector loop in
  this process) ``recv_into``s every board's bytes into preallocated numpy buffers, computes
  sum(b_i g_i) / sum(b_i) with numpy into preallocated buffers (no validation, no framing, no
  encoding) and sends the result back to all boards.
* gloo: ``torch.distributed.all_reduce`` (SUM, then ``div_`` by N, as DDP does) of the same tensors
  over N ranks, in a private network namespace ``efb-gloo-<pid>`` that has only loopback (gloo's
  rendezvous store listens on every interface); the namespace is removed at the end, also on error.

Every board runs ``--warmup`` + K rounds back to back (a board sends the next round's gradient as
soon as it has the previous average: the steady state of a fleet whose compute is negligible);
K = ``--rounds`` at 45 MB, 3x that at 4.6 MB and 10x at 0.25 MB. Times come from CLOCK_MONOTONIC,
which all processes (and namespaces) share. The figure reported per cell is the median over the
timed rounds of the round's span, max_i(board i has the average) - min_i(board i starts sending),
pooled over ``--passes`` passes in which ours and raw alternate which goes first (slow drift of a
shared machine hits both); within a pass they take turns 5 times at 0.25 MB and twice at 4.6 MB
(``ALTERNATIONS``: 200 rounds of 0.25 MB last a fifth of a second, and a burst of the hypervisor's
steal that long would otherwise land on one side only). The table also gives the steady-state
period (timed rounds / wall time of the slowest board) and the CPU time per round of the server
process and of the boards: on a 2-CPU machine shared with other work, a round's wall time follows
the CPU it needs, and the CPU columns show on which side of the wire it goes. The caption says how
much CPU other processes took during the run.

``--wire-dtype`` float32, float16 or both (default): with float16 the gradients and the average
travel as fp16 (the server accumulates in fp32 as it does in production); its raw baseline moves
the same fp16 bytes, and its gloo ratio is against gloo's float32 all_reduce.

Measured 2026-11-24 (defaults, the hypervisor stole 8%): every cell passes. float32 0.25 MB: 1.15x (N=2)
and 1.23x (N=3); 4.6 MB 0.95x and 0.98x; 45 MB 0.93x and 0.80x; float16 0.41x-0.73x of raw's fp16 round. The
0.25 MB cells move with the host: 11 runs of N=2 alone that hour gave 1.04x-1.30x, one 1.65x in a burst of
steal (median 1.25x); the build before (which awaited a whole 0.25 MB frame with SO_RCVLOWAT, so the
server's copy began only once the board had sent it all), run in turn with it, 1.05x-1.44x (median 1.37x).

Target (issue): ours <= 1.3x raw in every cell. The gloo ratio is printed too. ``--profile``
prints a cProfile of the coordinator process during one extra (untimed) run of the largest cell.
The table of figures is printed last. Exit code: 0 if every cell meets the target, 1 if not, 2 if
the run could not be made. The whole run is bounded by ``--max-seconds``; board processes, gloo
processes and the namespace are removed on every exit path (SIGTERM and Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import secrets
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _harness import (  # bench/ is the script's folder, first on sys.path
    BATCH,
    BenchError,
    Board,
    base_vector,
    check_average,
    die_with_parent,
    no_apply,
    serve_board,
    spans,
)

ROOT = Path(__file__).resolve().parent.parent

from edgefleet.coordinator.exchange.server import ExchangeServer

SIZES: dict[str, int] = {"0.25 MB": 61_706, "4.6 MB": 1_150_000, "45 MB": 11_250_000}  # float32 elements
ROUNDS_FACTOR: dict[str, int] = {"0.25 MB": 10, "4.6 MB": 3, "45 MB": 1}  # short rounds get more repeats
ALTERNATIONS: dict[str, int] = {"0.25 MB": 5, "4.6 MB": 2, "45 MB": 1}  # turns of ours and raw per pass and cell
TARGET_RATIO = 1.3
_NUMPY = {"float32": np.float32, "float16": np.float16}
now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process on the machine


# ----------------------------------------------------------------------------- board processes

def _ours_or_raw(client_class: Any, index: int, cmd: dict[str, Any], v: np.ndarray) -> dict[str, Any]:
    grad = (v * np.float32(index + 1)).astype(_NUMPY[cmd["dtype"]])
    run = board_ours if cmd["kind"] == "ours" else board_raw
    return run(client_class, index, cmd, grad, v)


def board_main(index: int, conn: Any) -> None:
    """A board: runs a round series against ours or raw for each command, replies."""
    serve_board(index, conn, _ours_or_raw)


def board_ours(client_class: Any, index: int, cmd: dict[str, Any], grad: np.ndarray, v: np.ndarray) -> dict[str, Any]:
    client = client_class(cmd["host"], cmd["port"], connect_timeout_s=cmd["timeout"], result_timeout_s=cmd["timeout"])
    try:
        welcome = client.hello(job_id=cmd["job_id"], board_id=f"board-{index}", token=cmd["token"],
                               param_count=grad.size)
        step = welcome.step
        del welcome
        starts, ends, cpu0 = [], [], 0.0
        for k in range(cmd["total"]):
            if k == cmd["warmup"]:
                cpu0 = time.process_time()
            t0 = now()
            avg = client.exchange(step=step + k, grad=grad, n=BATCH, loss=1.0, compute_s=0.0)
            t1 = now()
            if k == 0:
                check_average(avg, v, cmd["n"], cmd["dtype"])
            del avg  # a view into the client's receive buffer: release it so the buffer is reused
            starts.append(t0)
            ends.append(t1)
        cpu = (time.process_time() - cpu0) / (cmd["total"] - cmd["warmup"])
    finally:
        client.close()
    return {"starts": starts, "ends": ends, "cpu": cpu}


def board_raw(client_class: Any, index: int, cmd: dict[str, Any], grad: np.ndarray, v: np.ndarray) -> dict[str, Any]:
    sock = socket.create_connection((cmd["host"], cmd["port"]), timeout=cmd["timeout"])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    result = np.empty_like(grad)
    send_view, recv_view = grad.view(np.uint8).data, result.view(np.uint8).data
    size = recv_view.nbytes
    try:
        sock.sendall(struct.pack(">I", index))
        starts, ends, cpu0 = [], [], 0.0
        for k in range(cmd["total"]):
            if k == cmd["warmup"]:
                cpu0 = time.process_time()
            t0 = now()
            sock.sendall(send_view)
            got = 0
            while got < size:
                r = sock.recv_into(recv_view[got:])
                if r == 0:
                    raise ConnectionError("the raw server closed the connection")
                got += r
            t1 = now()
            if k == 0:
                check_average(result, v, cmd["n"], cmd["dtype"])
            starts.append(t0)
            ends.append(t1)
        cpu = (time.process_time() - cpu0) / (cmd["total"] - cmd["warmup"])
    finally:
        sock.close()
    return {"starts": starts, "ends": ends, "cpu": cpu}


# ----------------------------------------------------------------------------- ours

async def ours_cell(boards: list[Board], n: int, elements: int, dtype: str, total: int, warmup: int, timeout: float,
                    profiler: cProfile.Profile | None = None) -> tuple[list[dict[str, Any]], float]:
    """Returns the boards' timings and this process's CPU time per timed round."""
    token = secrets.token_hex(16)
    server = ExchangeServer(job_id="bench", token=token, boards=[(f"board-{i}", BATCH) for i in range(n)],
                            param_count=elements, wire_dtype=dtype, welcome_state=lambda: (0, {}, {}))
    port = await server.start("127.0.0.1", 0)
    try:
        cmd = {"kind": "ours", "host": "127.0.0.1", "port": port, "job_id": "bench", "token": token,
               "elements": elements, "dtype": dtype, "n": n, "total": total, "warmup": warmup, "timeout": timeout}
        for board in boards[:n]:
            board.send(cmd)
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
                # Boards close their connection once they have the last average: that is not a failure.
                server.finished = step == total - 1
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


# ----------------------------------------------------------------------------- raw

def raw_cell(boards: list[Board], n: int, elements: int, dtype: str, total: int, warmup: int,
             timeout: float) -> tuple[list[dict[str, Any]], float]:
    """Returns the boards' timings and this process's CPU time per timed round."""
    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket | None] = [None] * n
    sel = selectors.DefaultSelector()
    try:
        listener.settimeout(timeout)
        port = listener.getsockname()[1]
        cmd = {"kind": "raw", "host": "127.0.0.1", "port": port, "elements": elements, "dtype": dtype, "n": n,
               "total": total, "warmup": warmup, "timeout": timeout}
        for board in boards[:n]:
            board.send(cmd)
        for _ in range(n):
            conn, _peer = listener.accept()
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (index,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
            conns[index] = conn
        socks = [c for c in conns if c is not None]
        for c in socks:
            c.setblocking(False)
        wire = _NUMPY[dtype]
        bufs = [np.empty(elements, dtype=wire) for _ in range(n)]
        acc, scratch = np.empty(elements, dtype=np.float32), np.empty(elements, dtype=np.float32)
        out = acc if dtype == "float32" else np.empty(elements, dtype=wire)
        in_views = [b.view(np.uint8).data for b in bufs]
        out_view = out.view(np.uint8).data
        size = out_view.nbytes
        weights = [np.float32(BATCH)] * n
        deadline, cpu0 = now() + timeout, 0.0
        for k in range(total):
            if k == warmup:
                cpu0 = time.process_time()
            _pump(sel, socks, in_views, size, selectors.EVENT_READ, deadline)
            np.multiply(bufs[0], weights[0], out=acc)
            for i in range(1, n):
                np.multiply(bufs[i], weights[i], out=scratch)
                acc += scratch
            acc /= np.float32(sum(weights))
            if out is not acc:
                np.copyto(out, acc, casting="same_kind")
            _pump(sel, socks, [out_view] * n, size, selectors.EVENT_WRITE, deadline)
        cpu = (time.process_time() - cpu0) / (total - warmup)
        return [b.reply(timeout) for b in boards[:n]], cpu
    finally:
        sel.close()
        for c in conns:
            if c is not None:
                c.close()
        listener.close()


def _pump(sel: selectors.BaseSelector, socks: list[socket.socket], views: list[memoryview], size: int,
          event: int, deadline: float) -> None:
    """Receive ``size`` bytes into (or send them from) each view, all sockets at once."""
    done = [0] * len(socks)
    for i, s in enumerate(socks):
        sel.register(s, event, i)
    pending = len(socks)
    try:
        while pending:
            remaining = deadline - now()
            if remaining <= 0:
                raise BenchError("raw round ran out of time")
            for key, _mask in sel.select(remaining):
                i = key.data
                try:
                    if event == selectors.EVENT_READ:
                        r = socks[i].recv_into(views[i][done[i]:])
                        if r == 0:
                            raise BenchError(f"board {i} closed its raw connection")
                    else:
                        r = socks[i].send(views[i][done[i]:])
                except BlockingIOError:
                    continue
                done[i] += r
                if done[i] == size:
                    sel.unregister(socks[i])
                    pending -= 1
    finally:
        for s in socks:
            try:
                sel.unregister(s)
            except (KeyError, ValueError):
                pass


# ----------------------------------------------------------------------------- gloo (inside the namespace)

def gloo_rank(rank: int, n: int, port: int, spec: dict[str, Any], queue: Any) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=timedelta(seconds=spec["timeout"]))
        out: dict[str, Any] = {}
        for label, elements in spec["sizes"].items():
            total = spec["totals"][label]
            v = base_vector(elements)
            t = torch.from_numpy(v * np.float32(rank + 1))
            starts, ends = [], []
            for k in range(total):
                t0 = now()
                dist.all_reduce(t)
                t.div_(n)
                t1 = now()
                if k == 0:
                    check_average(t.numpy(), v, n, "float32")
                starts.append(t0)
                ends.append(t1)
            out[label] = {"starts": starts, "ends": ends}
            del t, v
        dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException as exc:
        queue.put((rank, "error", f"gloo rank {rank}: {type(exc).__name__}: {exc}"))


def gloo_child(spec: dict[str, Any]) -> int:
    """Runs inside the private namespace; prints one JSON line of timings."""
    die_with_parent()
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    for n in spec["ns"]:
        with socket.socket() as s:  # a free port in this namespace (nothing else lives here)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=gloo_rank, args=(r, n, port, spec, queue), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
        per_rank: dict[int, Any] = {}
        try:
            deadline = now() + spec["timeout"] * (1 + len(spec["sizes"]))
            while len(per_rank) < n:
                rank, status, payload = queue.get(timeout=max(1.0, deadline - now()))
                if status != "ok":
                    print(json.dumps({"error": payload}), flush=True)
                    return 1
                per_rank[rank] = payload
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(2)
        results[str(n)] = {label: {"starts": [per_rank[r][label]["starts"] for r in range(n)],
                                   "ends": [per_rank[r][label]["ends"] for r in range(n)]}
                           for label in spec["sizes"]}
    print(json.dumps(results), flush=True)
    return 0


def run_gloo(ns_list: list[int], sizes: dict[str, int], totals: dict[str, int], timeout: float) -> dict[str, Any]:
    """Create the namespace, run ``gloo_child`` in it, remove the namespace (also on error)."""
    netns = f"efb-gloo-{os.getpid()}"
    ip = shutil.which("ip") or "/usr/sbin/ip"
    subprocess.run([ip, "netns", "add", netns], check=True, capture_output=True, timeout=30)
    proc: subprocess.Popen[str] | None = None
    try:
        subprocess.run([ip, "netns", "exec", netns, ip, "link", "set", "lo", "up"], check=True, capture_output=True,
                       timeout=30)
        links = subprocess.run([ip, "netns", "exec", netns, ip, "-o", "link", "show"], check=True,
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
        names = [line.split(":")[1].strip() for line in links if line.strip()]
        if names != ["lo"]:
            raise BenchError(f"namespace {netns} has interfaces {names}, expected only lo")
        spec = {"ns": ns_list, "sizes": sizes, "totals": totals, "timeout": timeout}
        proc = subprocess.Popen([ip, "netns", "exec", netns, sys.executable, os.path.abspath(__file__),
                                 "--gloo-child", json.dumps(spec)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=str(ROOT),
                                env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
        limit = timeout * (2 + len(sizes)) * len(ns_list)
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            raise BenchError(f"gloo did not finish within {limit:.0f} s") from None
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            raise BenchError(f"gloo child exited with {proc.returncode} and printed no result")
        result = json.loads(lines[-1])
        if "error" in result:
            raise BenchError(result["error"])
        return result
    finally:
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)  # its own session: the child and its rank processes
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        subprocess.run([ip, "netns", "delete", netns], capture_output=True, timeout=30, check=False)


# ----------------------------------------------------------------------------- driving

class CpuMeter:
    """How much of the machine's CPU other processes (and the hypervisor, as steal) took while we measured."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(pid) for pid in pids]
        self.t0, self.ours0 = psutil.cpu_times(), self._ours()

    def _ours(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def summary(self) -> str:
        t1, ours1 = psutil.cpu_times(), self._ours()
        delta = {k: getattr(t1, k) - getattr(self.t0, k) for k in t1._fields}
        everything = sum(delta.values()) or 1.0
        busy = everything - delta.get("idle", 0.0) - delta.get("iowait", 0.0) - delta.get("steal", 0.0)
        others = max(0.0, busy - (ours1 - self.ours0))
        return (f"while ours and raw ran, other processes used {100 * others / everything:.0f} % of the "
                f"{psutil.cpu_count()} CPUs and the hypervisor stole {100 * delta.get('steal', 0.0) / everything:.0f} %")


@dataclass
class Cell:
    n: int
    label: str
    dtype: str
    spans: dict[str, list[float]] = field(default_factory=dict)    # impl -> timed round spans (s)
    periods: dict[str, list[float]] = field(default_factory=dict)  # impl -> steady-state period per pass (s)
    server_cpu: dict[str, list[float]] = field(default_factory=dict)  # impl -> server CPU s per round, per pass
    board_cpu: dict[str, list[float]] = field(default_factory=dict)   # impl -> mean board CPU s per round, per pass

    def add(self, impl: str, replies: list[dict[str, Any]], server_cpu: float, warmup: int) -> None:
        s, period = spans([r["starts"] for r in replies], [r["ends"] for r in replies], warmup)
        self.spans.setdefault(impl, []).extend(s)
        self.periods.setdefault(impl, []).append(period)
        self.server_cpu.setdefault(impl, []).append(server_cpu)
        self.board_cpu.setdefault(impl, []).append(statistics.mean(r["cpu"] for r in replies))

    def cpu(self, impl: str, which: str) -> float:
        values = (self.server_cpu if which == "server" else self.board_cpu).get(impl)
        return statistics.median(values) if values else float("nan")

    def median(self, impl: str) -> float:
        return statistics.median(self.spans[impl]) if self.spans.get(impl) else float("nan")

    def period(self, impl: str) -> float:
        return statistics.median(self.periods[impl]) if self.periods.get(impl) else float("nan")


def rounds_for(args: argparse.Namespace, label: str) -> int:
    return args.rounds * ROUNDS_FACTOR[label]


def measure(args: argparse.Namespace, cells: dict[tuple[int, str, str], Cell]) -> str:
    """Ours and raw, every cell, ``--passes`` times; returns the profile's text (if asked for)."""
    ctx = mp.get_context("spawn")
    boards: list[Board] = []
    profile_text = ""
    try:
        boards = [Board(ctx, i, board_main, name=f"efb-board-{i}") for i in range(max(args.boards))]
        for b in boards:
            b.reply(args.timeout)  # ready: imported torch and the client
        meter = CpuMeter([os.getpid(), *(b.proc.pid for b in boards)])
        for p in range(args.passes):
            for n in args.boards:
                for label in args.sizes:
                    elements, total = SIZES[label], args.warmup + rounds_for(args, label)
                    for dtype in args.dtypes:
                        cell = cells.setdefault((n, label, dtype), Cell(n, label, dtype))
                        turns = ALTERNATIONS[label]
                        order = [impl for t in range(turns)
                                 for impl in (("raw", "ours") if (p * turns + t) % 2 == 0 else ("ours", "raw"))]
                        for impl in order:
                            if impl == "raw":
                                replies, cpu = raw_cell(boards, n, elements, dtype, total, args.warmup, args.timeout)
                            else:
                                replies, cpu = asyncio.run(ours_cell(boards, n, elements, dtype, total, args.warmup,
                                                                     args.timeout))
                            cell.add(impl, replies, cpu, args.warmup)
                        print(f"pass {p + 1}/{args.passes}  N={n}  {label:>7} {dtype}:  ours {cell.median('ours') * 1e3:7.1f} ms"
                              f"  raw {cell.median('raw') * 1e3:7.1f} ms", flush=True)
        args.cpu_note = meter.summary()
        if args.profile:
            n, label = max(args.boards), args.sizes[-1]
            profiler = cProfile.Profile()
            total = args.warmup + rounds_for(args, label)
            asyncio.run(ours_cell(boards, n, SIZES[label], args.dtypes[0], total, args.warmup, args.timeout, profiler))
            buf = io.StringIO()
            pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
            profile_text = (f"cProfile of the coordinator during {total} rounds of ours, N={n}, {label}, "
                            f"{args.dtypes[0]} (untimed run), by own time:\n{buf.getvalue()}")
    finally:
        for b in boards:
            b.stop()
    return profile_text


def report(cells: dict[tuple[int, str, str], Cell], gloo: dict[str, Any], args: argparse.Namespace) -> bool:
    from rich.console import Console
    from rich.table import Table

    gloo_ms: dict[tuple[int, str], float] = {}
    for n_text, by_size in gloo.items():
        for label, r in by_size.items():
            gloo_ms[(int(n_text), label)] = statistics.median(spans(r["starts"], r["ends"], args.warmup)[0])
    passed = True
    console = Console(width=max(175, shutil.get_terminal_size().columns))
    print()
    for dtype in args.dtypes:
        title = (f"one exchange round on loopback, {dtype} on the wire, {os.cpu_count()} CPUs: median over "
                 f"{args.passes} passes x {', '.join(f'{ALTERNATIONS[k]} x {rounds_for(args, k)}' for k in args.sizes)} "
                 "timed rounds of "
                 "(last board has the average - first board starts sending); ms")
        caption = ("period: steady-state time per round, back to back (slowest board). CPU: ms of CPU per timed round "
                   "of the server process (ours: the asyncio ExchangeServer; raw: the selector loop) and of all N boards "
                   "together. raw: plain TCP + numpy, the same bytes, no framing or validation. gloo: "
                   "torch.distributed all_reduce of float32 in a private loopback-only network namespace. "
                   f"Target: ours <= {TARGET_RATIO}x raw in every cell. " + (args.cpu_note + "." if args.cpu_note else ""))
        table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
        headers = ("N", "gradient", "ours", "raw", "ours / raw", f"<= {TARGET_RATIO}x", "gloo fp32", "ours / gloo fp32",
                   "period ours|raw", "server CPU ours|raw", "boards CPU ours|raw")
        for h in headers:
            table.add_column(h, justify="left" if h in ("N", "gradient") else "right")
        for (n, label, dt), cell in sorted(cells.items(), key=lambda kv: (kv[0][0], SIZES[kv[0][1]])):
            if dt != dtype:
                continue
            ours, raw = cell.median("ours"), cell.median("raw")
            ratio = ours / raw
            ok = ratio <= TARGET_RATIO
            passed &= ok
            g = gloo_ms.get((n, label))
            size_text = label if dtype == "float32" else f"{label} fp32 / {SIZES[label] * 2 / 1e6:.3g} fp16"
            table.add_row(str(n), size_text, f"{ours * 1e3:.2f}", f"{raw * 1e3:.2f}", f"{ratio:.2f}x",
                          "PASS" if ok else "FAIL", f"{g * 1e3:.2f}" if g else "-", f"{ours / g:.2f}x" if g else "-",
                          f"{cell.period('ours') * 1e3:.2f} | {cell.period('raw') * 1e3:.2f}",
                          f"{cell.cpu('ours', 'server') * 1e3:.2f} | {cell.cpu('raw', 'server') * 1e3:.2f}",
                          f"{n * cell.cpu('ours', 'board') * 1e3:.2f} | {n * cell.cpu('raw', 'board') * 1e3:.2f}")
        console.print(table)
    return passed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time one gradient-exchange round (real ExchangeServer + ExchangeClient boards in separate "
                    "processes) for N = 2, 3 boards and 0.25 / 4.6 / 45 MB gradients on loopback, against a raw-socket "
                    "round and gloo all_reduce measured in the same run (target: ours <= 1.3x raw in every cell).",
        epilog="Servers listen on 127.0.0.1 only; gloo runs in a private loopback-only network namespace (needs root "
               "and `ip netns`). Exit code 0 if every cell meets the target, 1 if not, 2 if the run failed.")
    parser.add_argument("--rounds", type=int, default=20, metavar="K",
                        help="timed rounds per pass and cell at 45 MB; 3x that at 4.6 MB, 10x at 0.25 MB (default 20)")
    parser.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed rounds first (default 3, minimum 2)")
    parser.add_argument("--passes", type=int, default=2, metavar="P",
                        help="passes over all cells; ours and raw alternate which goes first (default 2)")
    parser.add_argument("--wire-dtype", choices=("float32", "float16", "both"), default="both",
                        help="what travels on the wire (default both: one table each)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), metavar="SIZE",
                        help=f"gradient sizes, of {', '.join(SIZES)} (default all)")
    parser.add_argument("--boards", type=int, nargs="+", default=[2, 3], metavar="N", help="board counts (default 2 3)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline (no namespace needed)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the coordinator during an extra untimed run of the largest cell")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S", help="bound on each phase (default 120 s)")
    parser.add_argument("--max-seconds", type=float, default=1200.0, metavar="S",
                        help="bound on the whole run; cleans up and exits 2 past it (default 1200)")
    parser.add_argument("--gloo-child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 2 or args.passes < 1:
        parser.error("--rounds and --passes must be >= 1, --warmup >= 2")
    if any(not 1 <= n <= 16 for n in args.boards):
        parser.error("--boards must be within 1-16")
    args.sizes = sorted(set(args.sizes), key=list(SIZES).index)
    args.cpu_note = ""
    args.dtypes = ["float32", "float16"] if args.wire_dtype == "both" else [args.wire_dtype]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gloo_child:
        return gloo_child(json.loads(args.gloo_child))

    def on_signal(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signum}" if signum != signal.SIGALRM
                         else f"the run exceeded --max-seconds {args.max_seconds:.0f}")

    for sig in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, args.max_seconds)
    cells: dict[tuple[int, str, str], Cell] = {}
    gloo: dict[str, Any] = {}
    try:
        print(f"{os.cpu_count()} CPUs; N = {args.boards}; sizes {', '.join(args.sizes)}; wire {', '.join(args.dtypes)}; "
              f"{args.warmup} warm-up + {', '.join(f'{rounds_for(args, k)}' for k in args.sizes)} timed rounds x "
              f"{args.passes} passes", flush=True)
        profile_text = measure(args, cells)
        if not args.no_gloo:
            print("gloo all_reduce in a private network namespace ...", flush=True)
            gloo = run_gloo(sorted(set(args.boards)), {k: SIZES[k] for k in args.sizes},
                            {k: args.warmup + rounds_for(args, k) * args.passes for k in args.sizes}, args.timeout)
    except (BenchError, OSError, subprocess.SubprocessError, AssertionError) as exc:
        print(f"exchange_round: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("exchange_round: interrupted", file=sys.stderr)
        return 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if profile_text:
        print()
        print(profile_text)
    return 0 if report(cells, gloo, args) else 1


if __name__ == "__main__":
    sys.exit(main())
