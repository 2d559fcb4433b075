"""``edge-coordinator exporter``: serve the fleet's boards to Prometheus on ``/metrics`` until stopped.

The service behind ``systemd/edge-exporter.service``; the metrics are described in docs/monitoring.md.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from edgefleet.coordinator.cli.shared import board_count, load_config
from edgefleet.coordinator.control.fleet import DEFAULT_MAX_BOARDS
from edgefleet.coordinator.exporter.metrics_server import DEFAULT_LISTEN, LISTEN_HELP, parse_listen, serve_fleet_metrics
from edgefleet.protocol.address import HostPort
from edgefleet.protocol.errors import ConfigError

EXPORTER_EPILOG = """\
examples:
  edge-coordinator exporter                              serve http://127.0.0.1:9465/metrics
  edge-coordinator --broker 10.0.0.2:1883 exporter --listen 10.0.0.5:9465

Each scrape shows every board whose last sample is fresh (newer than 3 of its telemetry intervals):
levels as gauges (edgefleet_board_power_watts{board_id="pi-1"}, memory, temperature), rates as counters
for rate() (edgefleet_board_cpu_seconds_total, _network_receive_bytes_total, _energy_joules_total), and
edgefleet_board_power_info{board_id,power_source} 1. A board that goes stale or offline drops out;
edgefleet_fleet_boards{health="stale"} counts it. SIGTERM or Ctrl-C stops the exporter cleanly.
Scrape configuration, metric list and Grafana dashboards (grafana/): docs/monitoring.md.
"""


def listen_address(what: str) -> Any:
    """An argparse ``type=`` for ``HOST:PORT``: a bad address is a usage error naming ``what``."""
    def parse(text: str) -> HostPort:
        try:
            return parse_listen(text, what=what)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_exporter_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``exporter`` command to the top-level subparsers ``sub``."""
    p = sub.add_parser("exporter", help="serve every board's telemetry to Prometheus on /metrics (a long-running service)",
                       description="Follow the fleet on the broker and serve each board's state, CPU, memory, network, "
                                   "temperature, power and energy (measured or estimated) as Prometheus metrics, "
                                   "labelled board_id, until SIGTERM or Ctrl-C.",
                       epilog=EXPORTER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=listen_address("--listen"), default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address of the HTTP endpoint (default {DEFAULT_LISTEN}: this machine only). {LISTEN_HELP}.")
    p.add_argument("--max-boards", type=board_count, default=DEFAULT_MAX_BOARDS, metavar="N",
                   help=f"follow at most N boards; edgefleet_fleet_ignored_boards counts the rest (default {DEFAULT_MAX_BOARDS})")


def cmd_exporter(args: argparse.Namespace) -> int:
    """``edge-coordinator exporter``; serves until SIGTERM or SIGINT, then returns 0."""
    listen = args.listen if isinstance(args.listen, HostPort) else parse_listen(args.listen)
    cfg = load_config(args)
    # A signal only sets the event, so the server and the broker connection are closed in order.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with serve_fleet_metrics(cfg.broker, listen, max_boards=args.max_boards) as endpoint:
            print(f"edge-coordinator exporter: serving {endpoint.url} for the fleet on {cfg.broker.address()}", flush=True)
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["add_exporter_parser", "cmd_exporter", "listen_address"]
