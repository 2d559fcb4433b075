"""Per-unit timing on the board (issue 35): LeNet-5's pipeline units, their bytes counted by hand, their times
against the whole model's forward and backward, the cost, and a model that cannot be cut skipped with a note."""

from __future__ import annotations

import io
import json
import statistics
import time
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from edgefleet.agent.job_runner import WorkerContext
from edgefleet.agent.profile_worker import run_profile
from edgefleet.agent.worker_events import EventWriter
from edgefleet.protocol.jobs import ProfileCommand
from edgefleet.protocol.profile_report import ProfileReport
from edgefleet.workloads.layer_cut import CutRefused
from edgefleet.workloads.layer_timing import input_sampler, pipeline_units, time_units
from edgefleet.workloads.registry import build_model
from edgefleet.workloads.training_data import load_training_data

FLOAT, LONG = 4, 8
# LeNet-5 on 1x32x32 digits: each unit's (parameters, output a sample, saved for backward a sample), in bytes
LENET_UNITS = {
    "net.0": ((6 * 25 + 6) * FLOAT, 6 * 28 * 28 * FLOAT, 32 * 32 * FLOAT),      # conv: saves its input
    "net.1": (0, 6 * 28 * 28 * FLOAT, 6 * 28 * 28 * FLOAT),                    # ReLU: saves its output
    "net.2": (0, 6 * 14 * 14 * FLOAT, 6 * 28 * 28 * FLOAT + 6 * 14 * 14 * LONG),  # max pool: input and indices
    "net.3": ((16 * 6 * 25 + 16) * FLOAT, 16 * 10 * 10 * FLOAT, 6 * 14 * 14 * FLOAT),
    "net.4": (0, 16 * 10 * 10 * FLOAT, 16 * 10 * 10 * FLOAT),
    "net.5": (0, 400 * FLOAT, 16 * 10 * 10 * FLOAT + 400 * LONG),
    "net.6": (0, 400 * FLOAT, 0),                                              # flatten: a view, saves nothing
    "net.7": ((400 * 120 + 120) * FLOAT, 120 * FLOAT, 400 * FLOAT),            # linear: its input (weight left out)
    "net.8": (0, 120 * FLOAT, 120 * FLOAT),
    "net.9": ((120 * 84 + 84) * FLOAT, 84 * FLOAT, 120 * FLOAT),
    "net.10": (0, 84 * FLOAT, 84 * FLOAT),
    "net.11": ((84 * 10 + 10) * FLOAT, 10 * FLOAT, 84 * FLOAT),
}


def _lenet() -> tuple[nn.Module, Any]:
    data = load_training_data(dataset="digits", cached=True, with_val=False)
    torch.manual_seed(0)
    return build_model("lenet5", {}, data=data.train), input_sampler(data.train, data.collate_fn)


def _median_s(call: Any, repeats: int = 7) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def test_lenet5_units_are_the_runs_between_its_cuts_with_their_bytes_exact() -> None:
    model, sample = _lenet()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        units = time_units(model, sample, (4, 8))
        spent = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)

    assert [u.name for u in units] == list(LENET_UNITS)
    assert {u.name: (u.param_bytes, u.activation_bytes_per_sample, u.held_bytes_per_sample) for u in units} == LENET_UNITS
    assert sum(u.param_bytes for u in units) == FLOAT * sum(p.numel() for p in model.parameters())
    assert all(u.forward_s_per_sample >= 0 and u.backward_intercept_s >= 0 for u in units)
    assert sum(u.forward_s_per_sample for u in units) > 0 and sum(u.backward_s_per_sample for u in units) > 0
    assert spent < 5.0  # about 0.1 s on one core; the margin is for a busy host
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_the_units_add_up_to_about_the_whole_models_forward_and_backward() -> None:
    model, sample = _lenet()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        units = time_units(model, sample, (8, 32))
        x = sample(32)

        def whole() -> None:
            out = model(x)
            out.backward(torch.ones_like(out))

        whole_s = _median_s(whole)
    finally:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
    units_s = sum(u.forward_intercept_s + u.backward_intercept_s + 32 * (u.forward_s_per_sample + u.backward_s_per_sample)
                  for u in units)
    # each unit pays its own call and a detached input's gradient: near the whole, not equal (a loose factor)
    assert whole_s / 4 < units_s < whole_s * 4, (units_s, whole_s)


def test_a_unit_is_a_module_of_one_input_sharing_the_models_layers() -> None:
    model, sample = _lenet()
    units = pipeline_units(model, sample(2))
    x = sample(3)
    for _, unit in units:
        x = unit(x)
    assert torch.equal(x, model(sample(3)))
    assert {id(p) for _, u in units for p in u.parameters()} == {id(p) for p in model.parameters()}


class UncutNet(pl.LightningModule):
    """A forward with data-dependent control flow: fx cannot trace it, so it has no pipeline units."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.first = nn.Linear(int(torch.tensor(input_shape).prod()), 16)
        self.second = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x.flatten(1))
        if hidden.sum() > 0:
            hidden = hidden.relu()
        out: torch.Tensor = self.second(hidden)
        return out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Events(EventWriter):
    """The worker's own event writer, into memory: the lines the agent would read."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        super().__init__(self.buffer)

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines()]


def test_a_model_that_cannot_be_cut_is_profiled_without_units_and_says_why() -> None:
    model = UncutNet((1, 32, 32), 10)
    data = load_training_data(dataset="digits", cached=True, with_val=False)
    with pytest.raises(CutRefused, match="cannot be traced"):
        time_units(model, input_sampler(data.train, data.collate_fn), (2, 4))

    events = _Events()
    job = ProfileCommand(job_id="p-0", board_id="b1", model=f"{__name__}:UncutNet", dataset="digits", batch_sizes=[2, 4],
                         warmup_steps=1, timed_steps=2, threads=1, probe_host="127.0.0.1", probe_port=9,
                         probe_token="s" * 32, probe_bytes=0)
    assert run_profile(job, events, WorkerContext(power_source="estimated", idle_w=2.0, max_w=5.0)) == 0
    notes = [e["message"] for e in events.lines if e["phase"] == "progress"]
    assert any(n.startswith("per-layer timing skipped: UncutNet.forward cannot be traced") for n in notes), notes
    report = ProfileReport.from_wire(events.lines[-1]["data"])
    assert report.units == () and "units" not in events.lines[-1]["data"] and len(report.points) == 2


def test_under_bf16_autocast_the_activations_are_half_as_large_and_the_parameters_stay_fp32() -> None:
    model, sample = _lenet()
    units = time_units(model, sample, (2, 4), precision="bf16-mixed", repeats=1)
    assert {u.name: (u.param_bytes, u.activation_bytes_per_sample) for u in units} == {
        name: (params, output // 2) for name, (params, output, _) in LENET_UNITS.items()}
