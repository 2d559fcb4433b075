"""``edge-coordinator demo``: train LeNet-5 on digits on a local fleet, or watch its telemetry."""

from __future__ import annotations

import argparse
from typing import Any

from edgefleet.coordinator.cli.shared import require_rich
from edgefleet.coordinator.cli.status import watch
from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.run.demo import DEMO_BATCH, demo_fleet, demo_job, wait_online
from edgefleet.coordinator.run.train_job import default_run_dir


def add_demo_parser(sub: Any) -> None:
    """Add the ``demo`` command to the top-level subparsers ``sub``."""
    demo = sub.add_parser("demo", help="train LeNet-5 on digits on a local fleet of 3 agents (embedded defaults)",
                          description="Start a private broker on a free loopback port, spawn local agents with fresh "
                                      "keys (the coordinator's Ed25519 key signs the commands, each board's own key "
                                      "signs its events), and train LeNet-5 on scikit-learn's digits through the real path "
                                      "(signed commands, the TCP gradient exchange, Lightning on every board). Nothing "
                                      "listens beyond 127.0.0.1; everything stops at the end or on Ctrl-C.")
    demo.add_argument("--boards", type=int, default=3, metavar="N", help="how many local agents (default 3)")
    demo.add_argument("--fleet-only", action="store_true", help="only show the fleet's live telemetry, no training")
    demo.add_argument("--seconds", type=float, default=20.0, metavar="S",
                      help="with --fleet-only: how long to show the fleet (default 20; 0 = until Ctrl-C)")


def cmd_demo(args: argparse.Namespace) -> int:
    """``edge-coordinator demo``; returns the exit status."""
    from edgefleet.coordinator.cli.train_progress import run_training_ui  # rich: only when the demo runs

    require_rich()
    with demo_fleet(args.boards) as fleet:
        print(f"broker={fleet.address}  ({fleet.kind}; in another terminal: "
              f"EDGEFLEET_BROKER={fleet.address} edge-coordinator status --watch)")
        if args.fleet_only:
            with monitor_fleet(fleet.broker) as view:
                watch(view, title=f"edgefleet demo @ {fleet.address}  (Ctrl-C to stop)", seconds=args.seconds)
            return 0
        wait_online(fleet)
        spec = demo_job(fleet.boards)
        print(f"training LeNet-5 on scikit-learn's digits on {len(fleet.boards)} local boards "
              f"({DEMO_BATCH} samples each per step, {spec.total_steps} steps)")
        return run_training_ui(spec, default_run_dir(spec), broker=fleet.broker, fleet_key=fleet.fleet_key, resume=False)


__all__ = ["add_demo_parser", "cmd_demo"]
