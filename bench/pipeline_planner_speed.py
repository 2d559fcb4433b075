"""How long ``plan --pipeline``'s search takes, one board a later stage against later groups allowed (issue 35).

Pure computation (no boards, no broker): for each fleet size of ``--boards``, a seeded random
problem of ``--layers`` layers (forward 2-20 ms and backward 4-40 ms a sample, 0.05-8 MB of
parameters, 1-100 kB of activations and 0.01-0.5 MB held a sample) on all-different boards
(speed 0.5-4, 0.6-2 GB, 5-100 MB/s links, 0-10 ms fixed cost a step), global batch 64, every M
that divides it up to 16, GPipe (what train runs): ``search_pipeline`` with ``max_later_group`` 1 (a
later stage of one board) and None (later groups, as ``plan --pipeline`` plans since 2026-11-30),
for ``--objective``. Printed per size: the CPU seconds of each and the plan each found (its step,
the boards of each stage, M); the table comes last. Six boards or more merge into kinds, so the
search is the heuristic there (``planning.pipeline_search``).

    python bench/pipeline_planner_speed.py
    python bench/pipeline_planner_speed.py --boards 6 8 --objective edp
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

from _table import print_table

from edgefleet.coordinator.planning.pipeline_model import LayerCost, PipelineBoard, PipelinePlan, PipelineProblem
from edgefleet.coordinator.planning.pipeline_search import search_pipeline

MB = 1e6


def random_problem(rng: random.Random, boards: int, layers: int) -> PipelineProblem:
    """The module doc's problem."""
    costs = tuple(LayerCost(name=f"l{i}", forward_s_per_sample=rng.uniform(2e-3, 2e-2),
                            backward_s_per_sample=rng.uniform(4e-3, 4e-2), param_bytes=int(rng.uniform(0.05, 8) * MB),
                            activation_bytes_per_sample=int(rng.uniform(1e3, 1e5)),
                            held_bytes_per_sample=int(rng.uniform(0.01, 0.5) * MB)) for i in range(layers))
    fleet = tuple(PipelineBoard(board_id=f"b{k}", speed=rng.uniform(0.5, 4),
                                memory_limit_bytes=int(rng.uniform(600, 2000) * MB),
                                link_up_bytes_per_s=rng.uniform(5, 100) * MB, link_down_bytes_per_s=rng.uniform(5, 100) * MB,
                                active_power_w=rng.uniform(5, 20), idle_power_w=rng.uniform(1, 4),
                                base_memory_bytes=int(rng.uniform(20, 50) * MB), overhead_s=rng.uniform(0, 0.01))
                  for k in range(boards))
    return PipelineProblem(layers=costs, boards=fleet, global_batch=64, dataset_len=10_000, schedules=("gpipe",))


def _plan_text(plan: PipelinePlan | None) -> str:
    if plan is None:
        return "none fits"
    return f"{plan.step_time_s * 1e3:.0f} ms, {'/'.join(str(len(s.boards)) for s in plan.stages)} M={plan.micro_batches}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--boards", nargs="+", type=int, default=[6, 8, 10, 12, 14, 16], metavar="N",
                        help="fleet sizes (default 6 8 10 12 14 16)")
    parser.add_argument("--layers", type=int, default=10, help="the model's layers (default 10)")
    parser.add_argument("--objective", default="time", choices=("time", "energy", "edp"), help="(default time)")
    parser.add_argument("--seed", type=int, default=1, help="(default 1)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for n in args.boards:
        problem = random_problem(rng, n, args.layers)
        row = [str(n)]
        for limit in (1, None):
            started = time.process_time()
            plan, _ = search_pipeline(dataclasses.replace(problem, max_later_group=limit), args.objective)
            row += [f"{time.process_time() - started:.2f}", _plan_text(plan)]
        print(f"  {n} boards: {' | '.join(row[1:])}", file=sys.stderr, flush=True)
        rows.append(row)
    print_table(f"plan --pipeline's search, {args.layers} layers, objective {args.objective}",
                ["boards", "one board a later stage: CPU s", "its plan", "later groups: CPU s", "its plan"], rows,
                caption="plan: its step, the boards of each stage, M. CPU seconds of this process (one core).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
