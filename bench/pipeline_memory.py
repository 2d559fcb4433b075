"""A model larger than any board of the fleet trains as a pipeline over it (issue 35's first target).

The lab's ``tight4`` fleet (lab/fleets/tight4.toml): four boards of 2 GiB each (cgroup memory limits),
on gigabit links. The model: ``mlp`` with four hidden layers of ``--width`` units (6144 by default:
119.5 M parameters, 478 MB of float32 weights; with their gradients, Adam's two moments and the
exchange's gradient vector 2.4 GB, more than a board holds beside the training worker's own ~0.3 GB).
Through the real ``edge-coordinator train`` and the lab's agents (their own keys: ``--board-keys``):

1. **Alone**: the model data-parallel on one board (``t1``), a few steps: it cannot train there;
   the run's failure and the board's memory counters (``memory.failcnt``, the peak against the
   limit) say so.
2. **Piped**: ``--pipeline t1,net.2@t2,net.4@t3,net.6@t4`` (the first layer and the data on t1, one
   6144 x 6144 layer on each of t2 and t3, the last with the classifier on t4), ``--micro-batches 2``,
   the global batch 16, ``--stage-sync checkpoint``, ``--steps`` steps (20): each board holds its own
   stage only (the other stages' weights released, the welcome cut to the stage); Adam at lr 1e-4. Its final model
   is compared with single-process training of the same model on this machine (the same seed,
   global batches and Adam: relative L2 per tensor, the issue's bound 1e-5), and its validation
   accuracy is the replica's at the end.

Per run: its exit status and the reason of a failure, each board's peak memory (the cgroup's
``memory.max_usage_in_bytes``, reset before the run) against its limit and its ``failcnt``, the
run's time and samples/s, the validation accuracy and the error against single-process training.
The table comes last.

Run as root from the repository root (about 5-8 min on a 2-core machine, most of it the reference
and the pipelined steps of a 143 M-parameter model on 0.27 of a core each)::

    python bench/pipeline_memory.py
    python bench/pipeline_memory.py --width 3072 --steps 10     # a quicker look (a model that fits alone)

Exit status: 0 when the piped run trained and matched single-process training within the bound and
the alone run did not train; 1 otherwise; 2 when the lab could not be used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import BenchError, in_coordinator_netns, write_fleet_key
from _table import print_table

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "lab/fleets/tight4.toml"
BOUND = 1e-5
SEED = 0
BATCH = (16,)
LAYERS = 4
LR = 1e-4  # Adam's: at the model's default 1e-3 this wide MLP's loss jumps to 34 at step 1 and float rounding grows
PIPELINE = "t1,net.2@t2,net.4@t3,net.6@t4"
RUN_TIMEOUT_S = 1200.0


def _train(lab: Any, key: Path, run_dir: Path, *flags: str, model_options: str) -> tuple[int, str, float]:
    """One ``edge-coordinator train`` in the coordinator's namespace: (exit status, its output's tail, seconds)."""
    from edgefleet.launch import module_command

    cmd = module_command("edgefleet.coordinator.cli", "--broker", lab.broker_address, "train", "--fleet-key", str(key),
                         "--board-keys", str(lab.board_keys_dir), "--model", "mlp", "--model-options", model_options,
                         "--dataset", "digits", "--seed", str(SEED), "--threads", "1", "--run-dir", str(run_dir), *flags)
    started = time.monotonic()
    done = subprocess.run(in_coordinator_netns(lab, cmd), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          check=False)
    (run_dir.parent / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)  # the whole of it, for --keep
    return done.returncode, (done.stdout + done.stderr)[-3000:], time.monotonic() - started


def _reset_peaks(lab: Any) -> None:
    for board in lab.boards.values():
        (board.cgroup.path("memory") / "memory.max_usage_in_bytes").write_text("0")


def _memory(lab: Any) -> dict[str, tuple[int, int, int]]:
    """Each board's (peak bytes, limit bytes, failcnt) since the last reset."""
    out = {}
    for board_id, board in lab.boards.items():
        folder = board.cgroup.path("memory")
        out[board_id] = (int((folder / "memory.max_usage_in_bytes").read_text()),
                         int((folder / "memory.limit_in_bytes").read_text()),
                         int((folder / "memory.failcnt").read_text()))
    return out


