"""Does fitting the replica's validation threads to the free CPU pay? All threads against the fitted count, on a busy machine.

Why: the coordinator's replica validates at every epoch's end while the boards wait
(``coordinator.run.replica_threads``). On the lab the boards share the coordinator's machine; torch's
default (one intra-op thread per CPU) then waits at every operator's barrier for a thread the
boards keep off its core. This starts ``--busy`` spinning processes (default: the machine's CPUs
less one half, like the lab's boards at 1.44 of 2 cores: each spins for ``--duty`` of every 10 ms),
then validates resnet_small on digits' 359 validation images (batches of 256, as the replica does)
with torch's default thread count and with the count ``FreeCpuThreads`` picks, in turn, and
prints the medians and their ratio. With ``--busy 0`` it checks that a quiet machine keeps its
threads (the ratio should be about 1 or better).

    python bench/replica_threads.py [--busy N] [--duty SHARE] [--reps 10]

Reference (this 2-core host, quiet otherwise, 2026-11-26; medians of 10): two spinners at 72% duty
(1.44 cores, the lab's boards): default 2 threads 326 ms, fitted 1 thread 310 ms (0.95x); at 100% duty
623 ms and 279 ms (0.45x); no spinners: both 2 threads, 195-196 ms. Exit code 0.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch
from _table import print_table  # bench/ is the script's folder, first on sys.path

from edgefleet.coordinator.run.replica_threads import FreeCpuThreads
from edgefleet.workloads.registry import build_dataset, build_model


def _spin(duty: float, stop: multiprocessing.synchronize.Event) -> None:
    period = 0.010
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period:
            pass
        time.sleep(max(0.0, period * (1 - duty)))


def _validate(model: torch.nn.Module, images: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for chunk in torch.split(images, 256):
            model(chunk)
    return time.perf_counter() - start


def main() -> int:
    cpus = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Exit code 0.")
    parser.add_argument("--busy", type=int, default=cpus, help=f"spinning processes standing for boards (default {cpus})")
    parser.add_argument("--duty", type=float, default=0.72, help="each spinner's busy share (default 0.72: 1.44 of 2 cores)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not 0 < args.duty <= 1 or args.busy < 0 or args.reps < 1:
        parser.error("--duty must be in (0, 1], --busy >= 0, --reps >= 1")
    default_threads = torch.get_num_threads()
    model = build_model("resnet_small", {}, data=build_dataset("digits", "train", {})).eval()
    val = build_dataset("digits", "val", {})
    images = torch.stack([val[i][0] for i in range(len(val))])
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(args.duty, stop), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    fitter = FreeCpuThreads()
    times: dict[str, list[float]] = {"default": [], "fitted": []}
    picked: list[int] = []
    try:
        time.sleep(1.0)  # a first window for the fitter to read (not a synchronisation: it measures load over time)
        for rep in range(args.reps + 2):
            for kind in ("default", "fitted"):
                threads = default_threads if kind == "default" else fitter.threads()
                if kind == "fitted":
                    picked.append(threads)
                torch.set_num_threads(threads)
                elapsed = _validate(model, images)
                if rep >= 2:
                    times[kind].append(elapsed)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    med = {kind: statistics.median(values) for kind, values in times.items()}
    print_table(f"resnet_small validation of {len(images)} images with {args.busy} spinner(s) at {args.duty:.0%} duty "
                f"({args.reps} interleaved reps)",
                ["threads", "median ms", "range ms", "vs default"],
                [[f"default ({default_threads})", f"{med['default'] * 1e3:.0f}",
                  f"{min(times['default']) * 1e3:.0f}-{max(times['default']) * 1e3:.0f}", "1.00x"],
                 [f"fitted ({min(picked)}-{max(picked)})", f"{med['fitted'] * 1e3:.0f}",
                  f"{min(times['fitted']) * 1e3:.0f}-{max(times['fitted']) * 1e3:.0f}",
                  f"{med['fitted'] / med['default']:.2f}x"]],
                caption="vs default: the fitted count's median time over the default's (below 1: faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
