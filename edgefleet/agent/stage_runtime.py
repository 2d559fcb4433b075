"""A pipeline stage's step on its board (issue 35): GPipe micro-batches, ``Trainer.fit``'s mathematics.

The model is cut into S stages (``workloads.stage_cut``); each stage host runs the user's module in
its own Lightning Trainer, so the user's optimizers, schedulers, clipping by value and optimizer
hooks step the stage's own parameters exactly as ``Trainer.fit`` steps them (the others keep no
gradient, and torch's optimizers leave a parameter without one alone).

* **Stage 0** holds the data. :class:`FirstStage` gives its copy of the module a ``forward`` (on the
  instance: the module's code is not edited) that splits the batch into M micro-batches, runs stage
  0 on each and sends it downstream as soon as it is computed, then waits for the last stage's
  outputs and puts them together as one autograd node: ``training_step`` computes its loss, and
  ``self.log`` logs, over the whole batch as without the pipeline. In backward the loss's gradient
  goes to the last stage a micro-batch at a time, and the gradients of stage 0's outputs come back.
* **Stages 1 to S-1** (:class:`StageHost`) take each micro-batch's input from upstream as it comes,
  run their layers and send the output on, keep every micro-batch's graph (GPipe: all forwards,
  then all backwards), then take the output gradients. Their ``training_step`` (on the instance)
  returns sum_m <y_m, g_m>, whose gradient with respect to the stage's parameters is exactly the
  stage's share of the loss's, and whose backward, run by Lightning, sends each input's gradient
  upstream from a tensor hook as autograd reaches it.

**Stage 0's group.** Stage 0 may be several boards, data-parallel among them as any fleet is (each
with its slice of the global batch, its loss the mean over its slice, its stage-0 gradient averaged
by the exchange, sample-weighted). A later stage then runs every board's micro-batches (board by
board, in order: the same sums every run) and weighs board i's terms by n_i / N, its share of the
global batch, so that its gradient is the global loss's, as ``Trainer.fit``'s; the input gradients
it sends back are each board's own loss's (the weight taken out again), as board i's backward and
the exchange's average expect.

**A later stage's group.** A later stage may be several boards too. Each runs some of the step's
units (micro-batches, each of one source board: ``protocol.stage_routes``) and weighs a unit's terms
by n_src / R, its source board's slice over the R samples this board runs; the exchange averages the
group's gradients weighted by R, so the stage's gradient is sum over units of n_src / N x its
source's loss's, the global loss's again. Every board of the group steps on that average, as stage
0's boards do.

One step of the loop is one batch on every host. The step's result equals single-process
``Trainer.fit`` on the same batches up to float rounding in the micro-batches' sums (1e-5 is the
bar): the layers are applied per sample (BatchNorm with more than one micro-batch is refused by the
cut), and the loss sees the whole batch at once.

Why not 1F1B: a micro-batch's backward starts from the loss's gradient at its outputs, which for a
loss over the whole batch (``training_step`` is the user's) exists only after the last micro-batch's
forward; until then every stage holds every graph whatever the order. 1F1B saves memory only by
computing the loss a micro-batch at a time, exact only for sums of per-sample losses: GPipe keeps any
loss exact (docs/pipeline.md, "GPipe only").

Imported only by the training worker, for a pipelined job (``agent.stage_worker``): it needs torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from edgefleet.agent.stage_links import StageEndpoint, StageFault
from edgefleet.protocol.stage_frames import ACT, DACT, DOUT, OUT
from edgefleet.protocol.stage_routes import micro_rows
from edgefleet.workloads.stage_cut import StagedModel

log = logging.getLogger(__name__)

BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_batch_transfer", "on_after_batch_transfer",
               "transfer_batch_to_device")


class FirstStage:
    """Stage 0's side: the pipelined ``forward`` of the module on the data board.

    Args:
        staged: this board's copy of the module, cut.
        endpoint: this host's stage links, connected.
        micro_batches: M, the micro-batches a batch is split into.
        start: the step the run starts at (a resumed run's).
        member: this board's place in stage 0's group.
    """

    def __init__(self, staged: StagedModel, endpoint: StageEndpoint, micro_batches: int, *, start: int = 0,
                 member: int = 0) -> None:
        self.staged, self.endpoint, self.micro_batches, self.step = staged, endpoint, micro_batches, start
        self.member = member

    def install(self, model: torch.nn.Module) -> None:
        """Give ``model`` (this board's copy) the pipelined forward."""
        model.forward = self.forward  # this copy only (an instance attribute): the module's code is unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        self.step += 1
        rows = micro_rows(int(x.shape[0]), self.micro_batches)
        acts = []
        for micro, part in enumerate(torch.split(x, rows)):
            act = self.staged.stages[0](part)
            self.endpoint.send(ACT, step, micro, len(rows), act.detach().cpu().numpy(), src=self.member)
            acts.append(act)
        # torch types autograd.Function.apply as untyped (it forwards to the subclass's static forward)
        out: torch.Tensor = _RestOfPipeline.apply(self.endpoint, (step, self.member), rows, *acts)  # type: ignore[no-untyped-call]
        return out


class _RestOfPipeline(torch.autograd.Function):
    """Stages 1 to S-1 as one autograd node on stage 0: outputs come back, their gradients go out."""

    @staticmethod
    def forward(ctx: Any, endpoint: StageEndpoint, at: tuple[int, int], rows: list[int],
                *acts: torch.Tensor) -> torch.Tensor:
        step, src = at
        ctx.endpoint, ctx.step, ctx.src, ctx.rows = endpoint, step, src, rows
        ctx.device = acts[0].device
        outs = [torch.from_numpy(endpoint.recv(OUT, step, micro, rows=n, src=src)[0]) for micro, n in enumerate(rows)]
        return torch.cat(outs).to(acts[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        endpoint: StageEndpoint = ctx.endpoint
        parts = torch.split(grad.detach().cpu(), ctx.rows)
        for micro, part in enumerate(parts):
            endpoint.send(DOUT, ctx.step, micro, len(parts), part.numpy(), src=ctx.src)
        dacts = [torch.from_numpy(endpoint.recv(DACT, ctx.step, micro, rows=n, src=ctx.src)[0]).to(ctx.device)
                 for micro, n in enumerate(ctx.rows)]
        return (None, None, None, *dacts)


class StageHost:
    """A stage after the first: its ``training_step`` is the stage's GPipe step over the micro-batches it handles.

    Args:
        staged: this board's copy of the module, cut.
        stage: this host's stage (1 to S-1).
        endpoint: this host's stage links, connected: their plan's routes say which units of a step this board runs
            (every unit, at a stage of one board) and each source board's slice.
        start: the step the run starts at.
    """

    def __init__(self, staged: StagedModel, stage: int, endpoint: StageEndpoint, *, start: int = 0) -> None:
        if not 0 < stage < len(staged.stages):
            raise ValueError(f"stage {stage} is not a stage host of a {len(staged.stages)}-stage pipeline")
        self.staged, self.stage, self.endpoint, self.step = staged, stage, endpoint, start
        self.last = stage == len(staged.stages) - 1
        plan = endpoint.plan
        self.units = plan.units()  # (source board, micro-batch, samples), in order: the same sums every run
        self.rows = sum(rows for _, _, rows in self.units)
        routes = plan.routes
        # A unit's terms weigh n_src / rows: its source board's share of the global batch over this board's share, so
        # that this board's gradient, averaged by the exchange over its group by samples (rows), is the global loss's;
        # with one board at stage 0 and at this stage, 1 (nothing is multiplied).
        self.weights = {src: routes.batch_sizes[src] / self.rows for src in range(routes.sizes[0])}
        self.plain = routes.sizes[0] == 1 and self.rows == routes.global_batch
        self.micro_counts = {src: routes.micro_count(src) for src in range(routes.sizes[0])}

    def install(self, model: Any) -> None:
        """Give ``model`` (this board's copy) the stage's ``training_step``; the batch hooks the module overrides are
        put back to Lightning's own here: they run where the batch is, on stage 0 (this host's batches are the step
        numbers)."""
        model.training_step = self.training_step
        for hook in BATCH_HOOKS:
            for base in type(model).__mro__:
                if base.__module__.split(".")[0] in ("lightning", "pytorch_lightning") and hook in vars(base):
                    setattr(model, hook, getattr(base, hook).__get__(model))
                    break

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.step
        self.step += 1
        layers = self.staged.stages[self.stage]
        device = _device_of(layers)
        held: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (source board, micro-batch, input, output)
        for src, micro, rows in self.units:
            array, micros = self.endpoint.recv(ACT, step, micro, rows=rows, src=src)
            if micros != self.micro_counts[src]:
                raise StageFault(f"source board {src} split step {step} into {micros} micro-batches; the plan makes "
                                 f"{self.micro_counts[src]}")
            x = torch.from_numpy(array).to(device).requires_grad_(True)
            # torch leaves Tensor.register_hook untyped; the hook sends this input's gradient when autograd reaches it
            x.register_hook(self._send_back(step, src, micro, micros))  # type: ignore[no-untyped-call]
            y = layers(x)
            if not isinstance(y, torch.Tensor):
                raise StageFault(f"stage {self.stage} gave a {type(y).__name__}, not a tensor")
            self.endpoint.send(OUT if self.last else ACT, step, micro, micros, y.detach().cpu().numpy(), src=src)
            held.append((src, micro, x, y))
        stream = DOUT if self.last else DACT
        total = torch.zeros((), device=device)
        for src, micro, x, y in held:
            grad = torch.from_numpy(self.endpoint.recv(stream, step, micro, rows=int(x.shape[0]), src=src)[0]).to(device)
            term = (y * grad).sum()
            total = total + (term if self.plain else term * self.weights[src])
        return total

    def _send_back(self, step: int, src: int, micro: int, micros: int) -> Callable[[torch.Tensor], None]:
        def send(grad: torch.Tensor) -> None:
            own = grad if self.plain else grad / self.weights[src]  # the source board's own loss's gradient
            self.endpoint.send(DACT, step, micro, micros, own.detach().cpu().numpy(), src=src)
        return send


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


__all__ = ["BATCH_HOOKS", "FirstStage", "StageHost", "micro_rows"]  # micro_rows: protocol.stage_routes's
