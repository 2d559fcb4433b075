"""Cutting a user's module into S pipeline stages at S-1 layer boundaries (issue 35).

A pipeline trains a model's stages on different boards: stage 0 takes the model's input, each later
stage the one activation the stage before sends, the last returns the model's output. This is the
S-stage form of ``workloads.layer_cut``'s head/tail cut, and it admits a cut only where that module
would: the forward is traced with ``torch.fx`` and split with ``split_module`` (one partition per
stage), the stages share the module's own layers (the same ``Parameter`` objects), and every cut must
pass layer_cut's checks for a head/tail cut at that point (one tensor crosses, not the input, nothing
shared across, parameters after it, no randomness after it; so every stage after the first draws no
random numbers). On top of those:

* the forward takes exactly one tensor (a stage passes one activation on);
* the cuts are named once each, in forward order;
* the tensor crossing cut k is made between cut k-1 and cut k: a value of stage 0 read only by stage 2
  would have to cross two cuts, which a stage-to-stage link cannot carry;
* with more than one micro-batch, no BatchNorm: each micro-batch would be normalised over its own
  samples where ``Trainer.fit`` normalises over the whole batch (per-sample norms are fine).

Anything else is refused (:class:`StageCutRefused`, one line naming the cut or layer and what to do)
before any board starts. A middle stage may hold no parameters; the last must hold one.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Sequence

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from edgefleet.workloads.layer_cut import (
    CutRefused,
    _cut_hint,
    _display_name,
    _node_index,
    _refuse_loose_buffers,
    _why_not,
    trace,
)

log = logging.getLogger(__name__)


class StageCutRefused(CutRefused):
    """The module cannot be cut into stages where asked: the message says why and what to do."""


@dataclasses.dataclass
class StagedModel:
    """A module cut into S stages: ``stages[0](x)`` is the first activation, ``stages[k](a_k)`` the next, and
    ``stages[-1](a)`` the module's output.

    ``cuts``: the S-1 cut names as layer_cut displays them (``net.6``); ``params``: each stage's parameters in
    the module's ``parameters()`` order (each parameter in exactly one stage; one the forward never uses in the
    last, as layer_cut gives unused ones to the tail); ``modules``: each stage's leaf layers (their buffers travel
    with the stage, as ``ModelCut.head_modules``).
    """

    cuts: list[str]
    stages: list[torch.fx.GraphModule]
    params: list[list[nn.Parameter]]
    modules: list[list[nn.Module]]
    _stage_by_param: dict[int, int] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._stage_by_param = {id(p): k for k, params in enumerate(self.params) for p in params}

    def stage_of(self, param: nn.Parameter) -> int:
        """The index of the stage that holds ``param`` (and so steps it).

        Raises:
            ValueError: ``param`` is none of the staged module's parameters.
        """
        try:
            return self._stage_by_param[id(param)]
        except KeyError:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not one of the staged module's: "
                             "pass one of model.parameters()") from None


def cut_stages(model: nn.Module, cuts: Sequence[str], *, micro_batches: int = 1) -> StagedModel:
    """Cut ``model`` after each node in ``cuts`` (a called module's path, ``net.6``, or an fx node's name), into
    ``len(cuts) + 1`` stages, for a pipeline of ``micro_batches`` micro-batches a global batch.

    Raises:
        StageCutRefused: the module or a cut cannot be staged (module doc), naming which and what to do.
    """
    if micro_batches < 1:
        raise StageCutRefused(f"micro_batches = {micro_batches}: a global batch is split into at least 1 micro-batch")
    if micro_batches > 1:
        _refuse_batch_norm(model, micro_batches)
    try:
        graph = trace(model)
    except CutRefused as exc:
        raise StageCutRefused(str(exc)) from None
    nodes = list(graph.graph.nodes)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise StageCutRefused(f"{type(model).__name__}.forward takes {len(inputs)} inputs ({', '.join(inputs)}); a "
                              "pipeline's first stage takes one tensor: wrap the model in a module whose forward takes one")
    indices = _cut_indices(model, graph, nodes, cuts)
    for name, index in zip(cuts, indices):
        why = _why_not(model, nodes, index)
        if why:
            raise StageCutRefused(f"cut {name}: {why}; {_cut_hint(model, graph)}")
    _refuse_values_crossing_two_cuts(nodes, indices)
    part = {node.name: bisect.bisect_left(indices, i) for i, node in enumerate(nodes)}
    split = split_module(graph, model, lambda node: part[node.name])
    stages = [_stage(split, k, nodes, indices) for k in range(len(indices) + 1)]
    modules = [[m for m in stage.modules() if m is not stage and not list(m.children())] for stage in stages]
    try:
        _refuse_loose_buffers(model, [m for layers in modules for m in layers])
    except CutRefused as exc:
        raise StageCutRefused(str(exc)) from None
    staged = StagedModel(cuts=[_display_name(nodes[i]) for i in indices], stages=stages,
                         params=_partition_params(model, stages), modules=modules)
    log.debug("cut %s into %d stages after %s", type(model).__name__, len(stages), ", ".join(staged.cuts))
    return staged


def stage_shapes(staged: StagedModel, sample: torch.Tensor) -> list[tuple[int, ...]]:
    """One sample's shape (no batch dimension) of each stage's output for ``sample`` (a batch of the model's input):
    S entries, the last the model output's. Runs once without gradients in eval mode; every layer's training mode
    and every buffer are as before afterwards.

    Raises:
        StageCutRefused: a stage's output is not one tensor (the value at that cut is not an activation).
    """
    layers = {id(m): m for stage in staged.stages for m in stage.modules()}.values()
    modes = [(m, m.training) for m in layers]
    buffers = {id(b): b for stage in staged.stages for b in stage.buffers()}.values()
    saved = [(b, b.detach().clone()) for b in buffers]
    shapes: list[tuple[int, ...]] = []
    try:
        with torch.no_grad():
            for stage in staged.stages:
                stage.eval()
            value: object = sample
            for k, stage in enumerate(staged.stages):
                value = stage(value)
                if not isinstance(value, torch.Tensor):
                    where = f"cut {staged.cuts[k]}" if k < len(staged.cuts) else "the model's output"
                    raise StageCutRefused(f"the value at {where} is a {type(value).__name__}, not one tensor: a stage "
                                          "sends one activation; cut where a layer's output tensor crosses")
                shapes.append(tuple(value.shape[1:]))
    finally:
        with torch.no_grad():
            for buffer, before in saved:
                buffer.copy_(before)
        for module, training in modes:
            module.training = training
    return shapes


def _cut_indices(model: nn.Module, graph: torch.fx.GraphModule, nodes: list[torch.fx.Node], cuts: Sequence[str]) -> list[int]:
    """The node index of each cut, checked: some given, each a node, each once, in forward order."""
    if not cuts:
        raise StageCutRefused(f"no cuts given: S stages need S-1 cut names; {_cut_hint(model, graph)}")
    indices: list[int] = []
    for name in cuts:
        index = _node_index(nodes, name)
        if index is None:
            raise StageCutRefused(f"cut {name}: {type(model).__name__}.forward calls no layer named {name!r}; "
                                  f"{_cut_hint(model, graph)}")
        if index in indices:
            raise StageCutRefused(f"cut {_display_name(nodes[index])} is given twice: name each cut once")
        indices.append(index)
    if indices != sorted(indices):
        given = ", ".join(_display_name(nodes[i]) for i in indices)
        ordered = ", ".join(_display_name(nodes[i]) for i in sorted(indices))
        raise StageCutRefused(f"cuts {given} are not in forward order: give them as {ordered}")
    return indices


def _refuse_values_crossing_two_cuts(nodes: list[torch.fx.Node], indices: list[int]) -> None:
    """The value crossing each cut must be made in the stage just before it (a link joins neighbouring stages)."""
    position = {node.name: i for i, node in enumerate(nodes)}
    for k, index in enumerate(indices):
        start = indices[k - 1] if k else -1
        for node in nodes[:start + 1]:
            readers = [later for later in node.users if position[later.name] > index]
            if node.op != "placeholder" and readers:
                before, after = _display_name(nodes[start]), _display_name(nodes[index])
                raise StageCutRefused(
                    f"cut {after}: {_display_name(node)}, made at or before cut {before}, is read after cut {after} (by "
                    f"{_display_name(readers[0])}), so it would cross both cuts where a stage sends only its next stage one "
                    f"activation: drop cut {before} or cut {after}")


def _stage(split: torch.fx.GraphModule, k: int, nodes: list[torch.fx.Node], indices: list[int]) -> torch.fx.GraphModule:
    stage = split.get_submodule(f"submod_{k}")
    assert isinstance(stage, torch.fx.GraphModule)
    inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:  # the checks above rule this out; kept so a gap in them cannot train a wrong pipeline
        where = f"ending at cut {_display_name(nodes[indices[k]])}" if k < len(indices) else "after the last cut"
        raise StageCutRefused(f"the stage {where} takes {len(inputs)} inputs; a stage takes one: choose other cuts")
    return stage


def _partition_params(model: nn.Module, stages: list[torch.fx.GraphModule]) -> list[list[nn.Parameter]]:
    """Each parameter in the stage that uses it, in ``model.parameters()`` order; one no stage uses in the last."""
    owner: dict[int, int] = {}
    for k, stage in enumerate(stages):
        for p in stage.parameters():
            owner.setdefault(id(p), k)
    params: list[list[nn.Parameter]] = [[] for _ in stages]
    for p in model.parameters():
        params[owner.get(id(p), len(stages) - 1)].append(p)
    return params


def _refuse_batch_norm(model: nn.Module, micro_batches: int) -> None:
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise StageCutRefused(
                f"layer {path or type(model).__name__} ({type(module).__name__}) normalises over its batch: with "
                f"{micro_batches} micro-batches each would be normalised over its own samples where Trainer.fit "
                "normalises over the whole batch; train it with --micro-batches 1")


__all__ = ["StageCutRefused", "StagedModel", "cut_stages", "stage_shapes"]
