"""``edge-coordinator profile``: its flags, the :class:`ProfileRequest` they describe, and the command.

The profiling itself is :func:`edgefleet.coordinator.planning.profile_job.profile`; :mod:`.profile_render`
shows the result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from edgefleet.coordinator.cli.shared import FLEET_KEY_HELP, add_board_keys_arg, coordinator_keys, load_config
from edgefleet.coordinator.cli.variant_flags import add_variant_args, parse_int_list, variants_from_args
from edgefleet.coordinator.planning.profile_job import DEFAULT_PROFILE, profile
from edgefleet.coordinator.planning.profiling import ProfileRequest
from edgefleet.protocol.jobs import BUDGET_MIN_TIMED_STEPS
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

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
    """Add the ``profile`` command to the top-level subparsers ``sub``."""
    p = sub.add_parser("profile", help="measure the boards for the planner (step time, memory, power, link)",
                       description="Measure every board on the job's model at two or more batch sizes: step time, "
                                   "peak memory, power and link throughput, for each model variant.",
                       epilog=PROFILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", metavar="ID,ID,…", help="boards to profile (default: every online board that can train)")
    p.add_argument("--model", default="lenet5", help="lenet5, mlp, resnet_small, conv_mlp, an entry point or pkg.module:Class "
                                                     "(default lenet5)")
    p.add_argument("--model-options", default="", metavar="K=V,…", help="options every variant shares, e.g. optimizer=sgd")
    p.add_argument("--dataset", default="digits", help="digits, synthetic, npz, an entry point or pkg.module:factory (default digits)")
    p.add_argument("--dataset-options", default="", metavar="K=V,…", help="e.g. path=/data/train.npz for npz")
    add_variant_args(p)
    p.add_argument("--batch", default="16,32,64", metavar="B,B,…", help="batch sizes to measure, at least two (default 16,32,64)")
    p.add_argument("--warmup", type=int, default=3, metavar="STEPS", help="untimed steps per batch size (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per batch size; the median is kept (default 8)")
    p.add_argument("--timed-budget", type=float, default=0.0, metavar="SECONDS",
                   help="end a batch size's timing once its timed steps have lasted this long, after at least "
                        f"{BUDGET_MIN_TIMED_STEPS} of them: a big model on a slow board gets a shorter profile, a fast "
                        "board still times every --steps step (default 0: time them all)")
    p.add_argument("--wire-dtype", choices=tuple(WIRE_DTYPES), default="float32",
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
    p.add_argument("--exchange-host", default="",
                   help="address the boards reach this machine at (default: this machine's address towards the broker)")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                   help=f"where the profile is written (default ./{DEFAULT_PROFILE})")
    p.add_argument("--fleet-key", metavar="FILE", help=FLEET_KEY_HELP)
    add_board_keys_arg(p)


def build_request(args: argparse.Namespace) -> ProfileRequest:
    """The ProfileRequest the flags describe. Raises ConfigError naming the flag."""
    from edgefleet.workloads.registry import parse_options  # torch and Lightning: off the CLI start

    base = parse_options(args.model_options)
    return ProfileRequest(model=args.model, variants=variants_from_args(args, base), dataset=args.dataset,
                          dataset_options=parse_options(args.dataset_options),
                          batch_sizes=sorted(parse_int_list(args.batch, "--batch")), warmup_steps=args.warmup,
                          timed_steps=args.steps, timed_budget_s=args.timed_budget, wire_dtype=args.wire_dtype,
                          threads=args.threads, seed=args.seed,
                          probe_bytes=args.probe_bytes, probe_rounds=args.probe_rounds, exchange_host=args.exchange_host,
                          parallel=args.parallel)


def cmd_profile(args: argparse.Namespace) -> int:
    """``edge-coordinator profile``; returns the exit status."""
    # rich: only when profiling runs, not with the parser
    from edgefleet.coordinator.cli.profile_render import profile_table
    from edgefleet.coordinator.cli.render import make_console

    cfg = load_config(args)
    fleet_key = coordinator_keys(args, cfg)
    request = build_request(args)
    console = make_console()
    started = time.monotonic()
    result = profile(request, broker=cfg.broker, fleet_key=fleet_key, path=args.profile,
                     boards=[b for b in (args.boards or "").split(",") if b],
                     on_note=lambda text: console.print(text, markup=False, highlight=False))
    for label, fleet in result.items():
        console.print(profile_table(label, fleet))
    boards = {b for fleet in result.values() for b in fleet.boards}
    console.print(f"profiled {len(boards)} board(s), {len(result)} variant(s) in {time.monotonic() - started:.0f} s; "
                  f"saved to {args.profile}", soft_wrap=True, markup=False, highlight=False)
    return 0


__all__ = ["add_profile_parser", "build_request", "cmd_profile"]
