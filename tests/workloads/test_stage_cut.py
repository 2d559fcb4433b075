"""Cutting a module into S pipeline stages (workloads.stage_cut): the stages compose to the model, forward and
backward, share its parameters one stage each, and what cannot be staged is refused naming why."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from edgefleet.workloads.layer_cut import CutRefused, cut_points
from edgefleet.workloads.models import ConvMLP, LeNet5
from edgefleet.workloads.stage_cut import StageCutRefused, StagedModel, cut_stages, stage_shapes


def _lenet() -> LeNet5:
    torch.manual_seed(0)
    return LeNet5((1, 32, 32), 10)


def _conv_mlp() -> ConvMLP:
    torch.manual_seed(0)
    return ConvMLP((1, 32, 32), 10, width=4, hidden=32)


def _net(model: nn.Module) -> nn.Sequential:
    net = model.get_submodule("net")
    assert isinstance(net, nn.Sequential)
    return net


def _chain(staged: StagedModel, x: torch.Tensor) -> torch.Tensor:
    for stage in staged.stages:
        x = stage(x)
    return x


def _check_partition(model: nn.Module, staged: StagedModel) -> None:
    params = list(model.parameters())
    flat = [p for stage_params in staged.params for p in stage_params]
    assert [id(p) for p in flat] == [id(p) for p in params]  # each in one stage, stages in order, model order inside
    for k, stage_params in enumerate(staged.params):
        assert {id(p) for p in stage_params} == {id(p) for p in staged.stages[k].parameters()}  # the model's own
        assert all(staged.stage_of(p) == k for p in stage_params)


@pytest.mark.parametrize(("make", "cuts", "params", "layers", "shapes"), [
    (_lenet, ["net.3", "net.6"], [[0, 1, 2, 3], [], [4, 5, 6, 7, 8, 9]], [(0, 4), (4, 7), (7, 12)],
     [(16, 10, 10), (400,), (10,)]),
    (_conv_mlp, ["net.2", "net.7"], [[0, 1], [2, 3, 4, 5], [6, 7]], [(0, 3), (3, 8), (8, 10)], [(4, 8, 8), (32,), (10,)]),
])
def test_three_stages_compose_to_the_model_and_split_its_parameters(
        make: Callable[[], nn.Module], cuts: list[str], params: list[list[int]], layers: list[tuple[int, int]],
        shapes: list[tuple[int, ...]]) -> None:
    model = make()
    admissible = {p.name for p in cut_points(model, torch.zeros(2, 1, 32, 32))}
    assert set(cuts) <= admissible
    staged = cut_stages(model, cuts)
    assert staged.cuts == cuts and len(staged.stages) == 3
    x = torch.randn(4, 1, 32, 32)
    assert torch.equal(_chain(staged, x), model(x))
    _check_partition(model, staged)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert [[index[id(p)] for p in ps] for ps in staged.params] == params
    net = _net(model)
    assert [[id(m) for m in ms] for ms in staged.modules] == [[id(m) for m in list(net)[a:b]] for a, b in layers]
    model.train()
    assert stage_shapes(staged, torch.zeros(2, 1, 32, 32)) == shapes
    assert model.training and all(m.training for m in model.modules())


def test_the_input_and_parameter_gradients_chained_stage_by_stage_are_the_models() -> None:
    model = _lenet()
    staged = cut_stages(model, ["net.2", "net.6", "net.8"])
    torch.manual_seed(1)
    x, grad_out = torch.randn(3, 1, 32, 32), torch.randn(3, 10)

    whole_x = x.clone().requires_grad_(True)
    whole = torch.autograd.grad(model(whole_x), [whole_x, *model.parameters()], grad_out)

    # As a pipeline runs it: each stage's input is the activation received, detached and needing a gradient; the
    # backward runs stage by stage from the last, each sending its input's gradient to the stage before.
    inputs, outputs = [], []
    value = x
    for stage in staged.stages:
        received = value.detach().requires_grad_(True)
        inputs.append(received)
        value = stage(received)
        outputs.append(value)
    grads: dict[int, torch.Tensor] = {}
    grad = grad_out
    for k in reversed(range(len(staged.stages))):
        got = torch.autograd.grad(outputs[k], [inputs[k], *staged.params[k]], grad)
        grad = got[0]
        grads.update({id(p): g for p, g in zip(staged.params[k], got[1:])})
    assert torch.allclose(grad, whole[0], atol=1e-6, rtol=0)
    for p, g in zip(model.parameters(), whole[1:]):
        assert torch.allclose(grads[id(p)], g, atol=1e-6, rtol=0)


def test_a_middle_stage_without_parameters_is_allowed_and_unused_parameters_go_to_the_last_stage() -> None:
    model = _lenet()
    spare = nn.Linear(2, 2)
    model.spare = spare  # never called by forward
    staged = cut_stages(model, ["net.3", "net.4"])  # net.4 is a ReLU: the middle stage holds nothing
    assert staged.params[1] == [] and [type(m).__name__ for m in staged.modules[1]] == ["ReLU"]
    assert staged.stage_of(next(spare.parameters())) == 2 and staged.stage_of(next(_net(model)[3].parameters())) == 0
    _check_partition_unused(model, staged)
    with pytest.raises(ValueError, match="not one of the staged module's"):
        staged.stage_of(nn.Parameter(torch.zeros(1)))


def _check_partition_unused(model: nn.Module, staged: StagedModel) -> None:
    flat = [id(p) for ps in staged.params for p in ps]
    assert sorted(flat) == sorted(id(p) for p in model.parameters()) and len(set(flat)) == len(flat)


def test_stage_shapes_leaves_running_statistics_and_mixed_training_modes_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    model.train()
    model[1].eval()  # a frozen normalisation, as fine-tuning keeps it
    staged = cut_stages(model, ["2", "4"])
    before = [b.clone() for b in model.buffers()]
    assert stage_shapes(staged, torch.randn(5, 4)) == [(8,), (6,), (2,)]
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert [m.training for m in model] == [True, False, True, True, True, True]


class _SkipsAStage(nn.Module):
    """``h`` is made in stage 0 and read in stage 2: stage 1 (``probe``) sends nothing on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.probe, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.probe(h)  # a value nothing reads: each cut alone is admissible, h crosses both
        out: torch.Tensor = self.c(h)
        return out


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x) + y)
        return out


