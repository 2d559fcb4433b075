"""Per-cut profiles for layer placement, measured on the coordinator (the tail host): what each admissible
cut of a model would put on the boards, on the links and on the coordinator.

For every cut ``workloads.layer_cut`` admits, :func:`profile_cuts` measures, on this machine:

* the head's share of a sample's forward and backward compute: the floating-point operations of
  the head's forward and backward against the whole model's (``torch.utils.flop_counter``: matrix
  products and convolutions, which are the compute of a layer that matters); counted, not timed, so
  a busy coordinator cannot skew it (a model whose layers count no operation falls back to the
  ratio of times at one torch thread). The boards' own profiles (``edge-coordinator profile``) give
  each board's whole-model line, and the planner scales its per-sample part by this share
  (``planning.modes.placed``): the same share on every board's CPU, the planner's one approximation
  here;
* the tail's forward and backward over a global batch, the coordinator's serial part of a step, as
  a line ``a + c * N`` fitted at two global batch sizes with this process's threads;
* the bytes: the head's parameters, a sample's activation and output.

Each timing is the least of :data:`REPEATS` means over calls lasting :data:`MEASURE_S` (the
least-disturbed on a busy host). Profiling LeNet-5's eleven cuts takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgefleet.coordinator.planning.cut_profile import CutProfile
from edgefleet.coordinator.planning.modes import TrainingMode
from edgefleet.coordinator.planning.profiles import FleetProfile
from edgefleet.protocol.errors import PlanError
from edgefleet.workloads.layer_cut import CutRefused, cut_model, cut_points
from edgefleet.workloads.training_data import load_training_data

log = logging.getLogger(__name__)

REPEATS = 3
MIN_SHARE = 0.01            # a head's share below this is timing noise
MEASURE_S = 0.01             # a timing lasts at least this long (several calls of a fast layer)
BOARD_BATCHES = (8, 64)      # the share's two batch sizes (a board's slice)
HOST_BATCHES = (32, 256)     # the tail line's two global batch sizes


def profile_cuts(model: torch.nn.Module, sample: Callable[[int], torch.Tensor]) -> list[CutProfile]:
    """Every admissible cut of ``model`` with its figures; ``sample(n)`` is a batch of n inputs.

    Raises:
        CutRefused: the model cannot be traced (no cut at all).
    """
    points = cut_points(model, sample(2))
    if not points:
        return []
    was_training = model.training
    threads = torch.get_num_threads()
    profiles = []
    try:
        model.train()
        batch = sample(BOARD_BATCHES[0])
        whole_flops = _flops(model, batch)
        whole = whole_flops or _timed_slope(model, sample)
        for point in points:
            cut = cut_model(model, point.name)
            head = _flops(cut.head, batch) if whole_flops else _timed_slope(cut.head, sample)
            tail_a, tail_c = _line(functools.partial(_time_tail_of, cut, sample), HOST_BATCHES)
            output = _output_elements(cut, sample(2))
            profiles.append(CutProfile(name=point.name, boundary_elements=point.boundary_elements,
                                       output_elements=output, head_params=point.head_params,
                                       tail_params=point.tail_params,
                                       head_share=min(1.0, max(head / whole, MIN_SHARE)) if whole > 0 else 1.0,
                                       host_a_s=tail_a, host_c_s=tail_c))
    finally:
        torch.set_num_threads(threads)
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return profiles


def with_cuts(profiles: dict[str, FleetProfile], *, model: str, dataset: str, dataset_options: dict[str, Any],
              on_note: Callable[[str], None], datamodule: str = "",
              datamodule_options: dict[str, Any] | None = None) -> dict[str, FleetProfile]:
    """``profiles`` (by variant label) with each variant's cuts measured here (``FleetProfile.cuts``); a variant
    that admits none keeps none, and ``on_note`` says why. The data is the dataset's or the DataModule's."""
    from edgefleet.workloads.registry import build_model  # Lightning and the models: only when profiling

    data = load_training_data(dataset=dataset, dataset_options=dataset_options, datamodule=datamodule,
                              datamodule_options=datamodule_options or {}, cached=True, with_val=False)

    def sample(n: int) -> torch.Tensor:
        batch = data.collate_fn([data.train[i % len(data.train)] for i in range(n)])
        inputs: torch.Tensor = batch[0] if isinstance(batch, (tuple, list)) else batch
        return inputs

    out = {}
    for label, fleet in profiles.items():
        torch.manual_seed(0)
        built = build_model(model, dict(fleet.variant), data=data.train)
        cuts: list[CutProfile] = []
        try:
            cuts = profile_cuts(built, sample)
        except CutRefused as exc:
            on_note(f"layer placement: {label}: {exc}")
        except Exception as exc:  # the boards' profile stands whatever the model does under fx or the flop counter
            log.debug("profiling the cuts of %s failed", model, exc_info=True)
            on_note(f"layer placement: {label}: its cuts could not be profiled ({type(exc).__name__}: {exc}); "
                    "plan weighs data-parallel only")
        if cuts:
            on_note(f"layer placement: {label}: {len(cuts)} cuts profiled on this machine (the tail host)")
        out[label] = dataclasses.replace(fleet, cuts=tuple(cuts))
    return out


# Boards weighed as the tail's host: every board of a fleet of up to TAIL_BOARDS_ALL; on a larger fleet the
# TAIL_BOARDS fastest by their profiled seconds per sample (a tail wants compute, and each host is another planner mode
# per cut, each searched over the other boards' subsets: 2^15 of them on 16 boards).
TAIL_BOARDS_ALL = 8
TAIL_BOARDS = 3


def cut_modes(fleet: FleetProfile, *, only: str = "") -> tuple[tuple[TrainingMode, ...], str]:
    """The planner's layer placement modes for ``fleet``'s cuts, with why there are none ("" when there are).

    ``only``: "" weighs every cut with the tail on the coordinator and on each board (on a fleet of more than
    :data:`TAIL_BOARDS_ALL`, the :data:`TAIL_BOARDS` fastest); ``CUT`` or ``CUT@coordinator`` that cut on the
    coordinator; ``CUT@BOARD`` that cut on that board.

    Raises:
        PlanError: ``only`` names a cut the profile does not hold (the message lists those it does).
    """
    cuts = list(fleet.cuts)
    if not cuts:
        return (), ("the profile file holds no cut of this model (profiled before layer placement existed, or the "
                    "model admits none): run edge-coordinator profile again to weigh it")
    name, _, host = only.partition("@")
    if name:
        cuts = [c for c in cuts if c.name == name]
        if not cuts:
            raise PlanError(f"--placement {only}: no such cut in the profile; the cuts the model admits: "
                            f"{', '.join(c.name for c in fleet.cuts)}")
    if host and host != "coordinator":
        if host not in fleet.boards:
            raise PlanError(f"--placement {only}: no profile of board {host}; the profiled boards: "
                            f"{', '.join(fleet.boards)}")
        return tuple(c.board_mode(fleet.grad_bytes, fleet.boards[host]) for c in cuts), ""
    modes = [c.mode(fleet.grad_bytes) for c in cuts]
    if not host and len(fleet.boards) > 1:  # and the tail on each of the fastest boards (one head board at least)
        fastest = sorted(fleet.boards.values(), key=lambda b: b.time_fit.slope)
        fastest = fastest if len(fastest) <= TAIL_BOARDS_ALL else fastest[:TAIL_BOARDS]
        modes += [c.board_mode(fleet.grad_bytes, board) for c in cuts for board in fastest]
    return tuple(modes), ""


def _time_backward(module: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """A forward and a backward (of the output's sum) of ``module`` on ``x``: the least of :data:`REPEATS`
    means, each over enough calls to last :data:`MEASURE_S` (a sub-millisecond layer is not timer noise)."""
    module(x).float().sum().backward()  # warm: the first call allocates and starts torch's threads
    calls, best = 1, math.inf
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(calls):
            module(x).float().sum().backward()
        spent = time.perf_counter() - started
        best = min(best, spent / calls)
        if spent < MEASURE_S:  # too short to trust: more calls the next time
            calls = min(calls * max(2, math.ceil(MEASURE_S / max(spent, 1e-6))), 1000)
    return best


def _flops(module: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """Floating-point operations of a forward and a backward of ``module`` on ``x`` (0: none it counts)."""
    with FlopCounterMode(display=False) as counter:
        module(x).float().sum().backward()
    return float(counter.get_total_flops())


def _timed_slope(module: Callable[[torch.Tensor], Any], sample: Callable[[int], torch.Tensor]) -> float:
    """Seconds per sample of ``module``'s forward and backward at one torch thread (a board's usual count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _slope(lambda n: _time_backward(module, sample(n)), BOARD_BATCHES)
    finally:
        torch.set_num_threads(threads)


def _time_tail_of(cut: Any, sample: Callable[[int], torch.Tensor], n: int) -> float:
    return _time_tail(cut, sample(n))


def _time_tail(cut: Any, x: torch.Tensor) -> float:
    with torch.no_grad():
        activation = cut.head(x)
    activation.requires_grad_(True)
    return _time_backward(cut.tail, activation)


def _line(timed: Callable[[int], float], sizes: tuple[int, int]) -> tuple[float, float]:
    """``(a, c)`` of ``timed(n) = a + c * n`` through the two sizes (a >= 0, c >= 0)."""
    lo, hi = (timed(n) for n in sizes)
    c = max((hi - lo) / (sizes[1] - sizes[0]), 0.0)
    return max(lo - c * sizes[0], 0.0), c


def _slope(timed: Callable[[int], float], sizes: tuple[int, int]) -> float:
    return _line(timed, sizes)[1]


def _output_elements(cut: Any, x: torch.Tensor) -> int:
    with torch.no_grad():
        out = cut.tail(cut.head(x))
    return int(out[0].numel()) if out.dim() > 0 else 1


__all__ = ["BOARD_BATCHES", "HOST_BATCHES", "REPEATS", "cut_modes", "profile_cuts", "with_cuts"]
