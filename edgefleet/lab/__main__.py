"""``edge-lab up|down|status|check|coordinator``: the emulated fleet from a shell.

    edge-lab up --fleet mixed4                       # a shipped fleet (or a TOML file); until Ctrl-C / down
    edge-coordinator --broker 198.18.0.1:PORT status # in another terminal
    edge-lab status                                  # the lab's view: quotas vs use
    edge-lab down                                    # stop it and remove every trace

``up`` stays in the foreground as the boards' supervisor: it prints a line whenever a board's
process ends unasked (for example killed by the OOM killer), and tears the lab down on Ctrl-C,
SIGTERM or SIGHUP. It prints ``broker=HOST:PORT`` on a line of its own once every board is
online, so a script can wait for that line. ``down`` stops a running ``up`` and then removes
anything named ``efl-*`` that is left (after a crash, too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import edgefleet.lab.leftovers as leftovers
from edgefleet.lab.cgroups import Cgroup
from edgefleet.lab.fleet_file import FleetError, load_fleet, shipped_fleets
from edgefleet.lab.lab import Lab, LabBusy, LabUnavailable
from edgefleet.lab.supervisor import Report
from edgefleet.lab.units import format_rate, format_size
from edgefleet.launch import module_command

log = logging.getLogger("edgefleet.lab")

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_BAD_FLEET = 78


def _stop_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _print_fleet_table(lab: Lab) -> None:
    print(f"{'board':<10} {'address':<14} {'cpu':>5} {'memory':>8}  {'link up / down':<24} power model")
    for board in lab.boards.values():
        s = board.spec
        link = f"{format_rate(s.rate_up_bps)} / {format_rate(s.rate_down_bps)}"
        print(f"{s.id:<10} {board.address!s:<14} {s.cpu:>5.2f} {format_size(s.memory_bytes):>8}  {link:<24} "
              f"{s.idle_w:g}-{s.max_w:g} W (estimated)")


def cmd_up(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.fleet)
    except FleetError as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return EXIT_BAD_FLEET

    def report(r: Report) -> None:
        print(f"lab: {r.message}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    lab = Lab(fleet, interval_s=args.interval, logs_dir=Path(args.logs) if args.logs else None,
              start_agents=not args.no_agents, on_report=report,
              fleet_key_file=Path(args.fleet_key) if args.fleet_key else None)
    try:
        with lab:
            where = f" (broker and coordinator in namespace {lab.server_netns})" if lab.server_netns else ""
            print(f"lab {fleet.lab.name}: {len(lab.boards)} boards, {fleet.cpu_total:.2f} of {os.cpu_count()} cores{where}")
            _print_fleet_table(lab)
            if not args.no_agents:
                print(f"waiting for {len(lab.boards)} agents to come online...", flush=True)
                lab.wait_online(timeout_s=args.timeout)
            print(f"broker={lab.broker_address}", flush=True)
            coord = "edge-lab coordinator -- status" if lab.server_netns else f"edge-coordinator --broker {lab.broker_address} status"
            print(f"try: {coord}\nstop: Ctrl-C here, or edge-lab down", flush=True)
            while True:
                signal.pause()
    except LabUnavailable as exc:
        print(f"lab: this machine can't run the lab: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except LabBusy as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except TimeoutError as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        print(f"lab {fleet.lab.name}: stopped by signal; everything removed", flush=True)
        return 0 if exc.code in (128 + signal.SIGTERM, 128 + signal.SIGHUP) else int(exc.code or 0)
    print(f"lab {fleet.lab.name}: down; everything removed", flush=True)
    return 0


def cmd_down(_args: argparse.Namespace) -> int:
    pid = leftovers.stop_running_lab()
    if pid is not None:
        print(f"lab: stopped the lab run by pid {pid}")
    removed = leftovers.sweep()
    for item in removed:
        print(f"lab: removed {item}")
    remaining = leftovers.leftovers()
    if remaining:
        print(f"lab: could not remove: {', '.join(remaining)}", file=sys.stderr)
        return 1
    if pid is None and not removed:
        print("lab: nothing to remove")
    return 0


def _coordinator_cmd(state: dict[str, Any], args: list[str]) -> list[str]:
    cmd = module_command("edgefleet.coordinator.cli", "--broker", str(state["broker"]), *args)
    if state.get("server_netns"):
        cmd = ["nsenter", f"--net=/run/netns/{state['server_netns']}", "--", *cmd]
    return cmd


def cmd_coordinator(args: argparse.Namespace) -> int:
    state = leftovers.running_lab()
    if state is None or "broker" not in state:
        print("lab: no lab is up (edge-lab up --fleet FILE)", file=sys.stderr)
        return 1
    rest = [a for a in args.rest if a != "--"] or ["status"]
    return subprocess.call(_coordinator_cmd(state, rest))


def cmd_status(args: argparse.Namespace) -> int:
    state = leftovers.running_lab()
    if state is None or "broker" not in state:
        print("lab: no lab is up (edge-lab up --fleet FILE)", file=sys.stderr)
        return 1
    done = subprocess.run(_coordinator_cmd(state, ["status", "--json", "--wait", "2"]), capture_output=True, text=True, timeout=30,
                          check=False)
    rows = {r["board_id"]: r for r in json.loads(done.stdout)} if done.returncode == 0 and done.stdout.strip() else {}
    groups = {b["id"]: Cgroup(b["cgroup"]) for b in state["boards"]}
    window = 1.0
    before = {i: g.cpu_usage_ns() for i, g in groups.items()}
    t0 = time.monotonic()
    time.sleep(window)  # a measuring window, not a wait for anything
    elapsed = time.monotonic() - t0
    used = {i: (g.cpu_usage_ns() - before[i]) / 1e9 / elapsed for i, g in groups.items()}
    out = []
    for b in state["boards"]:
        row = rows.get(b["id"], {})
        power = row.get("power_w")
        out.append({"board_id": b["id"], "address": b["address"], "cpu_quota": b["cpu"], "cpu_used": round(used[b["id"]], 3),
                    "memory_limit_bytes": b["memory_bytes"], "rate_up_bps": b["rate_up_bps"], "rate_down_bps": b["rate_down_bps"],
                    "state": row.get("state", "absent"), "health": row.get("health"), "power_w": power,
                    "power_source": row.get("power_source"), "model": (row.get("caps") or {}).get("model")})
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    print(f"lab {state.get('name')} (pid {state['pid']}), broker={state['broker']}")
    print(f"{'board':<10} {'state':<9} {'cpu used/quota':>15} {'memory':>8}  {'link up / down':<24} {'power':>8}  source")
    for r in out:
        power = "-" if r["power_w"] is None else f"{r['power_w']:.2f} W"
        link = f"{format_rate(r['rate_up_bps'])} / {format_rate(r['rate_down_bps'])}"
        print(f"{r['board_id']:<10} {r['state']:<9} {r['cpu_used']:>6.2f} / {r['cpu_quota']:<6.2f} "
              f"{format_size(r['memory_limit_bytes']):>8}  {link:<24} {power:>8}  {r['power_source'] or '-'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.fleet)
    except FleetError as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return EXIT_BAD_FLEET
    print(f"{args.fleet}: OK, {len(fleet.boards)} boards, {fleet.cpu_total:.2f} of {os.cpu_count()} cores"
          f" (reserved {fleet.lab.reserved_cpus:g})" + (", server namespace" if fleet.server else ""))
    for b in fleet.boards:
        print(f"  {b.id:<10} {b.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-lab",
                                     description="The emulated fleet: boards as network namespaces with CPU, memory and link limits.",
                                     epilog="\n".join(__doc__.splitlines()[2:7]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="build the fleet and supervise it until Ctrl-C, SIGTERM or `down`")
    up.add_argument("--fleet", required=True, metavar="FILE|NAME",
                    help=f"fleet file (TOML), or a shipped fleet: {', '.join(shipped_fleets())}")
    up.add_argument("--interval", type=float, help="agents' telemetry interval in seconds (default: the fleet file's)")
    up.add_argument("--logs", metavar="DIR", help="keep the boards' logs here (default: removed with the lab)")
    up.add_argument("--no-agents", action="store_true", help="build the boards without starting agents")
    up.add_argument("--fleet-key", metavar="FILE", help="HMAC key the agents verify commands with (for edge-coordinator train)")
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for every agent to come online (default 90)")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop a running lab and remove everything named efl-* (also after a crash)")
    down.set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="the running lab's boards: quotas, CPU in use, links, agent state and power")
    status.add_argument("--json", action="store_true", help="a JSON list for scripts")
    status.set_defaults(func=cmd_status)
    check = sub.add_parser("check", help="validate a fleet file (no root needed)")
    check.add_argument("fleet", metavar="FILE|NAME", help="fleet file (TOML), or a shipped fleet's name")
    check.set_defaults(func=cmd_check)
    coord = sub.add_parser("coordinator", help="run edge-coordinator against the lab, where the coordinator lives",
                           description="edge-lab coordinator -- status --json")
    coord.add_argument("rest", nargs=argparse.REMAINDER)
    coord.set_defaults(func=cmd_coordinator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:  # `up` prints the supervisor's reports itself, once
        logging.getLogger("edgefleet.lab.supervisor").setLevel(logging.ERROR)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
