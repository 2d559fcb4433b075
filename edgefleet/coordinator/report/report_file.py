"""Write a run's report page: the service behind ``edge-coordinator report``."""

from __future__ import annotations

import logging
from pathlib import Path

from edgefleet.coordinator.report.run_data import load_run
from edgefleet.protocol.errors import ConfigError
from edgefleet.transport.atomic_file import write_atomically

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"


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
    if target.is_dir():
        raise ConfigError(f"--output {target} is a folder; give a file name such as {target / REPORT_FILE}")
    try:
        write_atomically(target, page.encode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {target}: {exc.strerror or exc}; choose another --output") from None
    log.info("%s: report with %d step(s) written to %s", run_dir, len(run.steps), target)
    return target


__all__ = ["REPORT_FILE", "write_report"]
