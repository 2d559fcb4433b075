"""``edge-coordinator``: the top-level parser and the command dispatch.

Each command's flags and output are in their own module: :mod:`.status`, :mod:`.train` (with
:mod:`.auto` for ``--auto``), :mod:`.profile`, :mod:`.plan` and :mod:`.demo`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from edgefleet.protocol.address import BROKER_ENV
from edgefleet.protocol.errors import EdgeTrainError

log = logging.getLogger(__name__)

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
    """The ``edge-coordinator`` parser with every command."""
    from edgefleet import __version__
    from edgefleet.coordinator.cli.demo import add_demo_parser
    from edgefleet.coordinator.cli.plan import add_plan_parser
    from edgefleet.coordinator.cli.profile import add_profile_parser
    from edgefleet.coordinator.cli.status import add_status_parser
    from edgefleet.coordinator.cli.train import add_train_parser

    parser = argparse.ArgumentParser(prog="edge-coordinator", description="Show, profile and train a fleet of edge boards.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", metavar="HOST:PORT", help=f"MQTT broker (default: ${BROKER_ENV}, the config file, localhost:1883)")
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML file with a [broker] section (credentials, TLS, topic prefix)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"edge-coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_status_parser(sub)
    add_train_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    add_demo_parser(sub)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("paho").setLevel(logging.WARNING)


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    from edgefleet.coordinator.cli.demo import cmd_demo
    from edgefleet.coordinator.cli.plan import cmd_plan
    from edgefleet.coordinator.cli.profile import cmd_profile
    from edgefleet.coordinator.cli.status import cmd_status
    from edgefleet.coordinator.cli.train import cmd_train

    return {"status": cmd_status, "train": cmd_train, "profile": cmd_profile, "plan": cmd_plan, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    """Run ``edge-coordinator`` with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _commands()[args.command](args)
    except EdgeTrainError as exc:
        print(f"edge-coordinator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["build_parser", "main"]
