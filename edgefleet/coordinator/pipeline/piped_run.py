"""A pipelined run's coordinator side: the replica's model cut into stages and checked before any board
starts, and where each stage's gradient goes in the replica's vector.

:func:`prepare` cuts the replica's model as ``--pipeline`` says (``workloads.stage_cut``) and refuses,
naming why and what to do, what the pipeline cannot train exactly yet: a module with buffers (their
running statistics would have to travel with the stages' gradients), a ``training_step`` that calls
``forward`` other than once per batch or runs a later stage's layer outside ``forward``, or one whose
loss through the stages differs from the uncut model's on a sample batch. The check runs on a copy of
the random generators' state and restores every buffer.

:class:`PipedRun` then gives the exchange its layout (``coordinator.exchange.pipeline_layout``: each
board's vector is its stage's gradient, in the replica's own order, and lands in its slots of the
replica's vector) and each board's command its pipeline (``protocol.pipeline_command``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from edgefleet.coordinator.exchange.pipeline_layout import PipelineLayout
from edgefleet.coordinator.pipeline.stage_plan import StagePlan
from edgefleet.protocol.codec import decode_value, encode_value
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exchange_frames import Welcome
from edgefleet.protocol.pipeline_command import PipelinePeer, PipelineSpec
from edgefleet.protocol.stage_routes import stage_routes
from edgefleet.protocol.stage_sync import StageSync
from edgefleet.workloads.cut_check import check_cut_forward
from edgefleet.workloads.params import BufferSet
from edgefleet.workloads.stage_cut import StagedModel, cut_stages, stage_shapes

log = logging.getLogger(__name__)

SAMPLE_ROWS = 2  # samples in the batch the cut is checked on


class PipedRun:
    """One pipelined run: the replica's model cut, the shapes between stages, the exchange's layout.

    Args:
        plan: the stages' boards and cuts.
        staged: the replica's model, cut.
        shapes: each stage's output shape per sample.
        micro_batches: M.
        exchanged: the replica's parameters in its vector's order.
        batch_sizes: the job's batch sizes: stage 0's boards' slices first (their sum is the global batch).
    """

    def __init__(self, plan: StagePlan, staged: StagedModel, shapes: list[tuple[int, ...]], micro_batches: int,
                 exchanged: Sequence[torch.nn.Parameter], batch_sizes: Sequence[int],
                 names: Mapping[int, str] | None = None) -> None:
        self.plan, self.staged, self.shapes, self.micro_batches = plan, staged, shapes, micro_batches
        self._names = dict(names or {})  # id(parameter) -> its name in the model's state dict
        self.batch_sizes = list(batch_sizes[:plan.group])  # stage 0's boards' slices
        self.global_batch = global_batch = sum(self.batch_sizes)
        offsets: dict[int, int] = {}
        at = 0
        for p in exchanged:
            offsets[id(p)] = at
            at += p.numel()
        elements: list[int] = []
        slots: list[list[tuple[int, int, int]]] = []
        for stage_params in staged.params:
            mine = {id(p) for p in stage_params}
            runs: list[tuple[int, int, int]] = []
            local = 0
            for p in exchanged:  # the board's vector: its stage's trainable parameters in the replica's order
                if id(p) not in mine:
                    continue
                full, count = offsets[id(p)], p.numel()
                if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == full:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + count)
                else:
                    runs.append((local, full, count))
                local += count
            elements.append(local)
            slots.append(runs)
        # a stage's boards (stage 0's group, a later stage's group): the same layers, the same slots
        sizes = plan.sizes
        self.routes = stage_routes(sizes, self.batch_sizes, micro_batches)
        for k, size in enumerate(sizes):
            if k and size > 1 and min(self.routes.rows_of(k, m) for m in range(size)) == 0:
                units = len(self.routes.units())
                raise ConfigError(f"--pipeline {plan.text()}: stage {k}'s {size} boards share {units} micro-batch(es) a "
                                  f"step, so one would have none: give --micro-batches {-(-size // plan.group)} or "
                                  f"more, or fewer boards at stage {k}")
        self.layout = PipelineLayout(elements=[n for k, n in enumerate(elements) for _ in range(sizes[k])],
                                     slots=[runs for k, runs in enumerate(slots) for _ in range(sizes[k])],
                                     full_elements=at, global_batch=global_batch, group=plan.group, sizes=tuple(sizes),
                                     rows=tuple(self.routes.rows_of(k, m) for k, size in enumerate(sizes)
                                                for m in range(size)))
        self.sync: StageSync | None = None

    def sync_stages(self, sync: StageSync) -> None:
        """The later stages send their state as ``sync`` says (``protocol.stage_sync``): the layout and the command."""
        self.sync = sync
        self.layout = dataclasses.replace(self.layout, sync=sync)

    def stage_welcome(self, board_index: int, welcome: Welcome, optimizer: torch.optim.Optimizer) -> Welcome:
        """``welcome`` (the whole model's state, encoded) cut to what the ``board_index``-th board of the pipeline
        trains: its stage's weights and their optimizer state (and any weight no stage holds), so that a board never
        holds another stage's (``agent.stage_worker`` releases them); the optimizer's param groups stay whole."""
        stage = self.plan.stage_of(board_index)
        others = {id(p) for k, params in enumerate(self.staged.params) if k != stage for p in params}
        if not isinstance(welcome.model, dict):
            return welcome
        other_names = {self._names[pid] for pid in others if pid in self._names}
        model = {name: value for name, value in welcome.model.items() if name not in other_names}
        dropped = {i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
                   if id(p) in others}
        tree = decode_value(welcome.optimizer)  # its state's integer keys travel as pairs: cut the plain tree
        if isinstance(tree, dict) and isinstance(tree.get("state"), dict):
            tree["state"] = {k: v for k, v in tree["state"].items() if int(k) not in dropped}
        return dataclasses.replace(welcome, model=model, optimizer=encode_value(tree))

    def spec(self, hosts: Mapping[str, str], public_keys: Mapping[str, str], ports: Mapping[str, int]) -> PipelineSpec:
        """The command's pipeline: each board at ``hosts[board]``, listening on ``ports[board]``
        (``JobSpec.pipeline_ports``)."""
        peers = [PipelinePeer(board_id=b, host=hosts[b], port=ports[b], public_key=public_keys[b])
                 for b in self.plan.boards]
        return PipelineSpec(cuts=list(self.plan.cuts), micro_batches=self.micro_batches, stages=peers,
                            shapes=[list(s) for s in self.shapes], max_rows=max(self.batch_sizes), group=self.plan.group,
                            state_every=self.sync.every if self.sync is not None else 0,
                            groups=list(self.plan.sizes) if self.plan.later_groups else [])

    def describe(self) -> str:
        """What each stage trains and what crosses each link per step, for the run's note."""
        counts = [sum(p.numel() for p in ps) for ps in self.staged.params]
        where = ["+".join(self.plan.stage_boards(k)) for k in range(len(self.plan.sizes))]
        stages = "; ".join(f"stage {k} on {b}: {n:,} parameters" for k, (b, n) in enumerate(zip(where, counts)))
        crossing = [self.global_batch * int(np.prod(s)) * 4 for s in self.shapes[:-1]]
        links = ", ".join(f"{_kb(n)}" for n in crossing)
        sent = ("each later stage's parameters and optimizer state go to the coordinator's replica at its checkpoints "
                "and epoch ends only" if self.sync is not None and self.sync.sparse
                else "each stage's gradient goes to the coordinator's replica every step")
        if self.plan.later_groups and self.sync is not None and self.sync.sparse:
            sent += " (a later stage of several boards: its gradient every step, averaged over its group)"
        return (f"pipeline of {len(counts)} stages, {self.micro_batches} micro-batch(es) a step (GPipe): {stages}; "
                f"activations per step at each cut, each way: {links}; {sent}")


def prepare(model: Any, plan: StagePlan, micro_batches: int, exchanged: Sequence[torch.nn.Parameter], sample: Any,
            batch_sizes: Sequence[int]) -> PipedRun:
    """Cut the replica's ``model`` as ``plan`` says and check the cut on ``sample`` (a collated batch).

    Raises:
        ConfigError: a cut that does not exist or is not admissible, buffers, or a module the stages cannot train
            exactly (the message says why and what to do).
    """
    buffers = BufferSet(model)
    if buffers.elements:
        name = next(iter(n for n, _ in model.named_buffers()), "")
        raise ConfigError(f"--pipeline: {type(model).__name__} holds buffers ({name}, e.g. BatchNorm's running "
                          "statistics), which a pipeline cannot carry yet: train it data-parallel (leave --pipeline out)")
    staged = cut_stages(model, list(plan.cuts), micro_batches=micro_batches)
    if not any(p.requires_grad for p in staged.params[0]):
        raise ConfigError(f"--pipeline {plan.text()}: stage 0 (up to {plan.cuts[0]}) trains no parameter, so nothing "
                          "would send the stages' gradients back to it: cut later")
    x = _input_of(sample)
    shapes = stage_shapes(staged, x)
    _check_on_sample(model, staged, sample, plan)
    return PipedRun(plan, staged, shapes, micro_batches, exchanged, batch_sizes,
                    names={id(p): name for name, p in model.named_parameters()})


def _input_of(batch: Any) -> torch.Tensor:
    """The model's input in a collated batch: the batch itself, or its first item."""
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    if not isinstance(first, torch.Tensor):
        raise ConfigError(f"--pipeline: a batch's first item is a {type(first).__name__}, not the model's input tensor; "
                          "a pipeline needs a forward of one tensor")
    return first


def _check_on_sample(model: Any, staged: StagedModel, batch: Any, plan: StagePlan) -> None:
    """Run ``training_step`` on ``batch`` uncut and through the stages (locally, one micro-batch).

    Raises:
        ConfigError: forward runs other than once, a later stage's layer runs outside forward, or the losses differ.
    """
    def staged_forward(x: torch.Tensor) -> torch.Tensor:
        out = x
        for stage in staged.stages:
            out = stage(out)
        return out

    seen = check_cut_forward(model, batch, staged_forward, [m for modules in staged.modules[1:] for m in modules])
    where = f"{type(model).__name__}.training_step"
    if seen.calls != 1:
        raise ConfigError(f"--pipeline {plan.text()}: {where} ran the model's forward {seen.calls} times on one batch; "
                          "a pipeline sends one batch through the stages per step: train it data-parallel")
    if seen.outside:
        raise ConfigError(f"--pipeline {plan.text()}: {where} runs layers of a later stage outside forward (a loss from "
                          "intermediate activations); they live on other boards: train it data-parallel")
    if not seen.same_loss():
        raise ConfigError(f"--pipeline {plan.text()}: {where} gives the loss {seen.loss_cut} through the stages and "
                          f"{seen.loss_uncut} without on a sample batch, so the cut changes what is trained: choose "
                          "other cuts")


def _kb(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n >= 10 * 1024 else f"{n / 1024:.1f} KiB"


__all__ = ["SAMPLE_ROWS", "PipedRun", "prepare"]
