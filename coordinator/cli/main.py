"""``edge-coordinator``: see the fleet, and (later) profile, plan and train on it."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.protocol.address import BROKER_ENV, parse_host_port
from edgefleet.protocol.errors import EdgeTrainError

if TYPE_CHECKING:
    from edgefleet.coordinator.fleet import FleetView

log = logging.getLogger("edgefleet.coordinator")

EPILOG = f"""\
examples:
  edge-coordinator demo                                  train LeNet-5 on digits on 3 local agents (embedded broker)
  edge-coordinator status                                one table of every board (broker from ${BROKER_ENV} or localhost)
  edge-coordinator status --watch                        the same, live, until Ctrl-C
  edge-coordinator --broker 10.0.0.2:1883 status --json  for scripts
  edge-coordinator profile --model lenet5 --dataset digits   time every board at a few batch sizes
  edge-coordinator plan --objective edp --max-power 20   the best configuration: a table and a Pareto PNG
  edge-coordinator train --auto --objective edp          profile (or reuse), plan, train, compare

the broker: --broker HOST:PORT, else ${BROKER_ENV}=HOST:PORT, else the [broker] section of --config,
else localhost:1883.
"""


def build_parser() -> argparse.ArgumentParser:
    from edgefleet import __version__

    parser = argparse.ArgumentParser(prog="edge-coordinator", description="Show, profile and train a fleet of edge boards.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", metavar="HOST:PORT", help=f"MQTT broker (default: ${BROKER_ENV}, the config file, localhost:1883)")
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML file with a [broker] section (credentials, TLS, topic prefix)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"edge-coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    status = sub.add_parser("status", help="show every board: state, CPU, memory, network, temperature, power",
                            description="Show every board that reported on the broker. A board whose last sample is older "
                                        "than 3 of its intervals is shown as stale; one that stopped or lost its connection "
                                        "as offline.")
    mode = status.add_mutually_exclusive_group()
    mode.add_argument("--watch", action="store_true", help="refresh live until Ctrl-C")
    mode.add_argument("--json", action="store_true", help="print a JSON list of boards for scripts")
    status.add_argument("--wait", type=float, default=3.0, metavar="SECONDS",
                        help="how long a snapshot waits for online boards' first samples (default 3)")

    from edgefleet.coordinator.train_cli import add_train_parser

    add_train_parser(sub)

    from edgefleet.coordinator.profile_cli import add_profile_parser

    add_profile_parser(sub)

    from edgefleet.coordinator.plan_cli import add_plan_parser

    add_plan_parser(sub)

    demo = sub.add_parser("demo", help="train LeNet-5 on digits on a local fleet of 3 agents (embedded defaults)",
                          description="Start a private broker on a free loopback port, spawn local agents with a fresh "
                                      "fleet key, and train LeNet-5 on scikit-learn's digits through the real path "
                                      "(signed commands, the TCP gradient exchange, Lightning on every board). Nothing "
                                      "listens beyond 127.0.0.1; everything stops at the end or on Ctrl-C.")
    demo.add_argument("--boards", type=int, default=3, metavar="N", help="how many local agents (default 3)")
    demo.add_argument("--fleet-only", action="store_true", help="only show the fleet's live telemetry, no training")
    demo.add_argument("--seconds", type=float, default=20.0, metavar="S",
                      help="with --fleet-only: how long to show the fleet (default 20; 0 = until Ctrl-C)")
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("paho").setLevel(logging.WARNING)


def _require_rich() -> None:
    try:
        import rich  # noqa: F401
    except ImportError:
        raise EdgeTrainError("edge-coordinator needs the 'rich' package: pip install 'edgefleet[coordinator]'") from None


def _cmd_status(args: argparse.Namespace) -> int:
    from edgefleet.coordinator.config import load_coordinator_config
    from edgefleet.coordinator.monitor import monitor_fleet, wait_for_snapshot

    broker = parse_host_port(args.broker, what="--broker") if args.broker else None
    cfg = load_coordinator_config(args.config, broker=broker)
    if not args.json:
        _require_rich()
    with monitor_fleet(cfg.broker) as view:
        if args.watch:
            _watch(view, title=f"edgefleet @ {cfg.broker.address()}")
            return 0
        wait_for_snapshot(view, timeout_s=args.wait)
        rows = view.rows()
    if args.json:
        json.dump([r.to_dict() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from edgefleet.coordinator.render import fleet_table, make_console

        make_console().print(fleet_table(rows, title=f"edgefleet @ {cfg.broker.address()}"))
    return 0


def _watch(view: FleetView, *, title: str, seconds: float = 0.0) -> None:
    from rich.live import Live

    from edgefleet.coordinator.render import fleet_table, make_console

    deadline = time.monotonic() + seconds if seconds > 0 else float("inf")
    # Ctrl-C only sets a flag, so it ends the view cleanly wherever it lands (even mid-draw).
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        with Live(fleet_table(view.rows(), title=title), console=make_console(), refresh_per_second=4) as live:
            while not stop.wait(0.5) and time.monotonic() < deadline:
                live.update(fleet_table(view.rows(), title=title))
    finally:
        signal.signal(signal.SIGINT, previous)


def _cmd_demo(args: argparse.Namespace) -> int:
    from edgefleet.coordinator.demo import run_demo

    _require_rich()
    if args.boards < 1:
        raise EdgeTrainError("--boards must be at least 1")
    return run_demo(boards=args.boards, seconds=args.seconds, fleet_only=args.fleet_only, watch=_watch)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    from edgefleet.coordinator.plan_cli import cmd_plan
    from edgefleet.coordinator.train_cli import cmd_train

    commands = {"status": _cmd_status, "demo": _cmd_demo, "train": cmd_train}
    commands["plan"] = cmd_plan
    from edgefleet.coordinator.profile_cli import cmd_profile

    commands["profile"] = cmd_profile
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return commands[args.command](args)
    except EdgeTrainError as exc:
        print(f"edge-coordinator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
