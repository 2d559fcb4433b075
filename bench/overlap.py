"""How much of a board's gradient exchange overlap (``train --overlap``) can hide behind backward, and what its hooks cost.

Why: issue 22 part 2 asks that overlap hide at least half of the exchange behind backward for
resnet_small. This measures the board's side, no lab: the model's real forward and backward at one
torch thread, the real ``agent.grad_stream.GradientStream`` (hooks, copies, sender thread) writing
to a socket pair whose other end is drained (an unshaped link).

The board's CPU (``--cpu``, several allowed): each measurement runs in a board process of its own
(spawned; it imports and builds its model, says ready, and waits). For a quota Q > 0 this process
puts it into a cgroup v1 CPU group (``lab.cgroups.Cgroup``) limited to Q of a core in the lab's
10 ms CFS periods (``lab.cgroups.CFS_PERIOD_US``; below 0.1 core the period grows so that the
quota stays at the kernel's 1 ms floor, as in the lab), before it runs; 0 = unconstrained. Only the
board's side is in the group: its main thread and its sender thread, whose writes to the socket
(the kernel's copy into the socket included) are charged to it as they would be on a board. The
socket pair's other end, standing for the link and the coordinator, is drained by a thread of
this process, outside the quota. The group is removed on every exit path (SIGTERM and Ctrl-C
included). A quota needs root.

Per model (``--models``) and CPU at ``--batch`` it reports, medians over ``--steps`` steps after
``--warmup``:
* backward's time with the stream armed, and without any hooks;
* from backward's start, when each bucket went to the sender, and the share of the vector's bytes
  handed over before backward ended (what an upload could carry while backward still runs);
* for each link of ``--links`` (up/down Mbit/s; default the lab's 20/30, 60/90, 100/100): the upload
  modelled as a FIFO at the up rate fed by the buckets as they were handed over, and
  - the share of the upload finished by backward's end: the part of the upload overlap hides;
  - the share of the whole exchange hidden: that hidden upload time over (upload + download), the
    upload the vector's bytes at the up rate and the download of the average the same bytes at the
    down rate (after the step: nothing hides it). Frame heads and tails, latency and the
    coordinator's wait for the slowest board are left out. Even a fully hidden upload hides only
    down / (up + down) of the exchange this way: 60% at 20/30 and 60/90, 50% at 100/100;
* the hooks' cost per step: (armed backward + finish) - (plain backward + the one-call gather and the
  whole send) on the same socket pair, the two kinds of step in turn: median wall time, and mean CPU
  time of the whole board process (what a board with a CPU quota pays; the sender thread's work included);
* the CPU the board process used over the timed steps, in cores (at most its quota).

Reference (this 2-core host, 2026-11-26, quiet while it ran: vmstat 0% us, 100% id, 0% st before, other
processes 4% of it during; buckets of an eighth of the vector; ``--cpu 0 0.27 0.12 0.09``, 2 min):
resnet_small (38 KiB, 22 tensors, pieces of 9.9, 9.2, 9.2, 9.2 and 0.8 KiB) unconstrained: backward 9.3 ms,
first bucket at 2.6 ms, 98% of the vector handed over before backward ended, 47% / 85% / 92% of the upload
hidden at 20/30, 60/90, 100/100 (28% / 51% / 46% of the exchange), +0.5 ms of CPU a step. At 0.27, 0.12 and
0.09 core: backward 37, 96 and 124 ms, 79-80% / 89-92% / 98% of the upload hidden, 47-48% / 53-55% / 49% of
the exchange. The fourth piece (a quarter of the vector: the first layers') is ready only as backward ends,
so at 20 Mbit/s about a fifth of the upload always comes after it, however slow the CPU; 100/100 cannot pass
50%. The hooks cost 1.5 ms of CPU a step under a quota, and a streamed step took 9.5 / 23 / 32 ms more wall
time than a plain one (their CPU at that share, plus throttling): more than the 12 ms of upload hidden at
0.12 core and 20 Mbit/s. lenet5 (241 KiB, 10 tensors, pieces of 43, 188 and 10 KiB): backward 1.2 ms
unconstrained, 1% / 3% / 6% of the upload hidden (1-3% of the exchange), +0.3 ms of CPU; under a quota
its 2 ms backward is throttled or not by chance (medians 1.8-6.6 ms), 2-59% of the upload and 1-29% of the
exchange hidden, +0.3-0.6 ms of CPU. A run on the host shared with other work (vmstat 46-74% us before, 0%
st) gave the same resnet_small quota rows within 2 points (the group's cpu.shares weigh it against the rest); the
unconstrained one, run under ``nice -n 19``, lost CPU to the other work (resnet_small 0.43 core used,
backward 13.9 ms).
Exit code 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from _board_queue import next_message  # bench/ is the script's folder, first on sys.path
from _harness import BenchError, die_with_parent, host_note
from _table import print_table

from edgefleet.agent.grad_stream import GradientStream, bucket_bytes_for
from edgefleet.lab.cgroups import CFS_PERIOD_US, CONTROLLERS, Cgroup, find_controller_mounts
from edgefleet.protocol.exchange_frames import Grad
from edgefleet.workloads.params import FlatGradients, gradient_order, trainable_params

DEFAULT_LINKS = "20/30,60/90,100/100"  # the lab's board links, up/down Mbit/s


@dataclass(frozen=True)
class Link:
    """A board's link: upload and download rates in Mbit/s."""

    up_mbit: float
    down_mbit: float

    @property
    def label(self) -> str:
        return f"{self.up_mbit:g}/{self.down_mbit:g}"


