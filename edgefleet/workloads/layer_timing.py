"""Per-unit forward and backward times and bytes of a model, measured where its layers would run (issue 35).

The pipeline planner cuts a model only where layer placement can (``workloads.layer_cut``), so its
"layers" are the model's **units**: the runs of layers between two admissible cuts, the last one
ending at the model's output. :func:`pipeline_units` splits the traced forward at every admissible
cut (``torch.fx``'s ``split_module``, the layers shared with the model), and :func:`time_units`
times each unit on its own, as a pipeline stage would run it:

* its input is the previous unit's output, detached and requiring a gradient (a stage receives an
  activation and sends its gradient back; the first unit's input needs none);
* forward, then backward from a fixed output gradient, under the job's autocast, on the board's
  device (synchronised on a GPU), with this process's torch threads; one warm-up call, then the
  median of ``repeats`` at each of two batch sizes, a line ``a + b * n`` through the two;
* the bytes: its parameters, its output per sample, and what its forward saves for its backward per
  sample (the saved tensors' storages, counted once each, its parameters left out), from the growth
  between the two batch sizes, so a tensor kept whatever the batch (a cast weight) is not counted.
  A unit that saves its input counts it, so two units of one stage both holding one tensor count it
  twice: memory errs on the high side, as the planner's other figures do.

A unit's times exclude the loss, the optimizer step and Lightning's loop: those are in the board's
whole-step line, which the planner keeps for a board's speed. LeNet-5's twelve units at batch sizes
4 and 8 take about 0.1 s on one core.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from edgefleet.protocol.profile_report import UnitReport
from edgefleet.workloads.layer_cut import CutRefused, cut_points, trace

log = logging.getLogger(__name__)

UNIT_REPEATS = 5   # timed calls per unit and batch size (their median), after one warm-up call

Sample = Callable[[int], torch.Tensor]  # n -> a batch of n of the model's inputs


def pipeline_units(model: nn.Module, sample: torch.Tensor) -> list[tuple[str, torch.fx.GraphModule]]:
    """The model's units in forward order, each named by its last layer, as modules of one input.

    Raises:
        CutRefused: the forward cannot be traced, admits no cut, or a unit would take more than one input.
    """
    graph = trace(model)
    points = cut_points(model, sample)
    if not points:
        raise CutRefused(f"{type(model).__name__} admits no cut, so it has no pipeline units")
    nodes = [n for n in graph.graph.nodes]
    names = [_display_name(n) for n in nodes]
    cuts = sorted(names.index(p.name) for p in points)
    part = {node.name: bisect.bisect_left(cuts, i) for i, node in enumerate(nodes)}
    split = split_module(graph, model, lambda node: part[node.name])
    last = max(i for i, n in enumerate(nodes) if n.op not in ("placeholder", "output"))
    units = []
    for k, end in enumerate([*cuts, last]):
        unit = split.get_submodule(f"submod_{k}")
        assert isinstance(unit, torch.fx.GraphModule)
        inputs = [n for n in unit.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise CutRefused(f"the unit ending at {names[end]} takes {len(inputs)} inputs; a unit takes one")
        units.append((names[end], unit))
    return units


def time_units(model: nn.Module, sample: Sample, batch_sizes: tuple[int, int], *, device: torch.device | None = None,
               precision: str = "32-true", repeats: int = UNIT_REPEATS) -> tuple[UnitReport, ...]:
    """Every unit of ``model`` timed at the two ``batch_sizes`` (module doc); ``model`` is left in training mode with
    no gradients, its running statistics moved by the calls (time a copy).

    Raises:
        CutRefused: the model has no units (:func:`pipeline_units`).
    """
    small, large = sorted(batch_sizes)
    if not 0 < small < large:
        raise ValueError(f"batch sizes {batch_sizes}: need two distinct sizes >= 1")
    device = device or torch.device("cpu")
    model.to(device).train()
    units = pipeline_units(model, sample(2).to(device))
    measured = [_time_at(units, sample(n).to(device), precision, repeats) for n in (small, large)]
    model.zero_grad(set_to_none=True)
    reports = []
    for (name, unit), lo, hi in zip(units, *measured):
        forward, backward = _line(lo.forward_s, hi.forward_s, small, large), _line(lo.backward_s, hi.backward_s, small, large)
        reports.append(UnitReport(
            name=name, forward_intercept_s=forward[0], forward_s_per_sample=forward[1],
            backward_intercept_s=backward[0], backward_s_per_sample=backward[1],
            param_bytes=sum(p.numel() * p.element_size() for p in unit.parameters()),
            activation_bytes_per_sample=_per_sample(lo.output_bytes, hi.output_bytes, small, large),
            held_bytes_per_sample=_per_sample(lo.held_bytes, hi.held_bytes, small, large)))
    return tuple(reports)


def input_sampler(train: Any, collate_fn: Callable[[list[Any]], Any]) -> Sample:
    """``n`` -> the input of a batch of the first ``n`` samples (repeated past the end), as the model's forward takes it.

    Raises (when called):
        CutRefused: the batch's input is not one tensor (a dict, say): such a model is not cut here.
    """
    def sample(n: int) -> torch.Tensor:
        batch = collate_fn([train[i % len(train)] for i in range(n)])
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not isinstance(inputs, torch.Tensor):
            raise CutRefused(f"a batch's input is a {type(inputs).__name__}, not one tensor: its units are not timed")
        return inputs
    return sample


@dataclass(frozen=True, slots=True)
class _UnitFigures:
    """One unit's figures at one batch size."""

    forward_s: float
    backward_s: float
    output_bytes: int
    held_bytes: int


