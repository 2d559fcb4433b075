"""``edge-coordinator profile``: options, progress lines and one table per model variant."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

from edgefleet.coordinator.variants import add_variant_args, parse_int_list, variants_from_args
from edgefleet.protocol.errors import ConfigError

DEFAULT_PROFILE = Path("edgefleet-profile.json")

PROFILE_EPILOG = """\
examples:
  edge-coordinator profile --fleet-key fleet.key --model lenet5 --dataset digits
  edge-coordinator profile --fleet-key fleet.key --boards pi-1,pi-2,orin-1 --batch 8,16,32,64 --steps 12
  edge-coordinator profile --fleet-key fleet.key --model mlp --layers 2,3,4 --width 64,128 --dataset synthetic
  edge-coordinator profile --fleet-key fleet.key --model mypkg.models:Net --dataset mypkg.data:make_dataset --profile net.json

Every board trains the model for --warmup + --steps real steps at each batch size (one variant
after the other, boards in parallel), reports the median step time, peak memory and power (from
its sensor, or estimated from CPU load and labelled so), and measures its link to this machine.
The result goes to --profile (default ./edgefleet-profile.json), which `plan` and `train --auto`
read. Boards with [training] keep_worker = true skip the worker's start-up after the first variant.
"""


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure the boards for the planner (step time, memory, power, link)",
                       description="Measure every board on the job's model at two or more batch sizes: step time, "
                                   "peak memory, power and link throughput, for each model variant.",
                       epilog=PROFILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", metavar="ID,ID,…", help="boards to profile (default: every online board that can train)")
    p.add_argument("--model", default="lenet5", help="lenet5, mlp, resnet_small, an entry point or pkg.module:Class (default lenet5)")
    p.add_argument("--model-options", default="", metavar="K=V,…", help="options every variant shares, e.g. optimizer=sgd")
    p.add_argument("--dataset", default="digits", help="digits, synthetic, npz, an entry point or pkg.module:factory (default digits)")
    p.add_argument("--dataset-options", default="", metavar="K=V,…", help="e.g. path=/data/train.npz for npz")
    add_variant_args(p)
    p.add_argument("--batch", default="16,32,64", metavar="B,B,…", help="batch sizes to measure, at least two (default 16,32,64)")
    p.add_argument("--warmup", type=int, default=3, metavar="STEPS", help="untimed steps per batch size (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per batch size; the median is kept (default 8)")
    p.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="gradient dtype the exchange will use, for the bytes per step (default float32)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per board (default: what the board's CPU quota or CPUs fit, as train uses)")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the sampled batches (default 0)")
    p.add_argument("--probe-bytes", type=int, default=4_000_000, metavar="N",
                   help="bytes each board uploads and downloads in bulk to measure its link (default 4000000)")
    p.add_argument("--probe-rounds", type=int, default=17, metavar="N",
                   help="times each board sends the gradient up and gets it back, as a training step does, per "
                        "variant; the first is not timed, and a slow link stops after about a second of rounds. "
                        "Short transfers cost a link more than bulk ones; the planner uses the median round "
                        "(default 17; 0: the bulk rates only)")
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="profile N boards at a time (default 0: all at once). For emulated fleets that share one "
                        "machine's cores: boards timed together there slow each other down; real boards do not")
    p.add_argument("--exchange-host", default="", help="address the boards reach this machine at (default: this machine's address towards the broker)")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help=f"where the profile is written (default ./{DEFAULT_PROFILE})")
    p.add_argument("--fleet-key", metavar="FILE", help="HMAC key that signs commands (default: [security] fleet_key_file)")


def build_request(args: argparse.Namespace) -> Any:
    """The ProfileRequest the flags describe. Raises ConfigError naming the flag."""
    from edgefleet.coordinator.profiling import ProfileRequest
    from edgefleet.workloads.registry import parse_options

    base = parse_options(args.model_options)
    return ProfileRequest(model=args.model, variants=variants_from_args(args, base), dataset=args.dataset,
                          dataset_options=parse_options(args.dataset_options),
                          batch_sizes=sorted(parse_int_list(args.batch, "--batch")), warmup_steps=args.warmup,
                          timed_steps=args.steps, wire_dtype=args.wire_dtype, threads=args.threads, seed=args.seed,
                          probe_bytes=args.probe_bytes, probe_rounds=args.probe_rounds, exchange_host=args.exchange_host,
                          parallel=args.parallel)


def _si(value: float, unit: str) -> str:
    for prefix in ("", "k", "M", "G", "T"):
        if abs(value) < 1000 or prefix == "T":
            return f"{value:.0f} {prefix}{unit}" if abs(value) >= 10 or not prefix else f"{value:.1f} {prefix}{unit}"
        value /= 1000
    return "-"


def _mbit(bytes_per_s: float) -> str:
    mbit = bytes_per_s * 8e-6
    return f"{mbit:.0f}" if mbit >= 100 else f"{mbit:.1f}"


def profile_table(label: str, fleet: Any) -> Any:
    """One variant's table: a row per board, step time and samples/s per batch size, power, memory, link."""
    from rich import box
    from rich.table import Table

    sizes = sorted({p.batch_size for board in fleet.boards.values() for p in board.points})
    table = Table(title=f"{label}: {fleet.model_key} · gradient {_si(fleet.grad_bytes, 'B')} · coordinator link "
                        f"{_si(fleet.coordinator_link_bytes_per_s * 8, 'bit/s')}",
                  title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("board")
    for size in sizes:
        table.add_column(f"batch {size}", justify="right")
    for name in ("power W active/link/idle", "source", "peak memory / total", "link Mbit/s up/down",
                 "gradient up+back"):
        table.add_column(name, justify="left" if name == "source" else "right")
    for board in fleet.boards.values():
        by_size = {p.batch_size: p for p in board.points}
        cells = [f"{by_size[s].step_time_s * 1000:.1f} ms · {s / by_size[s].step_time_s:.0f}/s" if s in by_size else "-"
                 for s in sizes]
        star = "*" if board.power_source == "estimated" else ""
        peak = max(p.peak_memory_bytes for p in board.points)
        down = board.link_down_bytes_per_s or board.link_bytes_per_s
        link_w = "-" if board.link_power_w is None else f"{board.link_power_w:.2f}{star}"
        table.add_row(board.board_id, *cells,
                      f"{board.active_power_w:.2f}{star} / {link_w} / {board.idle_power_w:.2f}{star}",
                      board.power_source, f"{_si(peak, 'B')} / {_si(board.memory_total_bytes, 'B')}",
                      f"{_mbit(board.link_bytes_per_s)} / {_mbit(down)}",
                      "-" if board.link_round_s is None else f"{board.link_round_s * 1000:.1f} ms")
    if any(b.power_source == "estimated" for b in fleet.boards.values()):
        table.caption = "* estimated from CPU load (power.idle_w, power.max_w), not measured"
    return table


def cmd_profile(args: argparse.Namespace) -> int:
    from edgefleet.coordinator.config import load_coordinator_config
    from edgefleet.coordinator.fleet_select import online_trainers
    from edgefleet.coordinator.planning.profiles import ProfileMeta, save_profiles
    from edgefleet.coordinator.profiling import profile_fleet
    from edgefleet.coordinator.render import make_console
    from edgefleet.protocol.address import parse_host_port
    from edgefleet.transport.fleet_key import load_fleet_key

    broker = parse_host_port(args.broker, what="--broker") if args.broker else None
    cfg = load_coordinator_config(args.config, broker=broker, fleet_key_file=args.fleet_key)
    if not cfg.security.fleet_key_file:
        raise ConfigError("no fleet key: give --fleet-key FILE or [security] fleet_key_file (the key the boards verify commands with)")
    fleet_key = load_fleet_key(Path(cfg.security.fleet_key_file))
    request = build_request(args)
    if not args.profile.parent.is_dir():
        raise ConfigError(f"--profile {args.profile}: the folder {args.profile.parent} does not exist")
    boards = [b for b in (args.boards or "").split(",") if b] or online_trainers(cfg.broker)
    if not boards:
        raise ConfigError("no boards: none is online on this broker; start edge-agent on the boards or name them with --boards")
    console = make_console()
    started = time.monotonic()
    result = asyncio.run(profile_fleet(cfg.broker, fleet_key, boards, request,
                                       on_note=lambda text: console.print(text, markup=False, highlight=False)))
    meta = ProfileMeta(model=request.model, dataset=request.dataset, dataset_options=request.dataset_options,
                       wire_dtype=request.wire_dtype, batch_sizes=sorted(set(request.batch_sizes)),
                       created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    save_profiles(args.profile, result, meta)
    for label, fleet in result.items():
        console.print(profile_table(label, fleet))
    console.print(f"profiled {len(boards)} board(s), {len(result)} variant(s) in {time.monotonic() - started:.0f} s; "
                  f"saved to {args.profile}", soft_wrap=True, markup=False, highlight=False)
    return 0


__all__ = ["DEFAULT_PROFILE", "add_profile_parser", "build_request", "cmd_profile", "profile_table"]