def _why(tail: str) -> str:
    """The run's own words for its failure: its last line that names an error, or its last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "killed" in line.lower() or "memory" in line.lower():
            return line[:220]
    for line in reversed(lines):
        if any(word in line.lower() for word in ("error", "failed", "signal")):
            return line[:220]
    return lines[-1][:220] if lines else ""


def _reference(steps: int, model_options: dict[str, Any]) -> dict[str, Any]:
    """The model single-process training reaches after ``steps`` steps: the same seed, global batches and Adam."""
    import torch

    from edgefleet.workloads.params import single_optimizer
    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import GlobalBatchPlan

    torch.set_num_threads(1)  # as the boards train (--threads 1): the same order of summation in each product
    dataset = build_dataset("digits", "train", {})
    torch.manual_seed(SEED)
    model = build_model("mlp", model_options, data=dataset)
    optimizer = single_optimizer(model.configure_optimizers())
    plan = GlobalBatchPlan(len(dataset), [sum(BATCH)], SEED)
    for step in range(steps):
        samples = [dataset[i] for i in plan.global_indices(step)]
        x, y = torch.stack([s[0] for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return dict(model.state_dict())


def _error(run_dir: Path, reference: dict[str, Any]) -> float | None:
    import torch

    path = run_dir / "model.pt"
    if not path.exists():
        return None
    got = torch.load(path, weights_only=True)
    return max(float((got[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-12)) for k in reference)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=6144, help=f"units of each of the MLP's {LAYERS} hidden layers (6144)")
    parser.add_argument("--steps", type=int, default=20, help="the pipelined run's steps (20)")
    parser.add_argument("--alone-steps", type=int, default=3, help="the one-board run's steps (3)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the figures here too")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the runs' directories and output here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/pipeline_memory.py needs root (the lab's namespaces and cgroups)", file=sys.stderr)
        return 2
    from edgefleet.lab.fleet_file import load_fleet
    from edgefleet.lab.lab import Lab

    options = f"layers={LAYERS},width={args.width},lr={LR}"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="efl-pipeline-memory-") as scratch:
        tmp = str(args.keep) if args.keep else scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        key = write_fleet_key(Path(tmp) / "fleet.key", ed25519=True)
        try:
            with Lab(load_fleet(FLEET), fleet_key_file=key) as lab:
                lab.wait_online(timeout_s=180)
                print(f"lab {FLEET.stem}: {len(lab.boards)} boards online", file=sys.stderr, flush=True)
                for name, flags in (("alone on t1", ("--boards", "t1", "--batch", str(sum(BATCH)),
                                                     "--steps", str(args.alone_steps))),
                                    ("piped", ("--pipeline", PIPELINE, "--batch", ",".join(map(str, BATCH)),
                                               "--micro-batches", "2", "--stage-sync", "checkpoint",
                                               "--steps", str(args.steps)))):
                    run_dir = Path(tmp) / name.split()[0]
                    _reset_peaks(lab)
                    print(f"{name}: training ...", file=sys.stderr, flush=True)
                    code, tail, wall_s = _train(lab, key, run_dir, *flags, model_options=options)
                    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
                    rows.append({"run": name, "code": code, "why": "" if code == 0 else _why(tail), "wall_s": wall_s,
                                 "memory": _memory(lab), "samples_per_s": result.get("samples_per_s"),
                                 "val_accuracy": result.get("val_accuracy"), "run_dir": str(run_dir)})
                    print(f"{name}: exit {code} in {wall_s:.0f} s {rows[-1]['why']}", file=sys.stderr, flush=True)
        except (BenchError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"the lab could not be used: {exc}", file=sys.stderr)
            return 2
        print("single-process reference on this machine ...", file=sys.stderr, flush=True)
        reference = _reference(args.steps, {"layers": LAYERS, "width": args.width, "lr": LR})
        for row in rows:
            row["error"] = _error(Path(row["run_dir"]), reference) if row["run"] == "piped" else None
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    cells = []
    for row in rows:
        memory = ", ".join(f"{b} {_gib(p)}/{_gib(limit)}{f' ({fails} over)' if fails else ''}"
                           for b, (p, limit, fails) in row["memory"].items())
        cells.append([row["run"], str(row["code"]), memory, f"{row['wall_s']:.0f}",
                      f"{row['samples_per_s']:.1f}" if row["samples_per_s"] else "-",
                      f"{row['val_accuracy']:.3f}" if row["val_accuracy"] is not None else "-",
                      f"{row['error']:.1e}" if row["error"] is not None else "-", row["why"] or "-"])
    print_table(f"mlp layers={LAYERS} width={args.width} on tight4 (2 GiB boards)",
                ["run", "exit", "peak GiB / limit per board", "s", "samples/s", "val acc", "vs 1 process", "why not"],
                cells, caption=f"bound {BOUND:g}; the piped run: --pipeline {PIPELINE} --micro-batches 2 "
                               "--stage-sync checkpoint")
    alone, piped = rows[0], rows[1]
    ok = alone["code"] != 0 and piped["code"] == 0 and piped["error"] is not None and piped["error"] <= BOUND
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
