"""Cutting a module into a head and a tail (workloads.layer_cut): where a cut is admissible, and the
refusals for what cannot be cut, each naming why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgefleet.workloads.layer_cut import CutRefused, cut_model, cut_points, head_size
from edgefleet.workloads.models import ConvMLP, LeNet5


def _lenet() -> LeNet5:
    torch.manual_seed(0)
    return LeNet5((1, 32, 32), 10)


def test_lenet5_cut_after_its_convolutions_sends_400_values_a_sample_and_keeps_the_dense_layers_on_the_host() -> None:
    model = _lenet()
    points = {p.name: p for p in cut_points(model, torch.zeros(2, 1, 32, 32))}
    assert points["net.6"].boundary_shape == (400,) and points["net.5"].boundary_shape == (16, 5, 5)
    assert points["net.6"].head_params == 2572 and points["net.6"].tail_params == 59134
    assert "net.11" not in points  # nothing would be left for the tail host to train
    x = torch.randn(4, 1, 32, 32)
    cut = cut_model(model, "net.6")
    assert torch.equal(cut.tail(cut.head(x)), model(x))
    assert {id(p) for p in cut.head_params} == {id(p) for p in model.net[:6].parameters()}  # the module's own
    assert head_size(torch.optim.SGD(model.parameters(), lr=0.1), cut) == 2572


def test_conv_mlp_cut_at_its_flatten_leaves_the_boards_under_5_percent_of_the_parameters() -> None:
    # bench/placement.py's model with a large dense layer: placed at net.6, a board exchanges the convolutions'
    # gradient and 512 values a sample instead of the whole model's gradient.
    torch.manual_seed(0)
    model = ConvMLP((1, 32, 32), 10)
    points = {p.name: p for p in cut_points(model, torch.zeros(2, 1, 32, 32))}
    flatten = points["net.6"]
    assert flatten.boundary_shape == (512,)
    assert (flatten.head_params, flatten.tail_params) == (5056, 535562)
    assert flatten.head_params < 0.05 * (flatten.head_params + flatten.tail_params)
    x = torch.randn(4, 1, 32, 32)
    cut = cut_model(model, "net.6")
    assert torch.equal(cut.tail(cut.head(x)), model(x))
    assert head_size(torch.optim.Adam(model.parameters()), cut) == 5056


def test_an_unknown_cut_is_refused_listing_the_admissible_ones() -> None:
    with pytest.raises(CutRefused, match=r"no layer named 'net\.99'.*net\.6"):
        cut_model(_lenet(), "net.99")


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h)  # h crosses a cut after b


class _ReadsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + x)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow
            h = -h
        return self.b(h)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)))


@pytest.mark.parametrize(("model", "cut", "why"), [
    (_Skip(), "b", "2 values cross the cut"),
    (_ReadsInput(), "a", "read the model's input again"),
    (_Branchy(), "a", "cannot be traced"),
    (_Tied(), "a", "used on both sides"),
    (_Dropout(), "a", "draw random numbers"),
])
def test_a_cut_that_would_change_the_mathematics_is_refused_naming_why(model: nn.Module, cut: str, why: str) -> None:
    with pytest.raises(CutRefused, match=why):
        cut_model(model, cut)


def test_a_module_with_a_hook_is_refused() -> None:
    model = _lenet()
    model.net[7].register_forward_hook(lambda *args: None)
    with pytest.raises(CutRefused, match="net.7 carries a forward or backward hook"):
        cut_model(model, "net.6")


class _LooseBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scale)


def test_a_buffer_on_no_layer_is_refused_and_a_layers_buffers_are_the_heads() -> None:
    with pytest.raises(CutRefused, match="buffer scale of _LooseBuffer is not on a layer"):
        cut_model(_LooseBuffer(), "a")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    cut = cut_model(model, "1")
    assert [id(b) for b in cut.head_layers().buffers()] == [id(b) for b in model[1].buffers()]
