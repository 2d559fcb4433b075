"""How much of a board's gradient upload overlap (``train --overlap``) can hide behind backward, and what its hooks cost.

Why: issue 22 part 2 asks that overlap hide at least half of the exchange behind backward for
resnet_small. This measures the board's side in one process, no lab: the model's real forward
and backward at one torch thread, the real ``agent.grad_stream.GradientStream`` (hooks, copies,
sender thread) writing to a socket pair whose other end a thread drains (an unshaped link).

Per model (``--models``) at ``--batch`` it reports, medians over ``--steps`` steps after
``--warmup``:
* backward's time with the stream armed, and without any hooks;
* from backward's start, when each bucket went to the sender, and the share of the vector's bytes
  handed over before backward ended (what an upload could carry while backward still runs);
* for links of ``--link-mbits`` (a FIFO at that rate fed by the buckets as they were handed over),
  the share of the upload finished by backward's end: the part of the upload overlap hides.
  The download of the average and the coordinator's wait for the slowest board are not in it;
* the hooks' cost per step: (armed backward + finish) - (plain backward + the one-call gather and the
  whole send) on the same socket pair, the two kinds of step in turn: median wall time, and mean CPU
  time of the whole process (what a board with a CPU quota pays; the sender thread's work included).

Reference (this 2-core host, shared with other work, 2026-11-26, buckets of an eighth of the vector):
resnet_small (38 KiB, 22 tensors) backward 9.3-9.5 ms, first bucket at 2.6 ms, 98% of the vector handed
over before backward ended, 46-47% of the upload done by then at 20 Mbit/s and 93% at 100 Mbit/s, +0.9-1.0 ms
of CPU a step; lenet5 (241 KiB, 10 tensors) backward 1.0 ms, 96% handed over, 1% / 5% hidden, +0.25 ms of CPU.
Exit code 0.
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch
from _table import print_table  # bench/ is the script's folder, first on sys.path

from edgefleet.agent.grad_stream import GradientStream, bucket_bytes_for
from edgefleet.protocol.exchange_frames import Grad
from edgefleet.workloads.params import FlatGradients, gradient_order, trainable_params


def _drain(sock: socket.socket) -> None:
    buffer = bytearray(1 << 20)
    while sock.recv_into(buffer):
        pass


def _batch(dataset: Any, size: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [dataset[(offset + i) % len(dataset)] for i in range(size)]
    return torch.stack([s[0] for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])


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


def measure(name: str, batch: int, steps: int, warmup: int, links_mbit: list[float], bucket: int | None) -> dict[str, Any]:
    from edgefleet.workloads.registry import build_dataset, build_model

    dataset = build_dataset("digits", "train", {})
    torch.manual_seed(0)
    model = build_model(name, {}, data=dataset)
    hooked = copy.deepcopy(model)  # the same model with the stream's hooks: plain and streamed steps in turn
    params = gradient_order(trainable_params(torch.optim.SGD(hooked.parameters(), lr=0.01)), overlap=True)
    plain_params = gradient_order(trainable_params(torch.optim.SGD(model.parameters(), lr=0.01)), overlap=True)
    elements = sum(p.numel() for p in params)
    flat = np.zeros(elements, dtype=np.float32)
    board, coordinator = socket.socketpair()
    board.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    reader = threading.Thread(target=_drain, args=(coordinator,), daemon=True)
    reader.start()
    plain_cpu, stream_cpu = [], []
    plain_s, stream_s, backward_plain_s, backward_stream_s, handed_share = [], [], [], [], []
    firsts: list[float] = []
    hidden: dict[float, list[float]] = {rate: [] for rate in links_mbit}
    grads = FlatGradients(plain_params, flat)
    stream = GradientStream(params, flat, None, board.sendall, bucket_bytes=bucket)
    head = Grad.stream_head(step=0, n=batch, loss=1.0, logs={"train_loss": [1.0, True, False, False]},
                            dtype="float32", elements=elements)
    tail = Grad.stream_tail(0.1)
    buckets: list[list[float]] = []
    try:
        for i in range(2 * (warmup + steps)):  # plain and streamed steps in turn: both see the same host
            streamed = i % 2 == 1
            net = hooked if streamed else model
            x, y = _batch(dataset, batch, (i // 2) * batch)
            net.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            cpu = time.process_time()
            if streamed:
                stream.begin(head)
            started = time.perf_counter()
            loss.backward()
            ended = time.perf_counter()
            if streamed:
                stream.finish(tail)
            else:
                grads.gather()
                board.sendall(head + flat.data.cast("B") + tail)
            done = time.perf_counter()
            cpu = time.process_time() - cpu  # every thread's: the sender's writes too
            if i // 2 < warmup:
                continue
            if not streamed:
                backward_plain_s.append(ended - started)
                plain_s.append(done - started)
                plain_cpu.append(cpu)
                continue
            backward_stream_s.append(ended - started)
            stream_s.append(done - started)
            stream_cpu.append(cpu)
            handed = [(at - started, size) for at, size in zip(stream.handed_at, stream.pieces)]
            before = sum(size for at, size in handed if at <= ended - started)
            handed_share.append(before / sum(stream.pieces))
            firsts.append(handed[0][0])
            buckets.append([at for at, _ in handed])
            for rate in links_mbit:
                hidden[rate].append(_upload_hidden(handed, ended - started, rate * 1e6 / 8))
    finally:
        stream.close()
        board.close()
        reader.join(5)
        coordinator.close()
    med = statistics.median
    return {"model": name, "params": len(params), "vector_kib": elements * 4 / 1024, "bucket_kib": stream.bucket_bytes / 1024,
            "backward_ms": med(backward_plain_s) * 1e3, "backward_streamed_ms": med(backward_stream_s) * 1e3,
            "first_bucket_ms": med(firsts) * 1e3,
            "buckets_ms": [round(med(b[j] for b in buckets if len(b) > j) * 1e3, 2) for j in range(max(map(len, buckets)))],
            "handed_before_end": med(handed_share),
            "hidden": {rate: med(values) for rate, values in hidden.items()},
            "overhead_ms": (med(stream_s) - med(plain_s)) * 1e3,
            "overhead_cpu_ms": (statistics.mean(stream_cpu) - statistics.mean(plain_cpu)) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet_small,lenet5")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--link-mbits", default="20,100", help="link rates to model the hidden share for (default 20,100)")
    parser.add_argument("--bucket-kib", type=int, default=0,
                        help=f"bucket size (default: an eighth of the vector, {bucket_bytes_for(0) // 1024} KiB at least)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a board's
    links = [float(v) for v in args.link_mbits.split(",") if v]
    rows, results = [], []
    for name in (m for m in args.models.split(",") if m):
        r = measure(name, args.batch, args.steps, args.warmup, links, args.bucket_kib * 1024 or None)
        results.append(r)
        print(f"{name}: buckets handed over at {r['buckets_ms']} ms after backward's start; a streamed step "
              f"{r['overhead_ms']:+.2f} ms of wall time and {r['overhead_cpu_ms']:+.2f} ms of CPU against a plain one", flush=True)
        rows.append([name, str(r["params"]), f"{r['vector_kib']:.0f}", f"{r['bucket_kib']:.0f}", f"{r['backward_ms']:.1f}",
                     f"{r['backward_streamed_ms']:.1f}", f"{r['first_bucket_ms']:.1f}", str(len(r["buckets_ms"])),
                     f"{r['handed_before_end']:.0%}", *(f"{r['hidden'][rate]:.0%}" for rate in links),
                     f"{r['overhead_ms']:+.2f}", f"{r['overhead_cpu_ms']:+.2f}"])
    print_table(f"Overlap on one board (1 torch thread, batch {args.batch}, medians of {args.steps} steps)",
                ["model", "tensors", "vector KiB", "bucket KiB", "backward ms", "backward+hooks ms", "1st bucket ms",
                 "pieces", "handed before end", *(f"hidden @{rate:g} Mbit/s" for rate in links), "step ms vs plain", "CPU ms vs plain"],
                rows, caption="hidden: the share of the upload a link of that rate finishes before backward ends "
                              "(the download of the average is not in it). vs plain: a streamed step's backward + "
                              "send minus a plain step's backward + gather + send (median wall time; mean CPU of all threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
