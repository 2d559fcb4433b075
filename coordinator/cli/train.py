"""``edge-coordinator train``: options, the progress display and the summary table."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

from edgefleet.protocol.errors import ConfigError, EdgeTrainError

TRAIN_EPILOG = """\
examples:
  edge-coordinator train --boards pi-1,pi-2,orin-1 --model lenet5 --dataset digits --batch 16,16,48 --epochs 5
  edge-coordinator train --model mlp --model-options layers=3,width=64 --dataset synthetic --steps 200
  edge-coordinator train --model mypkg.models:Net --dataset mypkg.data:make_dataset --batch 32 --epochs 2
  edge-coordinator train --resume runs/lenet5-digits-20261121-101500-ab12

The run directory (runs/<run-id>/ unless --run-dir) holds config.json, metrics.jsonl (one line per
applied step), checkpoint.pt, result.json and, when the run completes, model.pt (a plain state_dict).
Ctrl-C stops at a step boundary and leaves a checkpoint that --resume continues from.

When a board's time per sample drifts by more than --rebalance-threshold (a Pi throttling under
heat), the batch sizes are re-balanced at a step boundary with the same global batch: a note
"step N: re-balancing from step M: ..." and a "rebalance" entry in that step's metrics.jsonl line.
Once the new sizes have run a few steps they are checked in turn: a board still the slowest by a
margin (it slowed further meanwhile) gets a second re-balance, "... still the slowest at the new sizes".
"""


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model on the boards (synchronous data-parallel)",
                       description="Train one model on several boards at once with DDP's mathematics: every step "
                                   "averages the boards' gradients weighted by their batch sizes.",
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boards", metavar="ID,ID,…", help="boards that take part (default: every online board that can train)")
    p.add_argument("--model", default="lenet5", help="lenet5, mlp, resnet_small, an entry point or pkg.module:Class, "
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
    p.add_argument("--batch", default="32", metavar="B[,B,…]", help="batch size per board, one value for all or one per board (default 32)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, help="epochs over the dataset (default 5)")
    length.add_argument("--steps", type=int, help="global steps instead of epochs")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the data order (default 0)")
    p.add_argument("--lr", type=float, help="learning rate (default: the model's)")
    p.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="gradients on the wire (default float32: exact; float16 halves the bytes)")
    p.add_argument("--data-mode", choices=("global", "local"), default="global",
                   help="global: every board holds the whole dataset and takes its slice of each global batch; "
                        "local: each board trains on its own data (default global)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per board (default: one per core of the board's CPU quota, else of its CPUs)")
    lightning = p.add_argument_group("Lightning Trainer flags (the same on every board and on the coordinator's replica)")
    lightning.add_argument("--accumulate-grad-batches", type=int, default=1, metavar="K",
                           help="sum the gradients of K global batches before each optimizer step (default 1)")
    lightning.add_argument("--gradient-clip-val", type=float, metavar="X",
                           help="clip the averaged gradient (default: no clipping)")
    lightning.add_argument("--gradient-clip-algorithm", choices=("norm", "value"), default="norm",
                           help="norm: over all parameters together (default); value: each element")
    lightning.add_argument("--deterministic", action="store_true", help="torch's deterministic algorithms on every replica")
    lightning.add_argument("--precision", default="32-true", metavar="32-true|bf16-mixed",
                           help="bf16-mixed: autocast to bfloat16 on every board (weights and gradients stay fp32); "
                                "16-mixed is refused (default 32-true)")
    lightning.add_argument("--log-every-n-steps", type=int, default=50, metavar="N",
                           help="how often --logger writes what training_step logs per step (default 50, Lightning's)")
    lightning.add_argument("--sync-buffers", choices=("broadcast", "average"), default="broadcast",
                           help="BatchNorm's running statistics (every float buffer) after each step: broadcast the "
                                "first board's, as DDP does (default), or average them over the boards' samples")
    lightning.add_argument("--logger", choices=("none", "csv", "tensorboard"), default="none",
                           help="write what the module logs in validation_step, and the fleet's loss, with "
                                "Lightning's CSVLogger or TensorBoardLogger into RUN_DIR/logs (default none)")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS", help="checkpoint interval (default 50)")
    p.add_argument("--step-timeout", type=float, default=10.0, metavar="S",
                   help="a board later than max(S, 5x the median step) is left out of that step (default 10)")
    p.add_argument("--exchange-host", default="", help="address the boards connect to (default: this machine's address towards the broker)")
    p.add_argument("--exchange-port", type=int, default=0, help="TCP port of the gradient exchange (default: any free port)")
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                   help="move samples between boards when one's speed drifts, keeping the global batch (default on; "
                        "global data mode only)")
    p.add_argument("--rebalance-threshold", type=float, default=0.15, metavar="FRACTION",
                   help="relative change of a board's time per sample that counts as drift (default 0.15); raise it "
                        "if the notes show re-balancing back and forth on a noisy fleet")
    p.add_argument("--force-split", metavar="STEP:B,B,…", help=argparse.SUPPRESS)  # test hook: a re-split from STEP
    p.add_argument("--run-dir", type=Path, help="where the run is written (default runs/<run-id>)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue an interrupted run")
    p.add_argument("--fleet-key", metavar="FILE", help="HMAC key that signs commands (default: [security] fleet_key_file)")
    from edgefleet.coordinator.auto_train import add_auto_args

    add_auto_args(p)


def parse_batches(text: str, boards: list[str]) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--batch {text!r}: use whole numbers, e.g. --batch 32 or --batch 16,16,48") from None
    if len(values) == 1:
        values = values * len(boards)
    if len(values) != len(boards):
        raise ConfigError(f"--batch has {len(values)} values for {len(boards)} boards ({', '.join(boards)}); give one per board or one for all")
    if any(v <= 0 for v in values):
        raise ConfigError(f"--batch {text!r}: every batch size must be at least 1")
    return values


def parse_force_split(text: str, batches: list[int]) -> dict[str, Any]:
    """``--force-split STEP:B,B,…`` (a test hook) as ``{"from_step": STEP, "batch_sizes": [...]}``."""
    from edgefleet.coordinator.exchange import SPLIT_LEAD_STEPS

    step_text, _, sizes_text = text.partition(":")
    try:
        from_step, sizes = int(step_text), [int(v) for v in sizes_text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--force-split {text!r}: use STEP:B,B,…, e.g. 8:16,16,16") from None
    if len(sizes) != len(batches) or min(sizes, default=0) < 1 or sum(sizes) != sum(batches):
        raise ConfigError(f"--force-split {text!r}: give each of the {len(batches)} boards at least one sample, "
                          f"{sum(batches)} in all (the global batch)")
    if from_step <= SPLIT_LEAD_STEPS:
        raise ConfigError(f"--force-split {text!r}: a re-split can start at step {SPLIT_LEAD_STEPS + 1} at the earliest")
    return {"from_step": from_step, "batch_sizes": sizes}


def build_spec(args: argparse.Namespace, broker: Any) -> tuple[Any, Path]:
    from edgefleet.coordinator.fleet_select import online_trainers
    from edgefleet.coordinator.training import TrainSpec
    from edgefleet.workloads.fleet_trainer import TrainerOptions, steps_per_epoch
    from edgefleet.workloads.registry import parse_options
    from edgefleet.workloads.sharding import GlobalBatchPlan
    from edgefleet.workloads.training_data import load_training_data

    if args.resume is not None:
        config = args.resume / "config.json"
        if not config.exists():
            raise ConfigError(f"{args.resume} is not a run directory (no config.json); give the folder train printed")
        return TrainSpec.from_json(json.loads(config.read_text())), args.resume
    boards = [b for b in (args.boards or "").split(",") if b] or online_trainers(broker)
    if not boards:
        raise ConfigError("no boards: none is online on this broker; start edge-agent on the boards or name them with --boards")
    if len(set(boards)) != len(boards):
        raise ConfigError(f"--boards names a board twice: {args.boards}")
    batches = parse_batches(args.batch, boards)
    if not args.rebalance_threshold > 0:
        raise ConfigError(f"--rebalance-threshold {args.rebalance_threshold}: use a fraction above 0, e.g. 0.15")
    force_split = parse_force_split(args.force_split, batches) if args.force_split else None
    if force_split is not None and args.data_mode != "global":
        raise ConfigError("--force-split needs --data-mode global: only a global batch can be re-split")
    dataset_options = parse_options(args.dataset_options)
    datamodule_options = parse_options(args.datamodule_options)
    dataset_spec = "" if args.datamodule else args.dataset
    if args.datamodule and dataset_options:
        raise ConfigError("--dataset-options belong to --dataset; a DataModule takes --datamodule-options")
    data = load_training_data(dataset=dataset_spec, dataset_options=dataset_options, datamodule=args.datamodule or "",
                              datamodule_options=datamodule_options, with_val=False)
    size = len(data.train)
    if args.data_mode == "global":
        batches_per_epoch = GlobalBatchPlan(size, batches, args.seed).steps_per_epoch
    else:
        batches_per_epoch = max(1, size // max(batches))
    if args.log_every_n_steps < 1:
        raise ConfigError(f"--log-every-n-steps {args.log_every_n_steps}: use a whole number of steps >= 1")
    options = TrainerOptions(accumulate_grad_batches=args.accumulate_grad_batches, gradient_clip_val=args.gradient_clip_val,
                             gradient_clip_algorithm=args.gradient_clip_algorithm, deterministic=args.deterministic,
                             precision=args.precision)
    per_epoch = steps_per_epoch(batches_per_epoch, options.accumulate_grad_batches)
    total = args.steps if args.steps is not None else max(1, round((args.epochs or 5.0) * per_epoch))
    data_name = args.datamodule or dataset_spec
    run_id = f"{args.model.split(':')[-1].lower()}-{data_name.split(':')[-1].lower()}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    spec = TrainSpec(run_id=run_id, boards=boards, batch_sizes=batches, model=args.model,
                     model_options=parse_options(args.model_options), dataset=dataset_spec, dataset_options=dataset_options,
                     datamodule=args.datamodule or "", datamodule_options=datamodule_options,
                     total_steps=total, steps_per_epoch=per_epoch, batches_per_epoch=batches_per_epoch, seed=args.seed,
                     lr=args.lr, wire_dtype=args.wire_dtype, data_mode=args.data_mode, threads=args.threads,
                     checkpoint_every=args.checkpoint_every, step_timeout_s=args.step_timeout,
                     exchange_host=args.exchange_host, exchange_port=args.exchange_port, rebalance=args.rebalance,
                     rebalance_threshold=args.rebalance_threshold, force_split=force_split,
                     accumulate_grad_batches=options.accumulate_grad_batches,
                     gradient_clip_val=options.gradient_clip_val, gradient_clip_algorithm=options.gradient_clip_algorithm,
                     deterministic=options.deterministic, precision=options.precision, logger=args.logger, sync_buffers=args.sync_buffers,
                     log_every_n_steps=args.log_every_n_steps)
    return spec, args.run_dir or Path("runs") / run_id


def run_training_ui(spec: Any, run_dir: Path, *, broker: Any, fleet_key: bytes, resume: bool) -> int:
    """Run with a progress bar; print the summary table. Returns the exit code."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from edgefleet.coordinator.render import make_console, summary_line, summary_table
    from edgefleet.coordinator.training import StepView, TrainingRun

    console = make_console()
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.description}"), console=console, transient=False)
    task = progress.add_task("", total=spec.total_steps)

    def on_step(view: StepView) -> None:
        boards = " ".join(f"{b}:{s * 1000:.0f}ms" for b, s in view.board_compute_s.items())
        acc = "-" if view.val_accuracy is None else f"{view.val_accuracy:.1%}"
        loss = "-" if view.loss is None else f"{view.loss:.4f}"
        dropped = f" [yellow]late: {','.join(view.late)}[/]" if view.late else ""
        shown = "".join(f" · {name} {value:.4g}" for name, value in view.shown.items())
        progress.update(task, completed=view.step + 1,
                        description=f"loss {loss}{shown} · val acc {acc} · {view.samples_per_s:.0f} samples/s · "
                                    f"{boards}{dropped}")

    run = TrainingRun(spec, run_dir=run_dir, broker=broker, fleet_key=fleet_key, on_step=on_step,
                      on_note=lambda text: progress.console.print(text), resume=resume)
    progress.update(task, completed=run.replica.step)
    try:
        with progress:
            outcome = asyncio.run(run.run())
    except KeyboardInterrupt:
        console.print(f"stopped before training began; nothing to resume. Run directory: {run_dir}")
        return 130
    console.print(summary_line(outcome.result))
    console.print(summary_table(outcome.result))
    if outcome.interrupted:
        console.print(f"stopped at step {outcome.result['steps']} of {spec.total_steps}; checkpoint saved. "
                      f"Continue with: edge-coordinator train --resume {run_dir}")
        return 130
    console.print(f"run directory: {run_dir}  (model: {run_dir / 'model.pt'})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from edgefleet.coordinator.auto_train import planner_flags_given, run_auto

    if args.auto:
        return run_auto(args)
    planner_flags = planner_flags_given(args)
    if planner_flags:
        raise ConfigError(f"{', '.join(planner_flags)} tell the planner what to choose: add --auto (without it, train "
                          "uses exactly the --boards and --batch you give)")
    from edgefleet.coordinator.config import load_coordinator_config
    from edgefleet.protocol.address import parse_host_port
    from edgefleet.transport.fleet_key import load_fleet_key

    broker = parse_host_port(args.broker, what="--broker") if args.broker else None
    cfg = load_coordinator_config(args.config, broker=broker, fleet_key_file=args.fleet_key)
    if not cfg.security.fleet_key_file:
        raise ConfigError("no fleet key: give --fleet-key FILE or [security] fleet_key_file (the key the boards verify commands with)")
    fleet_key = load_fleet_key(Path(cfg.security.fleet_key_file))
    try:
        spec, run_dir = build_spec(args, cfg.broker)
    except EdgeTrainError:
        raise
    return run_training_ui(spec, run_dir, broker=cfg.broker, fleet_key=fleet_key, resume=args.resume is not None)
