"""``edge-coordinator train``: its flags, the :class:`JobSpec` they describe, and the command.

The job itself runs in :func:`edgefleet.coordinator.run.train_job.train` (with ``--auto``,
:func:`edgefleet.coordinator.run.auto_train.auto_train`); :mod:`.train_progress` shows it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.coordinator.cli.exporter import listen_address
from edgefleet.coordinator.cli.shared import FLEET_KEY_HELP, add_board_keys_arg, coordinator_keys, load_config
from edgefleet.coordinator.cli.train_args import job_from_args, pipeline_flag, tail_board
from edgefleet.coordinator.exporter.metrics_server import LISTEN_HELP, serve_fleet_metrics
from edgefleet.coordinator.run.job_spec import BUFFER_SYNC, DEFAULT_BATCH, DEFAULT_EPOCHS, DEFAULT_PIPELINE_PORT
from edgefleet.coordinator.run.run_logger import LOGGERS
from edgefleet.coordinator.run.train_job import default_run_dir, load_job, repipeline, resolve_job
from edgefleet.protocol.aggregates import AGGREGATES
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.jobs import DATA_MODES
from edgefleet.protocol.outer_optimizer import AVERAGE, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, OUTER_OPTIMIZERS
from edgefleet.protocol.wire_dtype import WIRE_DTYPES

if TYPE_CHECKING:
    from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics
    from edgefleet.protocol.address import HostPort

TRAIN_EPILOG = """\
examples:
  edge-coordinator train --boards pi-1,pi-2,orin-1 --model lenet5 --dataset digits --batch 16,16,48 --epochs 5
  edge-coordinator train --model mlp --model-options layers=3,width=64 --dataset synthetic --steps 200
  edge-coordinator train --model mypkg.models:Net --dataset mypkg.data:make_dataset --batch 32 --epochs 2
  edge-coordinator train --resume runs/lenet5-digits-20261121-101500-ab12

The run directory (runs/<run-id>/ unless --run-dir) holds config.json, metrics.jsonl (one line per
applied step), checkpoint.pt, result.json and, when the run completes, model.pt (a plain state_dict).
Ctrl-C stops at a step boundary and leaves a checkpoint that --resume continues from. A new run
refuses a --run-dir that already holds a run. Every file is written whole or not at all: a full
disk stops the run with the space needed, and the last checkpoint stays for --resume.

