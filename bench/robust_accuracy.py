"""Do the robust aggregation rules (``--aggregate``) hold accuracy when one board lies? Local data, in one process.

Issue 36: with ``--data-mode local`` the coordinator cannot audit, and a robust rule must keep a
board with valid keys from steering the model: the final accuracy with the liar within 1 point of
the same rule's run without it. This simulates the fleet's local-data mode in one process with
plain torch loops and the exchange's own rules (``coordinator.exchange.robust_reduce.aggregate``):

* LeNet-5 (``workloads.registry.build_model``, ``torch.manual_seed(seed)`` first) with SGD, on
  scikit-learn's digits (``build_dataset("digits")``), as tests/hostile/test_gradient_audits.py trains it;
* ``--boards`` boards (default 3 and 5), each drawing ``--batch`` samples a step from its own stream
  (``workloads.sharding.LocalBatchPlan``, board seed = its index), all starting from one model;
* every step each board computes its mean gradient on its batch; the last board lies from step 3 on:
  ``scale`` sends 2,000x its gradient, ``flip`` sends it turned around (honest norm), ``honest`` does
  not lie; the rule reduces the boards' gradients and one optimizer step follows (every replica
  takes the same step, as the fleet's do);
* the rules: ``median``, ``trimmed-mean``, ``clip`` (as ``--aggregate``), and ``mean`` only for the
  honest control (with a 2,000x liar the fleet's norm band refuses its gradient at the mean anyway).

Figures per rule, board count, attack and seed: validation accuracy at the end and the mean of the
last three evaluations (every ``--eval-every`` steps); the table (last) gives each attack's change
against the same rule's honest run on the same seeds, in points, and whether it is within 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._table import print_table
from edgefleet.coordinator.exchange.robust_reduce import aggregate
from edgefleet.workloads.registry import build_dataset, build_model
from edgefleet.workloads.sharding import LocalBatchPlan

LIE_FROM = 3
ATTACKS = ("honest", "scale", "flip")
RULES = ("median", "trimmed-mean", "clip", "mean")


@dataclass(frozen=True)
class Outcome:
    rule: str
    boards: int
    attack: str
    seed: int
    final: float
    last3: float


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    model.train()
    return correct / len(y)


def run_one(rule: str, boards: int, attack: str, seed: int, *, steps: int, batch: int, lr: float,
            eval_every: int, data: tuple) -> Outcome:
    train, (val_x, val_y) = data
    torch.manual_seed(seed)
    model = build_model("lenet5", {"optimizer": "sgd", "lr": lr}, data=train)
    optimizer = model.configure_optimizers()
    optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    plans = [LocalBatchPlan(len(train), batch, seed, board_seed=i) for i in range(boards)]
    rows = np.empty((boards, sum(p.numel() for p in params)), dtype=np.float32)
    out = np.empty(rows.shape[1], dtype=np.float32)
    accuracies: list[float] = []
    for step in range(steps):
        for i, plan in enumerate(plans):
            samples = [train[j] for j in plan.indices(step)]
            xb = torch.stack([s[0] for s in samples])
            yb = torch.as_tensor([int(s[1]) for s in samples])
            model.zero_grad(set_to_none=True)
            model.training_step((xb, yb), step).backward()
            rows[i] = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
        if step >= LIE_FROM and attack != "honest":
            rows[-1] *= 2000.0 if attack == "scale" else -1.0
        if rule == "mean":  # the exact mode's sample-weighted mean (equal batches: the plain mean)
            np.mean(rows, axis=0, dtype=np.float32, out=out)
        else:
            aggregate(rule, rows, [batch] * boards, out)
        start = 0
        for p in params:
            p.grad = torch.from_numpy(out[start:start + p.numel()].copy()).reshape(p.shape)
            start += p.numel()
        optimizer.step()
        if (step + 1) % eval_every == 0:
            accuracies.append(_accuracy(model, val_x, val_y))
    return Outcome(rule, boards, attack, seed, accuracies[-1], statistics.fmean(accuracies[-3:]))


def _data() -> tuple:
    train = build_dataset("digits", "train", {})
    val = build_dataset("digits", "val", {})
    xs = torch.stack([val[i][0] for i in range(len(val))])
    ys = torch.as_tensor([int(val[i][1]) for i in range(len(val))])
    return train, (xs, ys)


def summary(outcomes: Sequence[Outcome]) -> list[list[str]]:
    rows = []
    keys = sorted({(o.rule, o.boards) for o in outcomes}, key=lambda k: (RULES.index(k[0]) if k[0] in RULES else -1, k[1]))
    for rule, boards in keys:
        honest = {o.seed: o for o in outcomes if (o.rule, o.boards, o.attack) == (rule, boards, "honest")}
        for attack in ATTACKS:
            runs = [o for o in outcomes if (o.rule, o.boards, o.attack) == (rule, boards, attack)]
            if not runs:
                continue
            final = statistics.fmean(o.final for o in runs)
            last3 = statistics.fmean(o.last3 for o in runs)
            if attack == "honest":
                rows.append([rule, str(boards), attack, f"{100 * final:.1f}", f"{100 * last3:.1f}", "", ""])
                continue
            d_final = statistics.fmean(o.final - honest[o.seed].final for o in runs if o.seed in honest)
            d_last3 = statistics.fmean(o.last3 - honest[o.seed].last3 for o in runs if o.seed in honest)
            within = "yes" if d_final >= -0.01 and d_last3 >= -0.01 else "no"
            rows.append([rule, str(boards), attack, f"{100 * final:.1f}", f"{100 * last3:.1f}",
                         f"{100 * d_final:+.1f} / {100 * d_last3:+.1f}", within])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boards", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = _data()
    outcomes: list[Outcome] = []
    started = time.monotonic()
    for boards in args.boards:
        for rule in args.rules:
            for attack in ATTACKS:
                for seed in range(args.seeds):
                    o = run_one(rule, boards, attack, seed, steps=args.steps, batch=args.batch, lr=args.lr,
                                eval_every=args.eval_every, data=data)
                    outcomes.append(o)
                    print(f"  {rule} {boards} boards {attack} seed {seed}: final {100 * o.final:.1f}%, last three "
                          f"{100 * o.last3:.1f}% ({time.monotonic() - started:.0f} s)", flush=True)
    print_table(f"robust aggregation in local data mode: LeNet-5 on digits, SGD {args.lr}, {args.batch} samples a board a "
                f"step, {args.steps} steps, the last board lies from step {LIE_FROM}, {args.seeds} seed(s); accuracy in %, "
                "change against the same rule's honest run (final / last three evaluations), in points",
                ["rule", "boards", "attack", "final", "last 3", "change", "within 1 point"], summary(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
