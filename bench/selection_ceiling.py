"""Which misses of a selection run are noise: re-draw every configuration from its own repeats.

Reads the ``--json`` file of ``bench/selection_accuracy.py``. For each case it draws ``--draws``
simulated re-runs: every configuration measured more than once gets the median of as many figures
drawn, with replacement, from its own samples; a configuration measured once keeps its figure. It
then counts how often the best measured configuration ("oracle") and the planner's pick come
within 3% of the simulated best. An oracle near 100% with the pick near 0% is a model error; both
well under 100% is a near tie that the lab's noise decides. Repeats come only from the front
runners and the picks, so the spread is if anything underestimated.

    python bench/selection_ceiling.py sel.json

The table is printed last, with the expected hit rate of the oracle and of the planner's picks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from _harness import HIT_TOLERANCE  # bench/ is the script's folder, first on sys.path
from _table import print_table

from edgefleet.coordinator.planning.objectives import OBJECTIVE_KEY


def _redraw(samples: dict[str, list[float]], rng: random.Random) -> dict[str, float]:
    return {name: statistics.median(rng.choice(values) for _ in values) if len(values) > 1 else values[0]
            for name, values in samples.items()}


def ceiling(row: dict[str, Any], case: dict[str, Any], draws: int, rng: random.Random) -> tuple[float, float]:
    """Shares of the draws in which the best measured configuration and the pick were hits."""
    key = OBJECTIVE_KEY[row["objective"]]
    samples = {"+".join(run["boards"]): [s[key] for s in run["samples"]] for run in case["runs"]}
    medians = {name: statistics.median(values) for name, values in samples.items()}
    best = min(medians, key=medians.__getitem__)
    oracle = pick = 0
    for _ in range(draws):
        drawn = _redraw(samples, rng)
        floor = (1 + HIT_TOLERANCE) * min(drawn.values())
        oracle += drawn[best] <= floor
        pick += drawn.get(row["pick"], float("inf")) <= floor
    return oracle / draws, pick / draws


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="the --json file of bench/selection_accuracy.py")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        data = json.loads(args.json.read_text())
        rows, results = data["rows"], data["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{args.json}: not a selection_accuracy.py --json file ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    table: list[list[str]] = []
    oracle_sum = pick_sum = 0.0
    for row in rows:
        case = next(c for c in results[row["fleet"]]["cases"] if c["case"] == row["case"])
        oracle, pick = ceiling(row, case, args.draws, rng)
        oracle_sum, pick_sum = oracle_sum + oracle, pick_sum + pick
        table.append([row["fleet"], row["case"], row["objective"], "hit" if row["hit"] else "MISS",
                      f"{oracle:.0%}", f"{pick:.0%}"])
    table.append(["expected", "hit rate", "", f"{sum(r['hit'] for r in rows) / len(rows):.1%}",
                  f"{oracle_sum / len(rows):.1%}", f"{pick_sum / len(rows):.1%}"])
    print_table(f"{args.json.name}: hits over {args.draws} re-drawn runs",
                ["fleet", "model", "objective", "measured", "oracle", "pick"], table, left_columns=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
