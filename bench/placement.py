"""Layer placement against data-parallel on the lab, side by side in one run, and the planner's choice between them.

What is measured: ``bench/scaling.py``'s runs (real ``edge-coordinator train`` through the emulated
lab, default flags, the planned split, ``--no-rebalance``) in two modes: ``exact`` (data-parallel)
and ``placed`` (``--placement net.6``: LeNet-5's flatten, resnet_small's flatten before its dense
layer, conv_mlp's flatten before its wide dense head), for every board count of ``--boards`` on
each fleet of ``--fleets`` and each model of ``--models``: LeNet-5, resnet_small and conv_mlp,
issue 34's model with a large fully connected layer (two small convolutions, 5,056 parameters and
most of a sample's compute, then 535,562 parameters in its dense head: 2.1 MB of gradient each way
in data-parallel, 20 KiB of head gradient and 2 KiB a sample each way placed). The placed runs get
the planner's split for placement (the per-sample activation bytes and the head's share of the
compute, from the cuts ``edge-coordinator profile`` measured on the coordinator:
``coordinator.planning.layer_profile``); the one-board runs take the whole batch.

Per fleet, model and board count, data-parallel against placement (the table, last):

* KiB per step and board (both ways: the gradient exchange's bytes, plus a placed run's
  activation rounds, welcomes included, over the run's steps and boards) and their ratio;
* the median step period and the planner's predicted step time (the cost model from the run's
  profile), samples/s, time to the workload's target accuracy, and the speed-up over the best single
  board in data-parallel (scaling.py's baseline, the same run);
* which mode the planner predicts faster and which was measured faster (time to target, else
  samples/s): the agreement count is issue 34's "the planner's choice between data-parallel and
  placement is the measured faster one";
* per fleet and model, the planner's pick among the measured configurations (the least predicted
  step time, and of those within ``plan``'s ``--fewer-boards-within`` the fewest boards; the real
  planner searches every subset of boards, this picks among the k fastest) and its measured
  speed-up to target.

Run as root from the repository root: ``python bench/placement.py`` (fleet8 and mixed4, LeNet-5,
resnet_small and conv_mlp, 1, 2, 3, 4 and 8 boards: 54 runs and 6 profiles; about 40 min on a
2-core machine, an estimate: LeNet-5 and resnet_small took about 25, and conv_mlp's data-parallel
runs wait on its gradient over the Wi-Fi boards' links; scaling's ``--max-minutes`` is 90 here
unless given), ``--fleets fleet8 --models lenet5 --boards 1 2 3`` for a quicker look. Scaling's
progress goes to stderr and its own table is printed first. Exit status: scaling's (0 when every
run was made).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import scaling
from _table import print_table  # bench/ is the script's folder, first on sys.path

from edgefleet.coordinator.planning.search import FEWER_BOARDS_WITHIN

MODES = ("exact", "placed")
# Runs of one configuration differ by a few percent on the lab (others' load, the hypervisor): a measured difference
# below this is a tie, where either choice is as fast as the runs can tell.
TIE = 0.03
MAX_MINUTES = 90  # scaling's --max-minutes unless the command line gives one (its own default, 60, is too short here)


def _pairs(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, dict[str, Any]]]:
    """(fleet, model, boards) -> mode -> the row (scaling's ``Row`` as JSON)."""
    pairs: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        run = row["run"]
        pairs.setdefault((run["fleet"], run["model"], len(run["boards"])), {})[run["mode"]] = row
    return pairs


def _faster(a: float | None, b: float | None) -> str:
    """``exact`` when ``a`` (data-parallel's time) is the smaller, ``placed`` when ``b`` is, "-" when unknown."""
    if a is None or b is None:
        return "-"
    return "exact" if a <= b else "placed"


def _measured_faster(dp: dict[str, Any], placed: dict[str, Any]) -> str:
    d, p = dp["run"], placed["run"]
    if d["time_to_target_s"] is not None and p["time_to_target_s"] is not None:
        return _faster(d["time_to_target_s"], p["time_to_target_s"])
    rate_d, rate_p = d["samples_per_s"], p["samples_per_s"]
    return _faster(1 / rate_d if rate_d else None, 1 / rate_p if rate_p else None)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _difference(dp: dict[str, Any], placed: dict[str, Any]) -> float | None:
    """Placement's time to target (else its time per sample) against data-parallel's, minus one."""
    d, p = dp["run"], placed["run"]
    if d["time_to_target_s"] and p["time_to_target_s"]:
        return float(p["time_to_target_s"] / d["time_to_target_s"] - 1.0)
    if d["samples_per_s"] and p["samples_per_s"]:
        return float(d["samples_per_s"] / p["samples_per_s"] - 1.0)
    return None


def comparison(rows: list[dict[str, Any]]) -> tuple[list[list[str]], int, int, int, list[str]]:
    """The table's cells; the agreements, the cases compared and the ties among the disagreements (a measured
    difference under :data:`TIE`); one line per fleet and model on the planner's pick."""
    cells, agree, cases, ties = [], 0, 0, 0
    for (fleet, model, boards), by_mode in sorted(_pairs(rows).items()):
        dp, placed = by_mode.get("exact"), by_mode.get("placed")
        if dp is None or placed is None:
            continue
        d, p = dp["run"], placed["run"]
        predicted = _faster(d["predicted_step_s"], p["predicted_step_s"])
        measured = _measured_faster(dp, placed)
        difference = _difference(dp, placed)
        if "-" not in (predicted, measured) and boards > 1:
            cases += 1
            agree += predicted == measured
            ties += predicted != measured and difference is not None and abs(difference) < TIE
        kib = (d["kb_per_step_board"], p["kb_per_step_board"])
        cells.append([fleet, model, str(boards),
                      f"{_cell(kib[0], '.0f')} / {_cell(kib[1], '.0f')}",
                      _cell(kib[1] / kib[0] if kib[0] and kib[1] else None, '.2f'),
                      f"{_cell(d['median_period_s'] and d['median_period_s'] * 1e3, '.0f')} / "
                      f"{_cell(p['median_period_s'] and p['median_period_s'] * 1e3, '.0f')}",
                      f"{_cell(d['predicted_step_s'] and d['predicted_step_s'] * 1e3, '.0f')} / "
                      f"{_cell(p['predicted_step_s'] and p['predicted_step_s'] * 1e3, '.0f')}",
                      f"{_cell(d['samples_per_s'], '.0f')} / {_cell(p['samples_per_s'], '.0f')}",
                      f"{_cell(d['time_to_target_s'], '.1f')} / {_cell(p['time_to_target_s'], '.1f')}",
                      f"{_cell(dp['speed_up_target'], '.2f')} / {_cell(placed['speed_up_target'], '.2f')}",
                      _cell(difference and difference * 100, "+.0f"), f"{predicted} / {measured}"])
    picks = []
    for fleet, model in sorted({(r["run"]["fleet"], r["run"]["model"]) for r in rows}):
        mine = [r for r in rows if (r["run"]["fleet"], r["run"]["model"]) == (fleet, model)
                and r["run"]["predicted_step_s"] is not None and r["run"]["mode"] in MODES]
        if mine:
            best = min(r["run"]["predicted_step_s"] for r in mine)  # as plan: of the near ties, the fewest boards
            near = [r for r in mine if r["run"]["predicted_step_s"] <= best * (1 + FEWER_BOARDS_WITHIN)]
            pick = min(near, key=lambda r: (len(r["run"]["boards"]), r["run"]["predicted_step_s"]))
            run = pick["run"]
            picks.append(f"{fleet} {model}: the planner's pick among these is {run['mode']} on {len(run['boards'])} "
                         f"board(s) ({','.join(map(str, run['batch_sizes']))}): measured {_cell(pick['speed_up_target'], '.2f')}x "
                         "the best single board's time to target")
    return cells, agree, cases, ties, picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other flags go to bench/scaling.py (e.g. --steal-retakes 0).")
    parser.add_argument("--fleets", nargs="+", default=["fleet8", "mixed4"])
    parser.add_argument("--models", nargs="+", default=["lenet5", "resnet_small", "conv_mlp"],
                        choices=list(scaling.WORKLOADS))
    parser.add_argument("--boards", nargs="+", default=["1", "2", "3", "4", "8"])
    parser.add_argument("--json", type=Path, metavar="OUT", help="keep scaling's figures here (default: not kept)")
    args, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="efl-placement-") as tmp:
        out = args.json or Path(tmp) / "scaling.json"
        code = scaling.main(["--fleets", *args.fleets, "--models", *args.models, "--boards", *args.boards,
                             "--modes", ",".join(MODES), "--json", str(out), "--max-minutes", str(MAX_MINUTES), *rest])
        if not out.exists():
            return code
        data = json.loads(out.read_text())
    cells, agree, cases, ties, picks = comparison(data["rows"])
    caption = [f"The planner's choice between data-parallel and placement is the measured faster one in {agree} of "
               f"{cases} multi-board cases (predicted / measured faster, by time to target, else samples/s); {ties} of "
               f"the others are ties, measured less than {TIE:.0%} apart (placed %: placement's time against "
               "data-parallel's).",
               *picks,
               "KiB/step/board: both ways, gradient exchange plus activation rounds (welcomes included). Step: the median "
               "period; predicted: the cost model's step from the run's profile. Speed-up: time to target against the best "
               "single board in data-parallel, in this run."]
    print_table("Layer placement against data-parallel (exact / placed in every cell)",
                ["fleet", "model", "boards", "KiB/step/board", "ratio", "step ms", "predicted ms", "samples/s",
                 "to target s", "speed-up", "placed %", "faster: predicted / measured"],
                cells, caption="\n".join(caption), left_columns=3, min_width=160)
    return code


if __name__ == "__main__":
    sys.exit(main())