When a board's time per sample drifts by more than --rebalance-threshold (a Pi throttling under
heat), the batch sizes are re-balanced at a step boundary with the same global batch: a note
"step N: re-balancing from step M: ..." and a "rebalance" entry in that step's metrics.jsonl line.
Once the new sizes have run a few steps they are checked in turn: a board still the slowest by a
margin (it slowed further meanwhile) gets a second re-balance, "... still the slowest at the new sizes".
A pipeline (--pipeline) is revised instead when a stage's board takes 30% longer for good: its layers
are cut again at the measured speeds (or a slowed later stage left out), after a whole step, when that
is 15% faster and pays for the restart before the run ends: "step N: q2 takes 3.1x its time ...;
revising the pipeline ...", then "revised: step M trained on the revised pipeline ... s after ...".
"""


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model on the boards (synchronous data-parallel)",
                       description="Train one model on several boards at once with DDP's mathematics: every step "
                                   "averages the boards' gradients weighted by their batch sizes (unless you opt in to "
                                   "periodic averaging with --sync-every, which changes the mathematics).",
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", metavar="ID,ID,…", help="boards that take part (default: every online board that can train)")
    p.add_argument("--model", default="lenet5", help="lenet5, mlp, resnet_small, conv_mlp, an entry point or pkg.module:Class, "
                                                     "a LightningModule of pytorch_lightning or lightning.pytorch (default lenet5)")
    p.add_argument("--model-options", default="", metavar="K=V,…",
                   help="the model constructor's keyword arguments, e.g. lr=0.01,hidden=64 or layers=3,width=64")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--dataset", default="digits",
                      help="digits, synthetic, npz, an entry point or pkg.module:factory (default digits)")
    data.add_argument("--datamodule", metavar="PKG.MOD:CLASS",
                      help="a LightningDataModule instead of a dataset: its train_dataloader()'s dataset and collate_fn "
                           "are used (the fleet picks each board's samples), its val_dataloader() validates")
    p.add_argument("--dataset-options", default="", metavar="K=V,…", help="e.g. path=/data/train.npz for npz")
    p.add_argument("--datamodule-options", default="", metavar="K=V,…", help="the DataModule constructor's keyword arguments")
    p.add_argument("--batch", default=str(DEFAULT_BATCH), metavar="B[,B,…]",
                   help=f"batch size per board, one value for all or one per board (default {DEFAULT_BATCH})")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, help=f"epochs over the dataset (default {DEFAULT_EPOCHS:g})")
    length.add_argument("--steps", type=int, help="global steps instead of epochs")
    p.add_argument("--target-accuracy", type=float, metavar="FRACTION",
                   help="stop after the first epoch whose validation accuracy reaches this (e.g. 0.95); the run "
                        "then counts as finished (model.pt, result.json's target_reached). --epochs/--steps stay the limit")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the data order (default 0)")
    p.add_argument("--lr", type=float, help="learning rate (default: the model's)")
    p.add_argument("--wire-dtype", choices=tuple(WIRE_DTYPES), default="float32",
                   help="gradients on the wire (default float32: exact; float16 halves the bytes)")
    p.add_argument("--data-mode", choices=DATA_MODES, default="global",
                   help="global: every board holds the whole dataset and takes its slice of each global batch; "
                        "local: each board trains on its own data (default global)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per board and for the coordinator's replica (default: a board takes one per core of "
                        "its CPU quota, else of its CPUs; the replica validates with the cores its machine has free)")
    lightning = p.add_argument_group("Lightning Trainer flags (the same on every board and on the coordinator's replica)")
    lightning.add_argument("--accumulate-grad-batches", type=int, default=1, metavar="K",
                           help="sum the gradients of K global batches before each optimizer step (default 1)")
    lightning.add_argument("--gradient-clip-val", type=float, metavar="X",
                           help="clip the averaged gradient (default: no clipping)")
    lightning.add_argument("--gradient-clip-algorithm", choices=("norm", "value"), default="norm",
                           help="norm: over all parameters together (default); value: each element")
    lightning.add_argument("--deterministic", action="store_true", help="torch's deterministic algorithms on every replica")
    lightning.add_argument("--precision", default="32-true", metavar="32-true|bf16-mixed|16-mixed",
                           help="bf16-mixed: autocast to bfloat16 on every board (weights and gradients stay fp32); "
                                "16-mixed: float16 autocast with one loss scale for the fleet, a step that overflowed on "
                                "any board skipped on all, as DDP does (CPU boards too) (default 32-true)")
    lightning.add_argument("--log-every-n-steps", type=int, default=50, metavar="N",
                           help="how often --logger writes what training_step logs per step (default 50, Lightning's)")
    lightning.add_argument("--sync-buffers", choices=BUFFER_SYNC, default="broadcast",
                           help="BatchNorm's running statistics (every float buffer) after each step: broadcast the "
                                "first board's, as DDP does (default), or average them over the boards' samples")
    lightning.add_argument("--logger", choices=LOGGERS, default="none",
                           help="write what the module logs in validation_step, and the fleet's loss, with "
                                "Lightning's CSVLogger or TensorBoardLogger into RUN_DIR/logs (default none)")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS", help="checkpoint interval (default 50)")
    p.add_argument("--step-timeout", type=float, default=10.0, metavar="S",
                   help="a board later than max(S, 5x the median step) is left out of that step (default 10)")
    p.add_argument("--exchange-host", default="", help="address the boards connect to (default: this machine's address towards the broker)")
    p.add_argument("--exchange-port", type=int, default=0, help="TCP port of the gradient exchange (default: any free port)")
    p.add_argument("--no-exchange-tls", dest="exchange_tls", action="store_false",
                   help="send gradients in clear instead of over TLS (a certificate made for the run, pinned in the signed "
                        "commands); only on a network you trust, or to measure what TLS costs")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                   help="move samples between boards when one's speed drifts, keeping the global batch (default on; "
                        "global data mode only); a pipeline's stages are revised around a board that slowed")
    p.add_argument("--rebalance-threshold", type=float, default=0.15, metavar="FRACTION",
                   help="relative change of a board's time per sample that counts as drift (default 0.15); raise it "
                        "if the notes show re-balancing back and forth on a noisy fleet")
    periodic = p.add_argument_group(
        "periodic averaging (local SGD; opt-in: it CHANGES THE MATHEMATICS)",
        "With --sync-every H > 1, after --sync-warmup exact steps each board steps its optimizer on its own\n"
        "batch's gradient, and the boards' parameters are averaged (weighted by their samples) every H steps,\n"
        "at every epoch's end and at the run's end. The trained model then differs from single-process\n"
        "Lightning's (and from the exact mode's); in exchange, after the warm-up, the exchange carries 1/H of\n"
        "the exact mode's bytes. Measure its accuracy against the exact mode (docs/training.md).")
    periodic.add_argument("--sync-every", type=int, default=1, metavar="H",
                          help="average the boards' parameters every H steps instead of their gradients every step "
                               "(default 1: the exact mode, DDP's mathematics)")
    periodic.add_argument("--sync-warmup", type=int, metavar="STEPS",
                          help="exact steps (gradients averaged) before the first local one (default: the first epoch)")
    periodic.add_argument("--outer-optimizer", choices=OUTER_OPTIMIZERS, default=AVERAGE,
                          help="what each average does (only with --sync-every > 1): average (the default) sets every "
                               "model to the boards' weighted average; diloco (DiLoCo, arXiv 2311.08105) treats the "
                               "averaged change as a gradient for SGD with Nesterov momentum; sgd the same with "
                               "heavy-ball momentum. The boards' own optimizer stays the module's; no extra bytes")
    periodic.add_argument("--outer-lr", type=float, default=DEFAULT_OUTER_LR, metavar="LR",
                          help=f"the outer optimizer's learning rate (default {DEFAULT_OUTER_LR}, the paper's); 1 with "
                               "--outer-momentum 0 is the plain average")
    periodic.add_argument("--outer-momentum", type=float, default=DEFAULT_OUTER_MOMENTUM, metavar="MU",
                          help=f"the outer optimizer's momentum in [0, 1) (default {DEFAULT_OUTER_MOMENTUM}; the paper's 0.9 "
                               "overshoots at H = 4 to 8 on the built-in models); "
                               "if the loss jumps after each average (the notes' sync steps), lower it or --outer-lr")
    p.add_argument("--overlap", action="store_true",
                   help="send each board's gradient in buckets as backward produces it, hiding the upload behind "
                        "backward (the same mathematics and result; opt-in for now, recorded in config.json). Boards "
                        "need this edgefleet version. Not with --sync-every > 1; with --accumulate-grad-batches > 1 or "
                        "a gradient scaler a board sends after backward, as without it")
    p.add_argument("--placement", metavar="none|CUT[@coordinator]|CUT@BOARD",
                   help="layer placement: cut the model after layer CUT (e.g. net.6 of lenet5); the boards train the "
                        "layers before it data-parallel and send their activations, the coordinator (or BOARD, not one "
                        "of --boards: a two-stage --pipeline) trains the rest over the whole global batch: far fewer "
                        "bytes per step when the parameters sit after the cut. The same mathematics as --placement none "
                        "(the default). The cuts a model admits and their sizes: an unknown CUT is refused listing them")
    pipeline = p.add_argument_group(
        "pipeline stages",
        "Cut the model into stages, each trained by a board of its own; the boards send each micro-batch's\n"
        "activations to the next stage and their gradients back (GPipe: every forward, then every backward, one\n"
        "optimizer step: the same mathematics as data-parallel training). Each board needs a key of its own\n"
        "(security.board_key_file, its public key in --board-keys): the stages' links use it for TLS.")
    pipeline.add_argument("--pipeline", metavar="BOARD[+BOARD...],CUT@BOARD[+BOARD...],...",
                          help="stage 0's board (it holds the data), or boards joined by + (data-parallel, each with "
                               "its --batch), then CUT@BOARD for each later stage, e.g. p1,net.2@p2,net.8@p3, or "
                               "p1+p2+p3,net.6@p4 (the dense layers on p4); a later stage's boards joined by + share "
                               "each step's micro-batches out (p1,net.6@p2+p3: give --micro-batches 2 or more); an "
                               "unknown CUT is refused listing the cuts the model admits")
    pipeline.add_argument("--micro-batches", type=int, default=1, metavar="M",
                          help="micro-batches each stage-0 board's batch is split into (default 1): more keep more "
                               "stages busy at once")
    pipeline.add_argument("--pipeline-port", type=int, default=DEFAULT_PIPELINE_PORT, metavar="PORT",
                          help=f"the pipeline's i-th board listens for its neighbours on PORT + i (default {DEFAULT_PIPELINE_PORT}); "
                               "a re-planned pipeline keeps each board's port")
    pipeline.add_argument("--stage-sync", choices=("step", "checkpoint"), default="step",
                          help="when each later stage's board sends the coordinator its stage: 'step' (its gradient "
                               "every step, the default: a lost board costs no step) or 'checkpoint' (its parameters "
                               "and optimizer state at each --checkpoint-every and epoch end only, nothing between: "
                               "its link carries activations alone, and a lost board sends the run back to the last "
                               "checkpoint)")
    audits = p.add_argument_group(
        "audits (global data mode)",
        "The coordinator holds the data, the split and the model, so it computes a board's gradient for its slice\n"
        "again at random steps and compares: a board with valid keys that sends a gradient other than its slice's\n"
        "(scaled, flipped, made up) is left out, and the run goes back to step 0 and on without it, so that the\n"
        "model ends as the honest boards alone would have trained it (docs/security.md).")
    audits.add_argument("--audit-share", type=float, default=0.25, metavar="FRACTION",
                        help="share of one of this machine's cores spent on audits (CPU); how often each board is audited is fitted "
                             "to it (default 0.25; 0 turns audits off)")
    audits.add_argument("--aggregate", choices=AGGREGATES, default="mean",
                        help="how each step's gradients are reduced: mean (exact, the default), or a robust rule for "
                             "--data-mode local, where boards cannot be audited: trimmed-mean, median (per coordinate, "
                             "unweighted) or clip (each gradient cut to the boards' median norm); a robust rule bounds what one "
                             "lying board can do to a step and CHANGES THE MATHEMATICS (docs/security.md)")
    audits.add_argument("--audit-every", type=int, metavar="STEPS",
                        help="audit each board once within every STEPS steps (at a random one of them) instead of the "
                             "fitted rate; 1 audits every board at every step")
    p.add_argument("--force-split", metavar="STEP:B,B,…", help=argparse.SUPPRESS)  # test hook: a re-split from STEP
    p.add_argument("--run-dir", type=Path, help="where the run is written (default runs/<run-id>)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue an interrupted run")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout (result.json's fields, run_dir, model); the "
                        "progress and notes go to stderr")
    p.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                   help="when the output is not a terminal (nohup, systemd, | tee): one plain progress line this often "
                        "(time, epoch, step, samples/s, loss, ETA; 0: every step; default 30)")
    p.add_argument("--fleet-key", metavar="FILE", help=FLEET_KEY_HELP)
    add_board_keys_arg(p)
    p.add_argument("--allow-token-boards", action="store_true",
                   help="let boards without a key of their own (not in --board-keys) join the exchange with a token carried "
                        "in their signed command, which anyone who reads the broker can read and use to take their place; "
                        "without it such a job is refused before any board starts (the run names them when allowed)")
    p.add_argument("--metrics-listen", type=listen_address("--metrics-listen"), metavar="HOST:PORT",
                   help="while the run lasts, serve Prometheus metrics on http://HOST:PORT/metrics: the boards (as "
                        "`edge-coordinator exporter`) and the run's step time, samples/s, loss and each board's compute "
                        f"time (edgefleet_train_*; docs/monitoring.md). {LISTEN_HELP}")
    p.add_argument("--metrics-grace", type=float, default=30.0, metavar="SECONDS",
                   help="with --metrics-listen: after the run, keep its final state (edgefleet_train_running 0) on the "
                        "page until Prometheus has scraped it twice or SECONDS passed (default 30: two 15 s scrapes)")
    from edgefleet.coordinator.cli.auto import add_auto_args  # numpy (planning/): when the parser is built, not by importing this module

    add_auto_args(p)


def cmd_train(args: argparse.Namespace) -> int:
    """``edge-coordinator train``; returns the exit status."""
    # numpy, rich and torch: only when a run starts
    from edgefleet.coordinator.cli.auto import planner_flags_given, run_auto
    from edgefleet.coordinator.cli.train_progress import display_options, run_training_ui
    from edgefleet.coordinator.run.checkpoints import atomic_write_json, check_new_run_dir

    if args.resume is None and args.run_dir is not None:
        check_new_run_dir(args.run_dir)  # before the broker, the data or any board is touched
    options = display_options(args)
    if args.auto:
        with served_metrics(args) as metrics:
            return run_auto(args, metrics=metrics)
    planner_flags = planner_flags_given(args)
    if planner_flags:
        raise ConfigError(f"{', '.join(planner_flags)} tell the planner what to choose: add --auto (without it, train "
                          "uses exactly the --boards and --batch you give)")
    cfg = load_config(args)
    fleet_key = coordinator_keys(args, cfg)
    spec = load_job(args.resume) if args.resume is not None else job_from_args(args)
    if args.resume is not None and (args.pipeline or tail_board(args)):  # the run goes on with other stages
        spec = repipeline(spec, pipeline_flag(args, tuple(b for b in (args.boards or "").split(",") if b)),
                          args.micro_batches if args.micro_batches != 1 else None)
        atomic_write_json(args.resume / "config.json", spec.to_json())
    spec = resolve_job(spec, broker=cfg.broker)
    run_dir = args.resume or args.run_dir or default_run_dir(spec)
    with served_metrics(args) as metrics:
        return run_training_ui(spec, run_dir, broker=cfg.broker, fleet_key=fleet_key, resume=args.resume is not None,
                               metrics=metrics, options=options)


@contextmanager
def served_metrics(args: argparse.Namespace) -> Iterator[TrainingMetrics | None]:
    """With ``--metrics-listen``, the fleet's metrics while the block runs, and the run's from the yielded
    collector (pass it to the progress display); without, nothing and None."""
    listen: HostPort | None = getattr(args, "metrics_listen", None)
    if listen is None:
        yield None
        return
    from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics  # prometheus_client: optional, only with --metrics

    metrics = TrainingMetrics()
    with serve_fleet_metrics(load_config(args).broker, listen, collectors=[metrics]) as endpoint:
        print(f"metrics: {endpoint.url}", flush=True, file=sys.stderr if getattr(args, "json", False) else sys.stdout)
        yield metrics
        metrics.linger(getattr(args, "metrics_grace", 30.0))  # so that Prometheus sees the run end


__all__ = ["add_train_parser", "cmd_train", "served_metrics"]
