"""Write a run's report page: the service behind ``edge-coordinator report``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Read ``run_dir``, draw its plots and write the page to ``output`` (default ``run_dir/report.html``).

    A run that crashed, was never planned or logged no power still gets a page, saying what is
    missing. The page is written whole or not at all (a temporary file renamed into place).

    Returns:
        Where the page was written.

    Raises:
        ConfigError: ``run_dir`` is not a run directory, or the page cannot be written there.
    """
    from edgefleet.coordinator.report.html_page import render_page
    from edgefleet.coordinator.report.plots import draw_plots
    from edgefleet.coordinator.report.run_data import load_run

    run = load_run(run_dir)
    page = render_page(run, draw_plots(run))
    target = output if output is not None else run_dir / REPORT_FILE
    if target.is_dir():
        raise ConfigError(f"--output {target} is a folder; give a file name such as {target / REPORT_FILE}")
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True) if tmp.parent.is_dir() else None
        raise ConfigError(f"cannot write the report to {target}: {exc.strerror or exc}; choose another --output") from None
    log.info("%s: report with %d step(s) written to %s", run_dir, len(run.steps), target)
    return target


__all__ = ["REPORT_FILE", "write_report"]
