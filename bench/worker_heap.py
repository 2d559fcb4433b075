"""Training steps with glibc's default heap against the worker's (``agent/heap.py``).

Each measurement is a fresh Python process that trains ``--steps`` steps of a model on random
data at ``--batch`` (one torch thread, after ``--warmup`` steps) and reports every step's time and
its minor page faults. The two heaps alternate, so that both see the same spell of the host. With
``--cpus`` above 0 the process runs in a cgroup v1 CPU quota of that many cores (10 ms period, as
the lab's boards; needs root), which is how a slow board is emulated here.

    python bench/worker_heap.py                      # resnet_small and lenet5, free core, 0.45, 0.15
    python bench/worker_heap.py --models lenet5 --cpus 0

The table is printed last: per model and quota the median step and its 10th-90th percentile
spread with each heap, the faults per step, and the ratio default / worker (above 1: the worker's
heap is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from _table import print_table

from edgefleet.agent.heap import HEAP_SETTINGS, worker_environment
from edgefleet.lab.cgroups import Cgroup

PERIOD_US = 10_000  # as the lab's boards in bench/selection_accuracy.py

CHILD = """
import json, resource, sys, time
cgroup, model_name, batch, warmup, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if cgroup:
    open(cgroup + "/cgroup.procs", "w").write("0")
import torch
torch.set_num_threads(1)
from edgefleet.workloads.registry import build_model
model = build_model(model_name, {}, input_shape=(1, 32, 32), num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(batch, 1, 32, 32), torch.randint(10, (batch,))
times, faults = [], []
for i in range(warmup + steps):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if i >= warmup:
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"times": times, "faults": faults}))
"""


@dataclass
class Steps:
    times: list[float]
    faults: list[int]

    def pct(self, q: float) -> float:
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run(env: dict[str, str], cgroup: str, args: argparse.Namespace, model: str) -> Steps:
    done = subprocess.run([sys.executable, "-c", CHILD, cgroup, model, str(args.batch), str(args.warmup),
                           str(args.steps)], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return Steps(data["times"], data["faults"])


def _set_quota(group: Cgroup, cpus: float) -> str:
    """The cpu directory the measuring process joins for ``cpus`` cores; "" for a free core."""
    if cpus <= 0:
        return ""
    if os.geteuid() != 0 or "cpu" not in group.mounts:
        raise SystemExit(f"--cpus {cpus:g} needs root and cgroup v1's cpu controller; "
                         "run with --cpus 0 for a free core only")
    if not group.exists():
        group.create()
    group.set_cpu_quota(cpus, period_us=PERIOD_US)
    return str(group.path("cpu"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet_small", "lenet5"])
    parser.add_argument("--cpus", nargs="+", type=float, default=[0.0, 0.45, 0.15],
                        help="CPU quotas in cores; 0 = a free core (default 0 0.45 0.15)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two heaps per row (default 2)")
    args = parser.parse_args()

    bare = {k: v for k, v in worker_environment().items() if k not in HEAP_SETTINGS}
    heaps = {"glibc default": bare, "worker": worker_environment()}
    group = Cgroup("efl-bench-heap")
    table: list[list[str]] = []
    try:
        for model in args.models:
            for cpus in args.cpus:
                cgroup = _set_quota(group, cpus)
                got: dict[str, Steps] = {name: Steps([], []) for name in heaps}
                for _ in range(args.rounds):
                    for name, env in heaps.items():
                        steps = _run(env, cgroup, args, model)
                        got[name].times += steps.times
                        got[name].faults += steps.faults
                d, w = got["glibc default"], got["worker"]
                print(f"{model} at {cpus or 'a free'} core(s): default {statistics.median(d.times) * 1e3:.0f} ms, "
                      f"worker {statistics.median(w.times) * 1e3:.0f} ms", flush=True)
                table.append([model, f"{cpus:g}" if cpus else "free",
                              *(f"{statistics.median(s.times) * 1e3:.0f} ms ({s.pct(0.1) * 1e3:.0f}-{s.pct(0.9) * 1e3:.0f})"
                                for s in (d, w)),
                              f"{statistics.median(d.faults):.0f} / {statistics.median(w.faults):.0f}",
                              f"{statistics.median(d.times) / statistics.median(w.times):.2f}x"])
    finally:
        if group.exists():
            group.remove()
    print_table(f"training steps at batch {args.batch}, one torch thread ({args.steps} steps x {args.rounds} "
                "processes per heap)",
                ["model", "cpu", "default: median (p10-p90)", "worker: median (p10-p90)",
                 "faults/step default / worker", "default / worker"], table, min_width=160)
    return 0


if __name__ == "__main__":
    sys.exit(main())
