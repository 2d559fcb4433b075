"""Do the robust aggregation rules (``--aggregate``) hold accuracy when one board lies? Local data, in one process.

Issue 36: with ``--data-mode local`` the coordinator cannot audit, and a robust rule must keep a
board with valid keys from steering the model: the final accuracy with the liar within 1 point of
the same rule's run without it. This simulates the fleet's local-data mode in one process with
plain torch loops and the exchange's own rules (``bench/_robust_fleet.py``, which
tests/coordinator/test_robust_accuracy.py runs too, on a small MLP):

* LeNet-5 (``workloads.registry.build_model``, ``torch.manual_seed(seed)`` first) with SGD, on
  scikit-learn's digits (``build_dataset("digits")``), as tests/hostile/test_gradient_audits.py trains it;
* ``--boards`` boards (default 3 and 5), each drawing ``--batch`` samples a step from its own data
  (the whole training split, as the fleet's local-data tests give every board digits; ``--disjoint``:
  a disjoint shard each), all starting from one model;
* every step each board computes its mean gradient on its batch; the last board lies from step 3 on:
  ``scale`` sends 2,000x its gradient, ``flip`` sends it turned around (honest norm), ``honest`` does
  not lie; the rule reduces the boards' gradients and one optimizer step follows (every replica
  takes the same step, as the fleet's do);
* the rules: ``median``, ``trimmed-mean``, ``clip`` (as ``--aggregate``), and ``mean``, the exact mode
  (with a 2,000x liar the fleet's norm band refuses its gradient at the mean; here it shows what the
  rules are for).

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _robust_fleet import ATTACKS, LIE_FROM, Outcome, Workload, change, load_data, simulate

from bench._table import print_table
from edgefleet.coordinator.exchange.robust_reduce import CLIP_FACTOR

RULES = ("median", "trimmed-mean", "clip", "mean")


def summary(outcomes: Sequence[Outcome]) -> list[list[str]]:
    """One row per rule, board count and attack: mean accuracies, and an attack's change against the honest run."""
    rows = []
    keys = sorted({(o.rule, o.boards) for o in outcomes}, key=lambda k: (RULES.index(k[0]), k[1]))
    for rule, boards in keys:
        for attack in ATTACKS:
            runs = [o for o in outcomes if (o.rule, o.boards, o.attack) == (rule, boards, attack)]
            if not runs:
                continue
            final = statistics.fmean(o.final for o in runs)
            last3 = statistics.fmean(o.last(3) for o in runs)
            if attack == "honest":
                rows.append([rule, str(boards), attack, f"{100 * final:.1f}", f"{100 * last3:.1f}", "", ""])
                continue
            d_final, d_last3 = change(outcomes, rule, boards, attack)
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
    parser.add_argument("--disjoint", action="store_true", help="each board a disjoint shard of the split")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = Workload(model="lenet5", model_options={"optimizer": "sgd", "lr": args.lr}, batch=args.batch,
                        steps=args.steps, eval_every=args.eval_every, disjoint=args.disjoint)
    data = load_data(workload)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    for boards in args.boards:
        for rule in args.rules:
            for attack in ATTACKS:
                for seed in range(args.seeds):
                    o = simulate(rule, boards, attack, seed, workload, data)
                    outcomes.append(o)
                    print(f"  {rule} {boards} boards {attack} seed {seed}: final {100 * o.final:.1f}%, last three "
                          f"{100 * o.last(3):.1f}% ({time.monotonic() - started:.0f} s)", flush=True)
    shards = "a disjoint shard each" if args.disjoint else "each the whole split"
    print_table(f"robust aggregation in local data mode: LeNet-5 on digits ({shards}), SGD {args.lr}, {args.batch} samples a "
                f"board a step, {args.steps} steps, the last board lies from step {LIE_FROM}, {args.seeds} seed(s), clip at "
                f"{CLIP_FACTOR:g}x the median norm; accuracy in %, change against the same rule's honest run (final / last "
                "three evaluations), in points",
                ["rule", "boards", "attack", "final", "last 3", "change", "within 1 point"], summary(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
