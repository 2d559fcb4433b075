"""``edge-agent``: the daemon that runs on every board."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from edgefleet import __version__
from edgefleet.agent.config import describe, load_agent_config
from edgefleet.agent.daemon import ExitCode, run
from edgefleet.protocol.address import BROKER_ENV, parse_host_port
from edgefleet.protocol.errors import EdgeTrainError

log = logging.getLogger("edgefleet.agent")

EPILOG = f"""\
examples:
  edge-agent --config /etc/edge-agent/agent.toml        run as configured (what systemd does)
  edge-agent --id pi-1 --broker 192.168.1.10:1883       try a board without writing a file
  edge-agent --config agent.toml --check-config         validate the file and exit

precedence: the config file, then ${BROKER_ENV}=HOST:PORT, then --id/--broker/--interval.
exit codes: 0 stopped cleanly, 2 bad usage, 78 bad configuration (systemd does not restart).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent", description="Stream this board's CPU, memory, network, temperature and power over MQTT, and run the training "
                                       "work it is given.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML config file (keys: see the README's configuration reference)")
    parser.add_argument("--id", dest="board_id", metavar="BOARD_ID", help="board id, one topic level (default: the host name)")
    parser.add_argument("--broker", metavar="HOST:PORT", help=f"MQTT broker address (default: the file, ${BROKER_ENV}, or localhost:1883)")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="seconds between telemetry samples (default 1)")
    parser.add_argument("--check-config", action="store_true", help="validate the configuration, print it and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    return parser


def configure_logging(verbose: bool) -> None:
    # journald adds its own timestamps; a terminal gets them from us.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stdout)
    logging.getLogger("paho").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        broker = parse_host_port(args.broker, what="--broker") if args.broker else None
        cfg = load_agent_config(args.config, board_id=args.board_id, broker=broker, interval_s=args.interval)
    except EdgeTrainError as exc:
        print(f"edge-agent: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    if args.check_config:
        print(describe(cfg))
        return ExitCode.OK
    try:
        return run(cfg)
    except EdgeTrainError as exc:
        log.error("%s", exc)
        return ExitCode.CONFIG if "config" in type(exc).__name__.lower() else ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
