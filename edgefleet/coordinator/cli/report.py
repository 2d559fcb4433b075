"""``edge-coordinator report RUN_DIR [RUN_DIR ...]``: one HTML page with plots of what a run did, or of several
runs overlaid."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgefleet.coordinator.report import write_comparison, write_report

REPORT_EPILOG = """\
examples:
  edge-coordinator report runs/lenet5-digits-20261121-101500-ab12
  edge-coordinator report runs/my-run --output /srv/www/my-run.html
  edge-coordinator report runs/run-a runs/run-b -o compare.html

The page is one self-contained file (its PNG plots are embedded): loss and validation metrics over
steps and over time, each board's step time and batch size, re-balancing events, power and energy
per board (when the run's power was logged), and the plan's prediction against the measurement
(train --auto), with the run's hyperparameters, its learning rate and each board's CPU and temperature.
A run that crashed or was not planned still gets a page that says what is missing.

Two or more run directories get one page that overlays them: loss, validation accuracy, samples/s
and learning rate over steps and over time, each run labelled, and their hyperparameters side by
side (default ./comparison.html).
"""


def add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``report`` command to the top-level subparsers ``sub``."""
    p = sub.add_parser("report", help="write an HTML page with plots of a run (loss, step times, power, plan vs measured)",
                       description="Write one self-contained HTML page with PNG plots of a training run, from its run "
                                   "directory.", epilog=REPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                   help="the run directory train printed (runs/<run-id>); several: one page comparing them")
    p.add_argument("--output", "-o", type=Path, metavar="FILE",
                   help="where to write the page (default RUN_DIR/report.html; for several runs ./comparison.html)")


def cmd_report(args: argparse.Namespace) -> int:
    """``edge-coordinator report``; returns the exit status (a bad RUN_DIR raises ConfigError, one line)."""
    if len(args.run_dirs) == 1:
        print(f"report: {write_report(args.run_dirs[0], args.output)}")
    else:
        print(f"report: {write_comparison(args.run_dirs, args.output)}")
    return 0


__all__ = ["add_report_parser", "cmd_report"]
