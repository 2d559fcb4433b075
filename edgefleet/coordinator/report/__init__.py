"""Run reports (``edge-coordinator report``): one HTML page with plots of what a run did.

:func:`~.run_data.load_run` reads a run directory (whatever a crash left of it),
:mod:`.plots` draws the PNGs, :mod:`.html_page` lays them out, and :func:`~.report_file.write_report`
puts it together; :func:`~.report_file.write_comparison` overlays several runs (:mod:`.compare`).
:class:`~.power_log.PowerLog` records the boards' power, CPU and temperature while a run trains.
"""

from edgefleet.coordinator.report.power_log import POWER_FILE, PowerLog
from edgefleet.coordinator.report.report_file import write_comparison, write_report
from edgefleet.coordinator.report.run_data import RunData, load_run

__all__ = ["POWER_FILE", "PowerLog", "RunData", "load_run", "write_comparison", "write_report"]