class _DropoutLate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c(self.drop(self.b(self.a(x))))
        return out


def _batch_norm_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8),
                         nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize(("make", "cuts", "micro_batches", "why"), [
    (_lenet, [], 1, r"no cuts given.*cuts LeNet5 admits: net\.0"),
    (_lenet, ["net.3", "net.99"], 1, r"cut net\.99: LeNet5\.forward calls no layer named 'net\.99'; cuts LeNet5 admits: .*net\.6"),
    (_lenet, ["net.3", "net_3"], 1, r"cut net\.3 is given twice"),
    (_lenet, ["net.6", "net.3", "net.8"], 1, r"cuts net\.6, net\.3, net\.8 are not in forward order: give them as net\.3, net\.6, net\.8"),
    (_lenet, ["net.3", "net.11"], 1, r"cut net\.11: nothing after it holds a trainable parameter"),
    (_SkipsAStage, ["a", "probe"], 1, r"cut probe: a, made at or before cut a, is read after cut probe \(by c\).*drop cut a or cut probe"),
    (_TwoInputs, ["a"], 1, r"_TwoInputs\.forward takes 2 inputs \(x, y\)"),
    (_DropoutLate, ["b", "drop"], 1, r"cut b: the layers after it draw random numbers \(Dropout\)"),
    (_batch_norm_model, ["2", "5"], 2, r"layer 1 \(BatchNorm2d\) .* train it with --micro-batches 1"),
    (_lenet, ["net.3"], 0, r"micro_batches = 0"),
])
def test_what_cannot_be_staged_is_refused_in_one_line_naming_why(make: Callable[[], nn.Module], cuts: list[str],
                                                                 micro_batches: int, why: str) -> None:
    with pytest.raises(StageCutRefused, match=why) as refused:
        cut_stages(make(), cuts, micro_batches=micro_batches)
    assert isinstance(refused.value, CutRefused) and "\n" not in str(refused.value)


def test_batch_norm_is_staged_with_one_micro_batch_and_per_sample_norms_with_several() -> None:
    torch.manual_seed(0)
    staged = cut_stages(_batch_norm_model(), ["2", "5"], micro_batches=1)
    assert len(staged.stages) == 3
    per_sample = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8), nn.GroupNorm(2, 8),
                               nn.Linear(8, 2))
    assert len(cut_stages(per_sample, ["2", "4"], micro_batches=4).stages) == 3


def test_hooks_and_loose_buffers_are_refused_as_layer_placement_refuses_them() -> None:
    model = _lenet()
    _net(model)[7].register_forward_hook(lambda *args: None)
    with pytest.raises(StageCutRefused, match=r"net\.7 carries a forward or backward hook"):
        cut_stages(model, ["net.3", "net.6"])
    loose = _lenet()
    loose.register_buffer("scale", torch.ones(1))
    with pytest.raises(StageCutRefused, match="buffer scale of LeNet5 is not on a layer"):
        cut_stages(loose, ["net.3", "net.6"])


class _SendsAShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.a(x).shape  # only the size crosses a cut after it: no activation to send
        out: torch.Tensor = self.c(torch.ones(size))
        return out


def test_a_cut_crossed_by_a_value_that_is_no_tensor_is_refused_when_its_shapes_are_taken() -> None:
    staged = cut_stages(_SendsAShape(), ["getattr_1"])
    with pytest.raises(StageCutRefused, match="the value at cut getattr_1 is a Size, not one tensor"):
        stage_shapes(staged, torch.zeros(3, 4))
