"""``edge-coordinator status``: one table of every board, once, live (``--watch``) or as JSON."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.cli.completion import remember_boards
from edgefleet.coordinator.cli.shared import board_count, load_config, require_rich
from edgefleet.coordinator.control.fleet import DEFAULT_MAX_BOARDS
from edgefleet.coordinator.control.monitor import monitor_fleet, wait_for_snapshot

if TYPE_CHECKING:
    from rich.table import Table

    from edgefleet.coordinator.control.fleet import FleetView

DEFAULT_WAIT_S = 3.0


def add_status_parser(sub: Any) -> None:
    """Add the ``status`` command to the top-level subparsers ``sub``."""
    status = sub.add_parser("status", help="show every board: state, CPU, memory, network, temperature, power",
                            description="Show every board that reported on the broker. A board whose last sample is older "
                                        "than 3 of its intervals is shown as stale; one that stopped or lost its connection "
                                        "as offline.")
    mode = status.add_mutually_exclusive_group()
    mode.add_argument("--watch", action="store_true", help="refresh live until Ctrl-C")
    mode.add_argument("--json", action="store_true", help="print a JSON list of boards for scripts")
    status.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                        help=f"how long a snapshot waits for online boards' first samples (default {DEFAULT_WAIT_S:g})")
    status.add_argument("--max-boards", type=board_count, default=DEFAULT_MAX_BOARDS, metavar="N",
                        help=f"show at most N boards; a note says how many more were left out (default {DEFAULT_MAX_BOARDS})")


def _keyed_boards(cfg: Any) -> frozenset[str]:
    """The boards whose public keys the coordinator holds (``[security] board_keys_dir``): they come first in a full view."""
    directory = cfg.security.board_keys_dir
    if not directory:
        return frozenset()
    try:
        return frozenset(path.stem for path in Path(directory).glob("*.pub"))
    except OSError:
        return frozenset()


def cmd_status(args: argparse.Namespace) -> int:
    """``edge-coordinator status``; returns the exit status."""
    cfg = load_config(args)
    if not args.json:
        require_rich()
    from edgefleet.coordinator.cli.render import limit_note  # rich: not for --json

    with monitor_fleet(cfg.broker, max_boards=args.max_boards, preferred=_keyed_boards(cfg)) as view:
        if args.watch:
            watch(view, title=f"edgefleet @ {cfg.broker.address()}")
            return 0
        wait_for_snapshot(view, timeout_s=args.wait)
        rows = view.rows()
        note = limit_note(view.ignored_boards(), view.max_boards)
    remember_boards(r.board_id for r in rows)  # for completing --boards
    if args.json:
        json.dump([r.to_dict() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        if note:
            print(f"edge-coordinator: {note}", file=sys.stderr)
    else:
        from edgefleet.coordinator.cli.render import fleet_table, make_console  # rich: not for --json

        make_console().print(fleet_table(rows, title=f"edgefleet @ {cfg.broker.address()}", note=note))
    return 0


def watch(view: FleetView, *, title: str, seconds: float = 0.0) -> None:
    """Show the fleet's table live for ``seconds`` (0: until Ctrl-C), its title with the time and the fleet's total
    power; the board ids seen are kept for completing ``--boards``."""
    # rich: only for a live table, not with the parser
    from rich.live import Live

    from edgefleet.coordinator.cli.render import fit_rows, fleet_power_text, fleet_table, limit_note, make_console

    console = make_console()

    def table() -> Table:
        rows = view.rows()
        heading = f"{title}  {time.strftime('%Y-%m-%d %H:%M:%S')}  fleet power {fleet_power_text(rows)}"
        shown, left_out = fit_rows(rows, console.size.height)  # rich would cut a taller table at its bottom
        note = "\n".join(line for line in (limit_note(view.ignored_boards(), view.max_boards), left_out) if line)
        return fleet_table(shown, title=heading, note=note)

    deadline = time.monotonic() + seconds if seconds > 0 else float("inf")
    # Ctrl-C only sets a flag, so it ends the view cleanly wherever it lands (even mid-draw).
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        with Live(table(), console=console, refresh_per_second=4) as live:
            while not stop.wait(0.5) and time.monotonic() < deadline:
                live.update(table())
    finally:
        signal.signal(signal.SIGINT, previous)
        remember_boards(r.board_id for r in view.rows())


__all__ = ["add_status_parser", "cmd_status", "watch"]
