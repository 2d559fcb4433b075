"""Cutting a user's module into a head and a tail at a layer boundary (layer placement).

The head runs data-parallel on the boards; the tail runs once, over the whole global batch, on the
tail host (the coordinator's machine). The user's module is not edited: its ``forward`` is traced
with ``torch.fx`` (the graph splitter torch's own pipelining builds on) and split after one node,
named by the module it calls (``net.6``) or by the node's own name (``add_1``). The head and tail are
``GraphModule`` s that share the module's own layers (the same ``Parameter`` objects), so the
module's optimizer, checkpoints and state dict are the module's as before.

A cut is admissible only when the mathematics of the cut model are those of the uncut one:

* the forward traces (no data-dependent control flow) and returns one tensor;
* exactly one tensor crosses the boundary, and it is not the model's input (the tail may not read the
  input, or any other head value, a second time);
* no layer or parameter is used on both sides (a tied weight would be stepped twice);
* the tail holds parameters and draws no random numbers (a dropout on the tail host would draw one
  mask over the global batch where every board draws its own);
* no module in the model carries forward or backward hooks (they would run on one side only).

Anything else is refused before any board starts (:class:`CutRefused`, naming why and what to do).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.params import BufferSet

log = logging.getLogger(__name__)

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RANDOM_FUNCTIONS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                     "rand", "randn", "rand_like", "randn_like", "randint", "bernoulli", "multinomial", "normal"}


class CutRefused(ConfigError):
    """The module cannot be cut where asked (or anywhere): the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class CutPoint:
    """One admissible cut: after ``name``; what crosses it and what each side holds.

    ``boundary_shape``: one sample's activation at the cut (without the batch dimension).
    """

    name: str
    boundary_shape: tuple[int, ...]
    head_params: int   # parameter elements on the boards
    tail_params: int   # parameter elements on the tail host

    @property
    def boundary_elements(self) -> int:
        """Values per sample that cross the cut (each way: the activation up, its gradient down)."""
        size = 1
        for d in self.boundary_shape:
            size *= d
        return size


@dataclasses.dataclass
class ModelCut:
    """A module cut in two. ``head(x)`` is the boundary activation; ``tail(a)`` the module's output.

    ``head_params`` / ``tail_params``: the module's own parameters on each side, in the module's
    ``parameters()`` order; ``head_modules``: the layers the head calls (their buffers travel with the
    head's gradient, as a board's buffers do in data-parallel training).
    """

    name: str
    head: torch.fx.GraphModule
    tail: torch.fx.GraphModule
    head_params: list[nn.Parameter]
    tail_params: list[nn.Parameter]
    head_modules: list[nn.Module]

    def head_layers(self) -> nn.ModuleList:
        """The head's layers as one module: their buffers (BatchNorm's running statistics) travel with the head's
        gradient, in this order on every board and the replica (``workloads.params.BufferSet``)."""
        return nn.ModuleList(self.head_modules)


def trace(model: nn.Module) -> torch.fx.GraphModule:
    """The module's forward as an fx graph.

    Raises:
        CutRefused: the forward cannot be traced (data-dependent control flow, a call fx cannot follow).
    """
    _refuse_hooks(model)
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError ... for what it cannot follow
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CutRefused(f"{type(model).__name__}.forward cannot be traced to place its layers ({first[:200]}); a "
                         "forward with data-dependent control flow (an if or a loop on a tensor's value) cannot be cut: "
                         "train it with --placement none") from None


