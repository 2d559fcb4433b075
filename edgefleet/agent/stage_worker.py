"""A pipelined job on a board (issue 35): which stage this board trains, its links, its loop's batches.

The worker (``agent.worker``) runs a pipelined job as any other, through the gradient exchange (the
welcome's model, optimizer state and step; each step's vector to the coordinator's replica), with
three differences made here:

* :func:`stage_of` cuts the module as the command says (``workloads.stage_cut``): the board's vector
  is its stage's trainable parameters' gradient (:attr:`BoardStage.params`, in the optimizer's order
  as the coordinator's layout expects), and the others keep no gradient on this board;
* :func:`release_other_stages` frees the other stages' weights (the welcome holds only this stage's,
  loaded by :func:`load_stage_weights`): a board holds its own stage, so a model larger than any one
  board's memory trains;
* :func:`link_stage` opens the stage links (``agent.stage_links``), proving and encrypting with the
  board's own Ed25519 key, and gives the module its stage's part (``agent.stage_runtime``): stage 0's
  pipelined ``forward``, a later stage's ``training_step``;
* :func:`stage_host_loader` is a later stage's data: one placeholder item per batch (the step's
  number), in the epochs and positions of the run, since its inputs come over the links.

Imported only by the training worker (it needs torch).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from edgefleet.agent.stage_links import StageEndpoint, StageLinkPlan, StagePeer
from edgefleet.agent.stage_runtime import FirstStage, StageHost
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.protocol.jobs import TrainCommand
from edgefleet.protocol.pipeline_command import PipelineSpec
from edgefleet.transport.fleet_key import load_board_key
from edgefleet.workloads.fleet_trainer import EpochBatchSampler, LoopPosition
from edgefleet.workloads.params import trainable_params
from edgefleet.workloads.stage_cut import StagedModel, cut_stages

log = logging.getLogger(__name__)


@dataclass
class BoardStage:
    """This board's stage of a pipelined job (``member``: its place in its stage's group)."""

    spec: PipelineSpec
    stage: int
    member: int
    staged: StagedModel
    params: list[torch.nn.Parameter]  # the stage's trainable parameters, in the optimizer's order: the vector's
    stage0_elements: int  # stage 0's vector: every step's answer (stage 0's average; a later stage ignores it)
    released: set[str] = dataclasses.field(default_factory=set)  # the other stages' weights, freed here

    @property
    def elements(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def grouped_later(self) -> bool:
        """A later stage of several boards: its gradient is averaged over its group every step, and its board steps on
        the average, as stage 0's boards do on theirs."""
        return self.stage > 0 and self.spec.sizes[self.stage] > 1


def stage_of(job: TrainCommand, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> BoardStage:
    """Cut this board's copy of the module as the job's pipeline says.

    Raises:
        EdgeTrainError: the job carries no pipeline.
        ConfigError: the cut is not admissible here (another model version than the coordinator's).
    """
    spec = job.pipeline_spec
    if spec is None:
        raise EdgeTrainError("the job carries no pipeline")
    staged = cut_stages(model, spec.cuts, micro_batches=spec.micro_batches)
    stage = spec.stage_of(job.board_index)
    trainable = trainable_params(optimizer)

    def of(k: int) -> list[torch.nn.Parameter]:
        ids = {id(p) for p in staged.params[k]}
        return [p for p in trainable if id(p) in ids]

    return BoardStage(spec=spec, stage=stage, member=spec.member_of(job.board_index), staged=staged,
                      params=of(stage), stage0_elements=sum(p.numel() for p in of(0)))


def release_other_stages(board: BoardStage, model: torch.nn.Module) -> None:
    """Free this board's copy of every other stage's weights (each becomes an empty tensor), so that a board holds
    only its stage, as the coordinator's welcome does (``PipedRun.stage_welcome``): what lets a model larger than
    any one board train. Those layers never run here (the links carry their activations), and without a gradient
    the optimizer leaves them."""
    mine = {id(p) for p in board.staged.params[board.stage]}
    others = {id(p) for k, params in enumerate(board.staged.params) if k != board.stage for p in params} - mine
    board.released = {name for name, p in model.named_parameters() if id(p) in others}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in others:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    log.info("pipeline: holds stage %d's weights only (%d other tensors released)", board.stage, len(board.released))


def load_stage_weights(board: BoardStage, model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load the welcome's weights, which are this board's stage's (and any no stage holds).

    Raises:
        EdgeTrainError: a weight of this board's stage is missing, or the welcome names one the module lacks.
    """
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    own = names - board.released
    missing, unknown = sorted(own - state.keys()), sorted(state.keys() - names)
    if missing or unknown:
        raise EdgeTrainError(f"the welcome does not hold stage {board.stage}'s weights as this module names them "
                             f"(missing {missing[:3]}, unknown {unknown[:3]}): is the same model code installed on the "
                             "coordinator and every board?")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def link_stage(board: BoardStage, job: TrainCommand, model: Any, *, board_key_file: str, start: int) -> StageEndpoint:
    """Open this board's stage links and give the module its stage's part, from step ``start``.

    Raises:
        EdgeTrainError: no board key to prove and encrypt with.
        StageFault: a neighbour cannot be reached, refuses this board, or fails TLS.
    """
    if not board_key_file:
        raise EdgeTrainError(f"a pipelined job needs board {job.board_id}'s own key (security.board_key_file): the "
                             "stages' links prove and encrypt with it")
    seed = load_board_key(board_key_file).seed
    spec = board.spec
    peers = [StagePeer(board_id=p.board_id, host=p.host, port=p.port, public_key=p.public_key) for p in spec.stages]
    plan = StageLinkPlan(job_id=job.job_id, stage=board.stage, peers=peers, shapes=[tuple(s) for s in spec.shapes],
                         max_rows=spec.max_rows, micro_batches=spec.micro_batches, tls=bool(job.exchange_tls_sha256),
                         group=spec.group, member=board.member, sizes=tuple(spec.sizes),
                         batch_sizes=tuple(job.batch_sizes[:spec.group]))
    endpoint = StageEndpoint(plan, seed=seed)
    try:
        endpoint.listen(plan.me.host, plan.me.port)
        endpoint.connect(start=start)
        endpoint.wait_connected()
    except (OSError, EdgeTrainError) as exc:
        endpoint.close()
        if isinstance(exc, OSError):
            raise EdgeTrainError(f"cannot listen for the pipeline's links on {plan.me.host}:{plan.me.port} "
                                 f"({exc.strerror or exc}): is the port free on this board?") from None
        raise
    if board.stage == 0:
        FirstStage(board.staged, endpoint, spec.micro_batches, start=start, member=board.member).install(model)
    else:
        StageHost(board.staged, board.stage, endpoint, start=start).install(model)
    log.info("pipeline: stage %d of %d linked (%d micro-batches a step)", board.stage, spec.stage_count,
             spec.micro_batches)
    return endpoint


def stage_host_loader(position: LoopPosition) -> DataLoader[Any]:
    """A later stage's batches: the step's number, one a batch, in the run's epochs from ``position`` on."""
    per_epoch = position.batches_per_epoch
    sampler = EpochBatchSampler(lambda batch: [batch % per_epoch], position)
    return DataLoader(TensorDataset(torch.arange(per_epoch)), batch_sampler=sampler)


__all__ = ["BoardStage", "link_stage", "load_stage_weights", "release_other_stages", "stage_host_loader", "stage_of"]