def _time_at(units: list[tuple[str, torch.fx.GraphModule]], x: torch.Tensor, precision: str,
             repeats: int) -> list[_UnitFigures]:
    measured = []
    device = x.device

    def sync() -> None:  # a GPU runs ahead of Python: a call ends when its kernels do
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for k, (_, unit) in enumerate(units):
        inputs = x.detach().requires_grad_(k > 0 and x.is_floating_point())
        with _autocast(x.device, precision), _SavedBytes(unit) as saved:
            out = unit(inputs)
        grad = torch.ones_like(out) if out.requires_grad else None
        if grad is not None:  # the warm-up's backward: the first call allocates and starts torch's threads
            out.backward(grad)
        forwards, backwards = [], []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            with _autocast(x.device, precision):
                timed = unit(inputs)
            sync()
            between = time.perf_counter()
            if grad is not None:
                timed.backward(grad)
                sync()
            forwards.append(between - started)
            backwards.append(time.perf_counter() - between)
        measured.append(_UnitFigures(statistics.median(forwards), statistics.median(backwards),
                                     out.numel() * out.element_size(), saved.nbytes))
        x = out.detach()
    return measured


class _SavedBytes:
    """The bytes autograd saves for backward while it is open: each storage once, the unit's parameters left out."""

    def __init__(self, unit: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in unit.parameters()}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage: its own elements
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self.params:
            self.storages[key] = size
        return tensor

    def __enter__(self) -> _SavedBytes:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast Lightning runs a step under at ``precision`` (none at full precision)."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _line(lo: float, hi: float, small: int, large: int) -> tuple[float, float]:
    """``(a, b)`` of ``a + b * n`` through the two sizes, both >= 0 (noise at close sizes can tilt a short unit's)."""
    slope = max((hi - lo) / (large - small), 0.0)
    return max(lo - slope * small, 0.0), slope


def _per_sample(lo: int, hi: int, small: int, large: int) -> int:
    return max(round((hi - lo) / (large - small)), 0)


def _display_name(node: torch.fx.Node) -> str:
    """As ``workloads.layer_cut`` names a cut: a called module by its path, any other node by its fx name."""
    return str(node.target) if node.op == "call_module" else node.name


__all__ = ["UNIT_REPEATS", "Sample", "input_sampler", "pipeline_units", "time_units"]