def cut_model(model: nn.Module, name: str, *, graph: torch.fx.GraphModule | None = None) -> ModelCut:
    """Cut ``model`` after the node ``name`` (a called module's path, e.g. ``net.6``, or an fx node's name).

    Raises:
        CutRefused: no such node, or the cut is not admissible (see the module's docstring), naming the
            cuts that are where there are any.
    """
    graph = graph if graph is not None else trace(model)
    nodes = list(graph.graph.nodes)
    index = _node_index(nodes, name)
    if index is None:
        raise CutRefused(f"--placement {name}: {type(model).__name__}.forward calls no layer named {name!r}; "
                         f"{_cut_hint(model, graph)}")
    why = _why_not(model, nodes, index)
    if why:
        raise CutRefused(f"--placement {name}: {why}; {_cut_hint(model, graph)}")
    part = {node.name: (0 if i <= index else 1) for i, node in enumerate(nodes)}
    split = split_module(graph, model, lambda node: part[node.name])
    head, tail = split.get_submodule("submod_0"), split.get_submodule("submod_1")
    assert isinstance(head, torch.fx.GraphModule) and isinstance(tail, torch.fx.GraphModule)
    params = list(model.parameters())
    head_ids = {id(p) for p in head.parameters()}
    tail_ids = {id(p) for p in tail.parameters()}
    head_modules = [module for module in head.modules() if module is not head and not list(module.children())]
    _refuse_loose_buffers(model, [*head_modules, *(m for m in tail.modules() if m is not tail and not list(m.children()))])
    return ModelCut(name=_display_name(nodes[index]), head=head, tail=tail,
                    head_params=[p for p in params if id(p) in head_ids],
                    tail_params=[p for p in params if id(p) in tail_ids or id(p) not in head_ids],
                    head_modules=head_modules)


def head_size(optimizer: torch.optim.Optimizer, cut: ModelCut) -> int:
    """A placed job's exchanged vector's length: the head's parameters the optimizer trains, then its layers'
    buffers (``workloads.params.BufferSet``)."""
    head = {id(p) for p in cut.head_params}
    grads: int = sum(p.numel() for group in optimizer.param_groups for p in group["params"] if id(p) in head and p.requires_grad)
    return grads + BufferSet(cut.head_layers()).elements


def cut_points(model: nn.Module, sample: torch.Tensor) -> list[CutPoint]:
    """Every admissible cut of ``model``, in forward order, with its boundary's shape for ``sample``
    (a batch of the model's input; one sample's shape is reported) and each side's parameter count.

    Raises:
        CutRefused: the forward cannot be traced.
    """
    graph = trace(model)
    nodes = list(graph.graph.nodes)
    shapes = _shapes(graph, sample)
    found = []
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "output") or _why_not(model, nodes, i):
            continue
        shape = shapes.get(node.name)
        if shape is None:
            continue
        cut = cut_model(model, _display_name(node), graph=graph)
        found.append(CutPoint(name=cut.name, boundary_shape=shape[1:],
                              head_params=sum(p.numel() for p in cut.head_params),
                              tail_params=sum(p.numel() for p in cut.tail_params)))
    return found


def _shapes(graph: torch.fx.GraphModule, sample: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Each node's output shape for ``sample`` (tensors only), by running the graph once without gradients."""
    shapes: dict[str, tuple[int, ...]] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                shapes[n.name] = tuple(value.shape)
            return value

    was_training = graph.training
    try:
        with torch.no_grad():
            graph.eval()  # no running statistics moved by a dry run
            _Recorder(graph).run(sample)
    finally:
        graph.train(was_training)
    return shapes


def _node_index(nodes: list[torch.fx.Node], name: str) -> int | None:
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "output"):
            continue
        if name in (node.name, _display_name(node)):
            return i
    return None


def _display_name(node: torch.fx.Node) -> str:
    """A call_module node by the module's path (``net.6``), any other by its fx name (``add_1``)."""
    return str(node.target) if node.op == "call_module" else node.name