@dataclass(frozen=True)
class RunConfig:
    """What every board process measures: the batch, the steps, the bucket size (None: the stream's default)."""

    batch: int
    steps: int
    warmup: int
    bucket_bytes: int | None
    timeout_s: float


# ----------------------------------------------------------------------------- the board process

def _batch(dataset: Any, size: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [dataset[(offset + i) % len(dataset)] for i in range(size)]
    return torch.stack([s[0] for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])


def measure(name: str, dataset: Any, model: torch.nn.Module, board: socket.socket, config: RunConfig) -> dict[str, Any]:
    """Plain and streamed steps in turn on ``board``; every timed step's raw figures (plain types: they cross processes)."""
    hooked = copy.deepcopy(model)  # the same model with the stream's hooks: plain and streamed steps in turn
    params = gradient_order(trainable_params(torch.optim.SGD(hooked.parameters(), lr=0.01)), overlap=True)
    plain_params = gradient_order(trainable_params(torch.optim.SGD(model.parameters(), lr=0.01)), overlap=True)
    elements = sum(p.numel() for p in params)
    flat = np.zeros(elements, dtype=np.float32)
    grads = FlatGradients(plain_params, flat)
    stream = GradientStream(params, flat, None, board.sendall, bucket_bytes=config.bucket_bytes)
    head = Grad.stream_head(step=0, n=config.batch, loss=1.0, logs={"train_loss": [1.0, True, False, False]},
                            dtype="float32", elements=elements)
    tail = Grad.stream_tail(0.1)
    got: dict[str, Any] = {"model": name, "params": len(params), "vector_bytes": elements * 4,
                           "bucket_bytes": stream.bucket_bytes, "plain_backward_s": [], "plain_s": [], "plain_cpu_s": [],
                           "stream_backward_s": [], "stream_s": [], "stream_cpu_s": [], "handed": []}
    cpu0 = wall0 = 0.0
    try:
        for i in range(2 * (config.warmup + config.steps)):  # plain and streamed steps in turn: both see the same host
            if i == 2 * config.warmup:
                cpu0, wall0 = time.process_time(), time.perf_counter()
            streamed = i % 2 == 1
            net = hooked if streamed else model
            x, y = _batch(dataset, config.batch, (i // 2) * config.batch)
            net.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            cpu = time.process_time()
            if streamed:
                stream.begin(head)
            started = time.perf_counter()
            torch.autograd.backward(loss)
            ended = time.perf_counter()
            if streamed:
                stream.finish(tail)
            else:
                grads.gather()
                board.sendall(head + flat.data.cast("B") + tail)
            done = time.perf_counter()
            cpu = time.process_time() - cpu  # every thread's: the sender's writes too
            if i // 2 < config.warmup:
                continue
            kind = "stream" if streamed else "plain"
            got[f"{kind}_backward_s"].append(ended - started)
            got[f"{kind}_s"].append(done - started)
            got[f"{kind}_cpu_s"].append(cpu)
            if streamed:  # each piece's hand-over from backward's start, and backward's end
                got["handed"].append(([(at - started, size) for at, size in zip(stream.handed_at, stream.pieces)],
                                      ended - started))
        got["cpu_used"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    finally:
        stream.close()
    return got


def board_main(name: str, config: RunConfig, board: socket.socket, results: Any, go: Any) -> None:
    """The board: imports and builds its model, says ready (the parent then puts it in its cgroup), waits, measures."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    try:
        from edgefleet.workloads.registry import build_dataset, build_model

        torch.set_num_threads(1)  # a board's
        dataset = build_dataset("digits", "train", {})
        torch.manual_seed(0)
        model = build_model(name, {}, data=dataset)
        results.put(("ready", os.getpid()))
        if go.get():
            results.put(("result", measure(name, dataset, model, board, config)))
    except BaseException as exc:  # reported to the parent, which fails the run with it
        results.put(("error", f"board ({name}): {type(exc).__name__}: {exc}"))
    finally:
        board.close()  # the drain sees the end of the stream


# ----------------------------------------------------------------------------- this process: the link's side

def _drain(sock: socket.socket) -> None:
    buffer = bytearray(1 << 20)
    while sock.recv_into(buffer):
        pass


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block has run to its end (a cleanup), then act as before."""
    caught: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def run_board(name: str, cpu: float, config: RunConfig) -> dict[str, Any]:
    """One board process measuring ``name`` at ``cpu`` cores (0: unconstrained); the socket drained here."""
    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Queue()
    board, link = socket.socketpair()
    board.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    reader = threading.Thread(target=_drain, args=(link,), daemon=True, name="overlap-drain")
    process = ctx.Process(target=board_main, args=(name, config, board, results, go), daemon=True, name="efb-overlap-board")
    group: Cgroup | None = None
    try:
        reader.start()
        process.start()
        board.close()  # the board process has its own: the stream ends when it closes it
        pid = next_message(results, process, "ready", config.timeout_s, BenchError)
        if cpu > 0:
            group = Cgroup(f"efb-overlap-{os.getpid()}-{pid}")
            group.create()
            group.set_cpu_quota(cpu, CFS_PERIOD_US)
            group.add(pid)
        go.put(True)
        got: dict[str, Any] = next_message(results, process, "result", config.timeout_s, BenchError)
        return got
    finally:
        with _signals_deferred():
            board.close()
            if process.pid is not None:  # started
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(3)
            if group is not None:
                try:
                    group.remove()
                except OSError as exc:
                    print(f"overlap: cannot remove cgroup {group.relpath}: {exc}", file=sys.stderr)
            reader.join(5)
            link.close()


# ----------------------------------------------------------------------------- figures

def _upload_hidden(handed: list[tuple[float, int]], backward_end: float, rate_bytes_s: float) -> float:
    """The share of the bytes a FIFO link of ``rate_bytes_s`` has sent by ``backward_end`` (times from backward's start)."""
    clock, sent_by_end, total = 0.0, 0.0, sum(size for _, size in handed)
    for at, size in handed:
        clock = max(clock, at)
        done = clock + size / rate_bytes_s
        if clock < backward_end:
            sent_by_end += size * min(1.0, (backward_end - clock) / (done - clock))
        clock = done
    return sent_by_end / total if total else 0.0


def summarize(raw: dict[str, Any], cpu: float, links: list[Link]) -> dict[str, Any]:
    """Medians of one board's raw figures, and the hidden shares of upload and exchange on each link."""
    med = statistics.median
    handed: list[tuple[list[tuple[float, int]], float]] = raw["handed"]  # per step: (when, bytes) per piece, backward's end
    vector = raw["vector_bytes"]
    upload_hidden, exchange_hidden = {}, {}
    for link in links:
        up_s, down_s = vector * 8 / (link.up_mbit * 1e6), vector * 8 / (link.down_mbit * 1e6)
        shares = [_upload_hidden(pieces, end, link.up_mbit * 1e6 / 8) for pieces, end in handed]
        upload_hidden[link] = med(shares)
        exchange_hidden[link] = med(share * up_s / (up_s + down_s) for share in shares)
    starts = [[at for at, _ in pieces] for pieces, _ in handed]
    return {"model": raw["model"], "cpu": cpu, "params": raw["params"], "vector_kib": vector / 1024,
            "bucket_kib": raw["bucket_bytes"] / 1024,
            "backward_ms": med(raw["plain_backward_s"]) * 1e3, "backward_streamed_ms": med(raw["stream_backward_s"]) * 1e3,
            "first_bucket_ms": med(s[0] for s in starts) * 1e3,
            "pieces_kib": [round(size / 1024, 1) for _, size in handed[-1][0]],  # the same every step
            "buckets_ms": [round(med(s[j] for s in starts if len(s) > j) * 1e3, 2) for j in range(max(map(len, starts)))],
            "handed_before_end": med(sum(size for at, size in pieces if at <= end) / vector for pieces, end in handed),
            "upload_hidden": upload_hidden, "exchange_hidden": exchange_hidden,
            "overhead_ms": (med(raw["stream_s"]) - med(raw["plain_s"])) * 1e3,
            "overhead_cpu_ms": (statistics.mean(raw["stream_cpu_s"]) - statistics.mean(raw["plain_cpu_s"])) * 1e3,
            "cpu_used": raw["cpu_used"]}


def cpu_text(cpu: float) -> str:
    return f"{cpu:g} core" if cpu > 0 else "unconstrained"


def report(rows: list[dict[str, Any]], links: list[Link], config: RunConfig, note: str) -> None:
    print_table(f"Overlap on one board (1 torch thread, batch {config.batch}, medians of {config.steps} steps; "
                f"CPU quotas in {CFS_PERIOD_US // 1000} ms CFS periods, longer below 0.1 core: 1 ms of quota at least)",
                ["model", "board CPU", "tensors", "vector KiB", "bucket KiB", "backward ms", "backward+hooks ms",
                 "1st bucket ms", "pieces", "handed before end", *(f"hidden @{link.label} upload / exchange" for link in links),
                 "step ms vs plain", "CPU ms vs plain", "CPU used"],
                [[r["model"], cpu_text(r["cpu"]), str(r["params"]), f"{r['vector_kib']:.0f}", f"{r['bucket_kib']:.0f}",
                  f"{r['backward_ms']:.1f}", f"{r['backward_streamed_ms']:.1f}", f"{r['first_bucket_ms']:.1f}",
                  str(len(r["buckets_ms"])), f"{r['handed_before_end']:.0%}",
                  *(f"{r['upload_hidden'][link]:.0%} / {r['exchange_hidden'][link]:.0%}" for link in links),
                  f"{r['overhead_ms']:+.2f}", f"{r['overhead_cpu_ms']:+.2f}", f"{r['cpu_used']:.2f}"] for r in rows],
                caption="hidden @up/down Mbit/s: the share of the upload a FIFO link at the up rate finishes before "
                        "backward ends / that hidden time over the whole exchange (upload of the vector at the up rate + "
                        "download of the average, the same bytes, at the down rate; at most down/(up+down)). vs plain: a "
                        "streamed step's backward + send minus a plain step's backward + gather + send (median wall time; "
                        "mean CPU of the board process's threads). CPU used: the board process's CPU time over the timed "
                        "steps' wall time, in cores. " + note,
                left_columns=2, min_width=240)


# ----------------------------------------------------------------------------- command line

def parse_links(text: str) -> list[Link]:
    """``"20/30,100/100"`` -> links; ValueError on anything else."""
    links = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        up, sep, down = item.partition("/")
        if not sep:
            raise ValueError(f"{item!r} is not up/down")
        link = Link(float(up), float(down))
        if not (link.up_mbit > 0 and link.down_mbit > 0):
            raise ValueError(f"{item!r}: rates must be positive")
        links.append(link)
    if not links:
        raise ValueError("no link given")
    return links


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     epilog="A --cpu quota needs root (cgroup v1). Exit code 0 if the run completed, 2 if "
                                            "it could not be made.")
    parser.add_argument("--models", default="resnet_small,lenet5")
    parser.add_argument("--cpu", type=float, nargs="+", default=[0.0], metavar="Q",
                        help="the board's CPU in cores, 0 = unconstrained; several allowed, e.g. --cpu 0 0.27 0.12 0.09 "
                             "(default 0)")
    parser.add_argument("--links", default=DEFAULT_LINKS, metavar="UP/DOWN,...",
                        help=f"links to model the hidden shares for, up/down Mbit/s (default the lab's, {DEFAULT_LINKS})")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bucket-kib", type=int, default=0,
                        help=f"bucket size (default: an eighth of the vector, {bucket_bytes_for(0) // 1024} KiB at least)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="bound on a board process's start and on its measurement (default 600 s)")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        args.links = parse_links(args.links)
    except ValueError as exc:
        parser.error(f"--links takes comma-separated up/down Mbit/s pairs, e.g. {DEFAULT_LINKS} ({exc})")
    if not args.models:
        parser.error("--models names no model")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--batch and --steps must be >= 1, --warmup >= 0")
    if any(not 0 <= q <= (os.cpu_count() or 1) for q in args.cpu):
        parser.error(f"--cpu must be 0 (unconstrained) or a share of the host's {os.cpu_count()} CPUs, in cores")
    if any(q > 0 for q in args.cpu):
        if os.geteuid() != 0:
            parser.error("a --cpu quota needs root (cgroup v1); run as root or with --cpu 0")
        missing = set(CONTROLLERS) - set(find_controller_mounts())
        if missing:
            parser.error(f"a --cpu quota needs the cgroup v1 controllers {', '.join(sorted(missing))} mounted; "
                         "run with --cpu 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = RunConfig(args.batch, args.steps, args.warmup, args.bucket_kib * 1024 or None, args.timeout)

    def on_signal(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    import psutil

    rows: list[dict[str, Any]] = []
    try:
        t0, own0 = psutil.cpu_times(), os.times()
        for name in args.models:
            for cpu in args.cpu:
                r = summarize(run_board(name, cpu, config), cpu, args.links)
                rows.append(r)
                print(f"{name} at {cpu_text(cpu)}: backward {r['backward_ms']:.1f} ms, pieces of {r['pieces_kib']} KiB "
                      f"handed over at {r['buckets_ms']} ms after its start; a streamed step {r['overhead_ms']:+.2f} ms of wall time "
                      f"and {r['overhead_cpu_ms']:+.2f} ms of CPU against a plain one", flush=True)
        t1, own1 = psutil.cpu_times(), os.times()
    except BenchError as exc:
        print(f"overlap: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overlap: interrupted", file=sys.stderr)
        return 2
    report(rows, args.links, config, host_note(t0, t1, sum(own1[:4]) - sum(own0[:4])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
