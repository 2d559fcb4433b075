"""The ``train`` flags as the job they describe: :func:`job_from_args` (used by ``train`` and
``train --auto``), the ``--batch`` list and the ``--force-split`` test hook."""

from __future__ import annotations

import argparse

from edgefleet.coordinator.run.job_spec import DEFAULT_PIPELINE_PORT, JobSpec
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exchange_frames import BatchSplit
from edgefleet.protocol.outer_optimizer import AVERAGE, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM


def parse_batches(text: str) -> tuple[int, ...]:
    """``--batch B[,B,…]``: one batch size for every board, or one per board (matched to the boards when the job is resolved)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--batch {text!r}: use whole numbers, e.g. --batch 32 or --batch 16,16,48") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--batch {text!r}: every batch size must be at least 1")
    return values


def parse_force_split(text: str) -> BatchSplit:
    """``--force-split STEP:B,B,…`` (a test hook): batch sizes B,B,… from step STEP on.

    Whether the sizes fit the boards is checked when the job is resolved (``train_job.check_force_split``).
    """
    step_text, _, sizes_text = text.partition(":")
    try:
        from_step, sizes = int(step_text), [int(v) for v in sizes_text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--force-split {text!r}: use STEP:B,B,…, e.g. 8:16,16,16") from None
    if from_step < 0 or not sizes:
        raise ConfigError(f"--force-split {text!r}: use STEP:B,B,…, e.g. 8:16,16,16")
    return BatchSplit(from_step, tuple(sizes))


def job_from_args(args: argparse.Namespace, *, batch_sizes: tuple[int, ...] | None = None) -> JobSpec:
    """The job the ``train`` flags describe (``batch_sizes``: instead of ``--batch``). Raises ConfigError naming the flag."""
    from edgefleet.workloads.registry import parse_options  # torch and Lightning: off the CLI start

    boards = tuple(b for b in (args.boards or "").split(",") if b)
    pipeline = pipeline_flag(args, boards)
    if pipeline and tail_board(args):
        boards = ()  # the pipeline names them: the head's and the tail's board
    return JobSpec(model=args.model, model_options=parse_options(args.model_options),
                   dataset="" if args.datamodule else args.dataset, dataset_options=parse_options(args.dataset_options),
                   datamodule=args.datamodule or "", datamodule_options=parse_options(args.datamodule_options),
                   boards=boards, batch_sizes=batch_sizes or parse_batches(args.batch),
                   epochs=args.epochs, steps=args.steps, target_accuracy=args.target_accuracy, seed=args.seed, lr=args.lr,
                   wire_dtype=args.wire_dtype, data_mode=args.data_mode, threads=args.threads,
                   accumulate_grad_batches=args.accumulate_grad_batches, gradient_clip_val=args.gradient_clip_val,
                   gradient_clip_algorithm=args.gradient_clip_algorithm, deterministic=args.deterministic,
                   precision=args.precision, logger=args.logger, sync_buffers=args.sync_buffers,
                   log_every_n_steps=args.log_every_n_steps, checkpoint_every=args.checkpoint_every,
                   step_timeout_s=args.step_timeout, exchange_host=args.exchange_host, exchange_port=args.exchange_port,
                   exchange_tls=args.exchange_tls,
                   rebalance=args.rebalance, rebalance_threshold=args.rebalance_threshold,
                   sync_every=getattr(args, "sync_every", 1), sync_warmup=getattr(args, "sync_warmup", None),
                   outer_optimizer=getattr(args, "outer_optimizer", AVERAGE),
                   outer_lr=getattr(args, "outer_lr", DEFAULT_OUTER_LR),
                   outer_momentum=getattr(args, "outer_momentum", DEFAULT_OUTER_MOMENTUM),
                   overlap=getattr(args, "overlap", False), placement=_placement(args),
                   pipeline=pipeline, micro_batches=getattr(args, "micro_batches", 1),
                   pipeline_port=getattr(args, "pipeline_port", DEFAULT_PIPELINE_PORT),
                   stage_sync=getattr(args, "stage_sync", "step"),
                   aggregate=getattr(args, "aggregate", "mean"),
                   audit_share=getattr(args, "audit_share", 0.25), audit_every=getattr(args, "audit_every", None),
                   allow_token_boards=getattr(args, "allow_token_boards", False),
                   force_split=parse_force_split(args.force_split) if args.force_split else None)


def placement_choice(value: str | None) -> str:
    """``--placement``: ``none`` (or not given), ``auto`` (the planner weighs every cut: with ``--auto`` or
    ``plan``), or a cut, ``CUT`` or ``CUT@coordinator`` (a tail on a board, ``CUT@BOARD``, is a two-stage pipeline:
    :func:`tail_on_board`).

    Raises:
        ConfigError: a tail on a board where only the coordinator can take it (``plan``, ``--auto``).
    """
    text = (value or "").strip()
    if text.lower() in ("", "none", "auto"):
        return text.lower() or "none"
    cut, _, host = text.partition("@")
    if host and host != "coordinator":
        raise ConfigError(f"--placement {value}: here the tail runs on the coordinator; use {cut}@coordinator "
                          f"(or just {cut}), or train --placement {value} to put it on board {host}")
    return cut


def tail_on_board(value: str | None, boards: tuple[str, ...]) -> str:
    """``--placement CUT@BOARD`` as the pipeline it is (``coordinator.pipeline``): the head on ``--boards`` (all but
    ``BOARD``), data-parallel, and the tail on ``BOARD`` over the whole global batch; "" for any other placement.

    Raises:
        ConfigError: no head boards named.
    """
    cut, _, host = (value or "").strip().partition("@")
    if not host or host == "coordinator":
        return ""
    head = [b for b in boards if b != host]
    if not cut or not head:
        raise ConfigError(f"--placement {value}: name the boards that train the layers up to {cut or 'the cut'} with "
                          f"--boards (e.g. --boards p1,p2,p3 --placement {cut or 'net.6'}@{host})")
    return f"{'+'.join(head)},{cut}@{host}"


def _placement(args: argparse.Namespace) -> str:
    """The JobSpec's ``placement`` for ``train``'s flags ("" for data-parallel or a tail on a board; with ``--auto``
    the planner sets it).

    Raises:
        ConfigError: ``--placement auto`` without ``--auto``.
    """
    if tail_board(args):
        return ""  # the tail on a board: a pipeline (_pipeline)
    choice = placement_choice(getattr(args, "placement", None))
    if choice == "auto" and not getattr(args, "auto", False):
        raise ConfigError("--placement auto lets the planner choose the cut: add --auto, or name the cut (edge-coordinator "
                          "plan lists the cuts it weighed), or use --placement none")
    return "" if choice in ("none", "auto") else choice


def tail_board(args: argparse.Namespace) -> bool:
    """Whether ``--placement`` puts the tail on a board (``CUT@BOARD``, not the coordinator)."""
    host = (getattr(args, "placement", None) or "").partition("@")[2].strip()
    return bool(host) and host != "coordinator"


def pipeline_flag(args: argparse.Namespace, boards: tuple[str, ...]) -> str:
    """The JobSpec's ``pipeline``: ``--pipeline``, or ``--placement CUT@BOARD`` as a two-stage one.

    Raises:
        ConfigError: both flags, or a tail on a board without head boards.
    """
    given = getattr(args, "pipeline", None) or ""
    if not tail_board(args):
        return given
    if given:
        raise ConfigError(f"--placement {args.placement} and --pipeline {given} both place layers: give one of them")
    return tail_on_board(args.placement, boards)


__all__ = ["job_from_args", "parse_batches", "parse_force_split", "pipeline_flag", "placement_choice", "tail_board",
           "tail_on_board"]