def _why_not(model: nn.Module, nodes: list[torch.fx.Node], index: int) -> str:
    """Why a cut after ``nodes[index]`` is not admissible ("": it is)."""
    head = nodes[:index + 1]
    head_names = {n.name for n in head}
    crossing = {n.name for later in nodes[index + 1:] for n in later.all_input_nodes if n.name in head_names}
    output = nodes[-1]
    if output.op != "output" or len(output.all_input_nodes) != 1 or isinstance(output.args[0], (tuple, list, dict)):
        return "the forward must return one tensor to be cut"
    if any(n.op == "placeholder" for n in head if n.name in crossing):
        return "the layers after it read the model's input again (or it is the input itself)"
    if len(crossing) != 1:
        return (f"{len(crossing)} values cross the cut ({', '.join(sorted(crossing))}): a cut must be crossed by "
                "exactly one tensor (the boards send one activation per sample)")
    head_owned, tail_owned = _owned(model, head), _owned(model, nodes[index + 1:])
    shared = head_owned & tail_owned
    if shared:
        return "a layer or parameter is used on both sides of the cut (a tied weight would be stepped twice)"
    tail_modules = [model.get_submodule(str(n.target)) for n in nodes[index + 1:] if n.op == "call_module"]
    if not any(p.requires_grad for m in tail_modules for p in m.parameters()) and not _tail_attrs(model, nodes[index + 1:]):
        return "nothing after it holds a trainable parameter (the tail host would have nothing to train)"
    randomness = _random_in(nodes[index + 1:], tail_modules)
    if randomness:
        return (f"the layers after it draw random numbers ({randomness}): on the tail host one draw would cover the "
                "whole global batch where each board draws its own; cut after it")
    return ""


def _owned(model: nn.Module, nodes: Iterable[torch.fx.Node]) -> set[int]:
    """The ids of the parameters and modules ``nodes`` use."""
    owned: set[int] = set()
    for node in nodes:
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            owned.add(id(module))
            owned.update(id(p) for p in module.parameters())
        elif node.op == "get_attr":
            owned.add(id(_attr(model, str(node.target))))
    return owned


def _tail_attrs(model: nn.Module, nodes: Iterable[torch.fx.Node]) -> bool:
    return any(node.op == "get_attr" and isinstance(_attr(model, str(node.target)), nn.Parameter) for node in nodes)


def _attr(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _random_in(nodes: Iterable[torch.fx.Node], modules: list[nn.Module]) -> str:
    for module in modules:
        if isinstance(module, _RANDOM_MODULES):
            return type(module).__name__
    for node in nodes:
        if node.op in ("call_function", "call_method"):
            name = getattr(node.target, "__name__", str(node.target))
            if name in _RANDOM_FUNCTIONS:
                return name
    return ""


def _refuse_loose_buffers(model: nn.Module, layers: list[nn.Module]) -> None:
    """Every buffer must belong to a layer the forward calls: the head's travel with its gradient, the tail's stay
    on the tail host; one elsewhere (on the module itself, on a container) would be kept by neither."""
    held = {id(b) for layer in layers for b in layer.buffers()}
    loose = [name for name, buffer in model.named_buffers() if id(buffer) not in held]
    if loose:
        raise CutRefused(f"buffer {loose[0]} of {type(model).__name__} is not on a layer its forward calls, so neither "
                         "side of a cut would keep it: move it onto a layer, or train with --placement none")


def _refuse_hooks(model: nn.Module) -> None:
    for path, module in model.named_modules():
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None)):
            where = path or type(model).__name__
            raise CutRefused(f"layer {where} carries a forward or backward hook, which needs the whole model in one "
                             "place: remove the hook or train with --placement none")


def _cut_hint(model: nn.Module, graph: torch.fx.GraphModule) -> str:
    nodes = list(graph.graph.nodes)
    admissible = [_display_name(n) for i, n in enumerate(nodes)
                  if n.op not in ("placeholder", "output") and not _why_not(model, nodes, i)]
    if not admissible:
        return f"{type(model).__name__} has no admissible cut: train it with --placement none"
    return f"cuts {type(model).__name__} admits: {', '.join(admissible)} (edge-coordinator plan lists their sizes)"


__all__ = ["CutPoint", "CutRefused", "ModelCut", "cut_model", "cut_points", "head_size", "trace"]
