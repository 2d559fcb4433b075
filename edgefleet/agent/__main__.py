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
from edgefleet.closed_pipe import quiet_on_closed_pipe
from edgefleet.protocol.address import BROKER_ENV, parse_broker
from edgefleet.protocol.errors import EdgeTrainError

log = logging.getLogger("edgefleet.agent")

EPILOG = f"""\
examples:
  edge-agent --config /etc/edge-agent/agent.toml        run as configured (what systemd does)
  edge-agent --id pi-1 --broker 192.168.1.10:1883       try a board without writing a file
  edge-agent --id pi-1 --broker mqtts://mqtt.lan        the same over TLS (port 8883, the system's CA bundle)
  edge-agent --config agent.toml --check-config         validate the file, print what is in effect as TOML, exit

precedence: the config file, then ${BROKER_ENV}=HOST:PORT, then --id/--broker/--interval.
exit codes: 0 stopped cleanly, 2 bad usage, 78 bad configuration (systemd does not restart).
"""

# sd-daemon(3) priority prefixes: journald reads "<N>" at the start of a line as its syslog priority.
_JOURNAL_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
_DEBUG_PRIORITY = 7


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent", description="Stream this board's CPU, memory, network, temperature and power over MQTT, and run the training "
                                       "work it is given.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML config file (keys: see the README's configuration reference)")
    parser.add_argument("--id", dest="board_id", metavar="BOARD_ID", help="board id, one topic level (default: the host name)")
    parser.add_argument("--broker", metavar="HOST:PORT|URL",
                        help=f"MQTT broker: HOST:PORT, mqtt://HOST[:PORT] or mqtts://HOST[:PORT] for TLS (default: the file, "
                             f"${BROKER_ENV}, or localhost:1883)")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="seconds between telemetry samples (default 1)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the configuration, print it as TOML (the values in effect; never the password) and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    return parser


def journal_priority(levelno: int) -> int:
    """The syslog priority journald should store a record of logging level ``levelno`` at."""
    for level, priority in _JOURNAL_PRIORITIES:
        if levelno >= level:
            return priority
    return _DEBUG_PRIORITY


class JournalFormatter(logging.Formatter):
    """Prefixes every line with ``<N>``, its syslog priority, for journald.

    journald stores a service's stdout lines at "info" unless a line starts with a priority
    prefix (``SyslogLevelPrefix=``, on by default), so without one a warning is invisible to
    ``journalctl -p warning``. Each line of a multi-line record (a traceback) gets the prefix,
    because journald reads each line as its own entry.
    """

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{journal_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def stdout_is_journal(journal_stream: str | None, fd: int) -> bool:
    """True if ``fd`` is the journal stream ``$JOURNAL_STREAM`` names (``DEVICE:INODE``).

    systemd sets the variable for a service whose output goes to the journal; a child whose output
    was redirected elsewhere inherits it, so systemd.exec(5) says to compare it with the descriptor.
    """
    if not journal_stream:
        return False
    try:
        device, inode = (int(part) for part in journal_stream.split(":"))
        stat = os.fstat(fd)
    except (ValueError, OSError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


def configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by something without a descriptor (a test's capture)
        fd = -1
    if stdout_is_journal(os.environ.get("JOURNAL_STREAM"), fd):
        # journald adds its own timestamps; the prefix gives each line its priority.
        handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("paho").setLevel(logging.WARNING)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        broker = parse_broker(args.broker, what="--broker") if args.broker else None
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


def main(argv: list[str] | None = None) -> int:
    """Run ``edge-agent``; a reader that closes the pipe early (``--check-config | head``) ends it quietly."""
    return quiet_on_closed_pipe(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
