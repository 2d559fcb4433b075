"""Write a run's report page, or one page comparing runs: the service behind ``edge-coordinator report``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from edgefleet.coordinator.report.run_data import load_run
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.atomic_file import write_atomically

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"
COMPARISON_FILE = "comparison.html"


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Read ``run_dir``, draw its plots and write the page to ``output`` (default ``run_dir/report.html``).

    A run that crashed, was never planned or logged no power still gets a page, saying what is
    missing. The page is written whole or not at all (``transport.atomic_file``).

    Returns:
        Where the page was written.

    Raises:
        ConfigError: ``run_dir`` is not a run directory, or the page cannot be written there.
    """
    # matplotlib and numpy: only to write the page
    from edgefleet.coordinator.report.html_page import render_page
    from edgefleet.coordinator.report.plots import draw_plots

    run = load_run(run_dir)
    page = render_page(run, draw_plots(run))
    target = output if output is not None else run_dir / REPORT_FILE
    _write(target, page, REPORT_FILE)
    log.info("%s: report with %d step(s) written to %s", run_dir, len(run.steps), target)
    return target


def write_comparison(run_dirs: Sequence[Path], output: Path | None = None) -> Path:
    """One page overlaying the runs of ``run_dirs`` (default ``./comparison.html``).

    Raises:
        ConfigError: one of them is not a run directory, or the page cannot be written there.
    """
    # matplotlib and numpy: only to write the page
    from edgefleet.coordinator.report.compare import comparison_plots, render_comparison, run_labels

    runs = [load_run(run_dir) for run_dir in run_dirs]
    labels = run_labels(runs)
    page = render_comparison(runs, labels, comparison_plots(runs, labels))
    target = output if output is not None else Path(COMPARISON_FILE)
    _write(target, page, COMPARISON_FILE)
    log.info("%d runs compared in %s", len(runs), target)
    return target


def _write(target: Path, page: str, default_name: str) -> None:
    if target.is_dir():
        raise ConfigError(f"--output {target} is a folder; give a file name such as {target / default_name}")
    try:
        write_atomically(target, page.encode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {target}: {exc.strerror or exc}; choose another --output") from None


__all__ = ["COMPARISON_FILE", "REPORT_FILE", "write_comparison", "write_report"]
