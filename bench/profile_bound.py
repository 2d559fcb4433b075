"""How much faster than its best board can a fleet be at best? The ceiling a profile's figures allow.

Why: issue 22 asks for speed-ups (resnet_small 3x at 8 boards; LeNet-5 1.5x exact and 2.5x with an
inexact mode) on the lab's fleet8. Before measuring, this says what the boards' own step costs allow.
Each board's step takes ``a + b*n`` (a: its fixed cost per step: Lightning's loop, the optimizer,
hooks; b: per sample; both fitted over the profile's batch sizes) plus its exchange round (the
profile's measured round over its link: the vector up and the average down). A configuration's
step period is at least the time the slowest of its boards needs when the global batch is split
so that all finish together (water-filling: a board whose fixed cost alone exceeds the period gets
no samples). This ignores the coordinator, waiting and noise: a run can only come in under it.
The arithmetic is ``_harness.board_costs`` and ``_harness.best_by_size`` (``bench/scaling.py`` prints
the same ceiling under its table).

Columns, each as a speed-up over the best single board at the same global batch, the single board
paying its exchange round in the modes that have one (a single board trains through the exchange
too):
* exact: every board pays its round every step;
* local SGD H: every board pays its round every H-th step and a small round (``--small-round-ms``)
  at the others (``train --sync-every H``: the bookkeeping round a local step makes);
* no exchange: compute only, the fleet's ceiling whatever the mode.

Input: a profile written by ``edge-coordinator profile --profile FILE`` (``bench/scaling.py
--keep-runs DIR`` keeps the ones it takes, as ``DIR/<fleet>/profile-<model>.json``).

    python bench/profile_bound.py PROFILE.json --global-batch 256

Exit code 0; 2 if the profile cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _harness import best_by_size, board_costs  # bench/ is the script's folder, first on sys.path
from _table import print_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Exit code 0; 2 if the profile cannot be read.")
    parser.add_argument("profile", type=Path, help="a profile JSON (edge-coordinator profile --profile FILE)")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step, all boards together")
    parser.add_argument("--sync-every", type=int, default=8, help="H of the local-SGD column (default 8)")
    parser.add_argument("--small-round-ms", type=float, default=2.0,
                        help="the round a local step still makes (default 2 ms: a small frame each way)")
    args = parser.parse_args()
    if args.global_batch < 1 or args.sync_every < 1:
        parser.error("--global-batch and --sync-every must be at least 1")
    try:
        costs = board_costs(json.loads(args.profile.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"profile_bound: cannot read {args.profile} as a profile ({type(exc).__name__}: {exc}); give a file "
              "written by `edge-coordinator profile --profile FILE`", file=sys.stderr)
        return 2
    small = args.small_round_ms / 1e3
    modes = {
        "exact": {b.board_id: b.round_s for b in costs},
        f"local SGD H={args.sync_every}": {b.board_id: b.round_s / args.sync_every + small * (1 - 1 / args.sync_every)
                                           for b in costs},
        "no exchange": {b.board_id: 0.0 for b in costs},
    }
    single_exact = min(b.fixed_s + b.round_s + args.global_batch * b.per_sample_s for b in costs)
    single_compute = min(b.fixed_s + args.global_batch * b.per_sample_s for b in costs)
    bests = {mode: best_by_size(costs, extra, args.global_batch) for mode, extra in modes.items()}
    for b in costs:
        print(f"{b.board_id}: a = {b.fixed_s * 1e3:.1f} ms, b = {b.per_sample_s * 1e3:.2f} ms/sample, "
              f"round {b.round_s * 1e3:.1f} ms")
    rows = []
    for size in range(1, len(costs) + 1):
        row = [str(size)]
        for mode in modes:
            t, subset = bests[mode][size]
            baseline = single_compute if mode == "no exchange" else single_exact
            row.append(f"{baseline / t:.2f}x ({t * 1e3:.0f} ms: {','.join(subset)})")
        rows.append(row)
    print_table(f"The ceiling: speed-up over the best single board at global batch {args.global_batch} ({args.profile.name})",
                ["boards", *modes], rows,
                caption=f"The best single board: {single_exact * 1e3:.0f} ms a step with its round, {single_compute * 1e3:.0f} "
                        "ms without (the no-exchange column's baseline). Per board count the fastest subset; the step "
                        "period in brackets. Coordinator, waiting and noise left out: measured runs come in under it.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
