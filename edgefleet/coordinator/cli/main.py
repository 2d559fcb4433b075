"""``edge-coordinator``: the top-level parser and the command dispatch.

Each command's flags and output are in their own module: :mod:`.status`, :mod:`.train` (with
:mod:`.auto` for ``--auto``), :mod:`.profile`, :mod:`.plan`, :mod:`.demo`, :mod:`.report`,
:mod:`.exporter`, :mod:`.forget` and :mod:`.completion`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from edgefleet import __version__
from edgefleet.closed_pipe import quiet_on_closed_pipe
from edgefleet.coordinator.cli.completion import add_completion_parser, cmd_completion
from edgefleet.coordinator.cli.config import CONFIG_ENV, default_config_path
from edgefleet.coordinator.cli.demo import add_demo_parser, cmd_demo
from edgefleet.coordinator.cli.exporter import add_exporter_parser, cmd_exporter
from edgefleet.coordinator.cli.forget import add_forget_parser, cmd_forget
from edgefleet.coordinator.cli.report import add_report_parser, cmd_report
from edgefleet.coordinator.cli.status import add_status_parser, cmd_status
from edgefleet.coordinator.cli.train import add_train_parser, cmd_train
from edgefleet.protocol.address import BROKER_ENV
from edgefleet.protocol.errors import ConfigError, EdgeTrainError

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
  edge-coordinator forget pi-7                           clear a retired board's retained status and caps

the broker: --broker HOST:PORT (or mqtt://HOST[:PORT], or mqtts://HOST[:PORT] for TLS), else
${BROKER_ENV}, else the [broker] section of the config file, else localhost:1883.
shell completion: source <(edge-coordinator completion bash)   (zsh: completion zsh)
"""



def _config_help() -> str:
    """The --config help, saying which default file this run would read."""
    try:
        found = default_config_path()
        now = f"now {found[0]}" if found is not None else "none of them exists now"
    except ConfigError as exc:
        now = str(exc)
    return (f"TOML file with [broker] and [security] sections (credentials, TLS, topic prefix, keys). Default: ${CONFIG_ENV}, "
            "else ~/.config/edgefleet/coordinator.toml, else /etc/edge-coordinator/coordinator.toml, when there "
            f"({now}; -v logs the file read)")


def build_parser() -> argparse.ArgumentParser:
    """The ``edge-coordinator`` parser with every command."""
    # numpy (planning/): loaded when the parser is built, not by importing this module
    from edgefleet.coordinator.cli.plan import add_plan_parser
    from edgefleet.coordinator.cli.profile import add_profile_parser

    parser = argparse.ArgumentParser(prog="edge-coordinator", description="Show, profile and train a fleet of edge boards.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", metavar="HOST:PORT|URL",
                        help=f"MQTT broker: HOST:PORT, mqtt://HOST[:PORT] or mqtts://HOST[:PORT] for TLS (default: ${BROKER_ENV}, "
                             "the config file, localhost:1883)")
    parser.add_argument("--config", type=Path, metavar="FILE", help=_config_help())
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"edge-coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_status_parser(sub)
    add_train_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    add_demo_parser(sub)
    add_report_parser(sub)
    add_exporter_parser(sub)
    add_forget_parser(sub)
    add_completion_parser(sub)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("paho").setLevel(logging.WARNING)


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    # numpy (planning/): off the import of this module
    from edgefleet.coordinator.cli.plan import cmd_plan
    from edgefleet.coordinator.cli.profile import cmd_profile

    return {"status": cmd_status, "train": cmd_train, "profile": cmd_profile, "plan": cmd_plan, "demo": cmd_demo,
            "report": cmd_report, "exporter": cmd_exporter, "forget": cmd_forget, "completion": _completion}


def _completion(args: argparse.Namespace) -> int:
    """``completion``: the scripts of this command's parser and edge-agent's."""
    # the agent's modules (psutil, its sensors): only for the completion script
    from edgefleet.agent.__main__ import build_parser as agent_parser

    return cmd_completion(args, [build_parser(), agent_parser()])


def main(argv: list[str] | None = None) -> int:
    """Run ``edge-coordinator`` with ``argv`` (default: the process's arguments); returns the exit status.

    A reader that closes the pipe early (``status --json | head``) ends the command quietly.
    """
    return quiet_on_closed_pipe(lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
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
