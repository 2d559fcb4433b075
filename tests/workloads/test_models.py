"""The built-in models: shapes, options, no batch-coupled layers, and LeNet-5 actually learning digits."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.datasets import load_digits_dataset
from edgefleet.workloads.models import BUILTIN_MODELS, MLP, ConvMLP, LeNet5, ResNetSmall, count_parameters
from edgefleet.workloads.sharding import GlobalBatchPlan


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Like a small board: one intra-op thread (restored afterwards, it is process-wide).

    Two threads on this 2-core machine made the gradient tests ~15x slower whenever anything
    else was running.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
@pytest.mark.parametrize("input_shape", [(1, 32, 32), (3, 28, 28)])
def test_builtin_maps_a_batch_to_logits(name: str, input_shape: tuple[int, ...]) -> None:
    model = BUILTIN_MODELS[name](input_shape, 7)
    assert model(torch.randn(5, *input_shape)).shape == (5, 7)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_has_no_batchnorm_or_dropout(name: str) -> None:
    # Either would make a split batch's gradient differ from the whole batch's.
    model = BUILTIN_MODELS[name]((1, 32, 32), 10)
    coupled = [m for m in model.modules() if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd))]
    assert coupled == []


def test_lenet5_is_the_classic_architecture() -> None:
    model = LeNet5((1, 32, 32), 10)
    # 156 + 2416 + 48120 + 10164 + 850: conv 6@5x5, conv 16@5x5, fc 400-120, fc 120-84, fc 84-10.
    assert count_parameters(model) == 61706
    assert isinstance(model.net[2], nn.MaxPool2d)
    assert isinstance(LeNet5((1, 32, 32), 10, pool="avg").net[2], nn.AvgPool2d)


def test_lenet5_computes_the_flatten_size_for_other_inputs() -> None:
    assert LeNet5((1, 28, 28), 10).net[7].in_features == 16 * 4 * 4
    with pytest.raises(ConfigError, match="at least 16"):
        LeNet5((1, 8, 8), 10)
    with pytest.raises(ConfigError, match="channels, height, width"):
        LeNet5((784,), 10)


def test_mlp_layers_and_width() -> None:
    model = MLP((1, 8, 8), 10, layers=3, width=64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 64), (64, 64), (64, 64), (64, 10)]
    assert count_parameters(MLP((5,), 3, layers=0)) == 5 * 3 + 3


def test_resnet_small_depth_width_and_groupnorm() -> None:
    model = ResNetSmall((1, 32, 32), 10, depth=3, width=8)
    assert sum(1 for m in model.modules() if type(m).__name__ == "ResidualBlock") == 3
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert not any(isinstance(m, nn.GroupNorm) for m in ResNetSmall((1, 8, 8), 10, norm_groups=0).modules())
    with pytest.raises(ConfigError, match="divide width"):
        ResNetSmall((1, 8, 8), 10, width=6, norm_groups=4)


def test_conv_mlp_has_small_convolutions_and_a_wide_head() -> None:
    model = ConvMLP((1, 32, 32), 10)
    # 416 + 4640 in the convolutions; 512-1024 and 1024-10 after the flatten (net.6).
    assert count_parameters(model.net[:6]) == 5056 and count_parameters(model.net[6:]) == 535562
    assert isinstance(model.net[6], nn.Flatten)
    assert ConvMLP((1, 8, 8), 10, width=4, hidden=64).net[7].in_features == 8 * 4 * 4  # pools fitted to any size
    with pytest.raises(ConfigError, match="channels, height, width"):
        ConvMLP((64,), 10)
    with pytest.raises(ConfigError, match="hidden >= 1"):
        ConvMLP((1, 32, 32), 10, hidden=0)


def test_trainable_only_parameter_count() -> None:
    model = MLP((4,), 2, layers=1, width=3)
    model.net[1].weight.requires_grad_(False)
    assert count_parameters(model) == 4 * 3 + 3 + 3 * 2 + 2
    assert count_parameters(model, trainable_only=True) == 3 + 3 * 2 + 2


def test_training_step_returns_the_mean_cross_entropy() -> None:
    model = MLP((6,), 4)
    inputs, targets = torch.randn(10, 6), torch.randint(4, (10,))
    loss = model.training_step((inputs, targets), 0)
    per_sample = nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    torch.testing.assert_close(loss, per_sample.mean())


def test_optimizer_choice() -> None:
    assert isinstance(MLP((4,), 2).configure_optimizers(), torch.optim.Adam)
    sgd = MLP((4,), 2, optimizer="sgd", lr=0.1, momentum=0.5).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 0.1 and sgd.defaults["momentum"] == 0.5
    with pytest.raises(ConfigError, match="adam, sgd"):
        MLP((4,), 2, optimizer="rmsprop")


def test_lenet5_learns_digits_to_90_percent() -> None:
    """A plain loop, global batch 48, Adam lr 2e-3: the workload the fleet trains by default."""
    train, val = load_digits_dataset("train"), load_digits_dataset("val")
    torch.manual_seed(0)
    model = LeNet5(train.input_shape, train.num_classes, lr=2e-3)
    optimizer = model.configure_optimizers()
    plan = GlobalBatchPlan(len(train), [48], seed=0)
    steps = 4 * plan.steps_per_epoch   # 4 epochs = 116 steps; 90 % is usually reached in ~50
    started = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad()
        model.training_step(train[plan.global_indices(step)], step).backward()
        optimizer.step()
    elapsed = time.perf_counter() - started
    with torch.no_grad():
        accuracy = (model(val.inputs).argmax(dim=1) == val.targets).float().mean().item()
    assert accuracy >= 0.90, f"val accuracy {accuracy:.3f} after {steps} steps ({elapsed:.1f} s)"


def test_conv_mlp_learns_digits_to_90_percent() -> None:
    """bench/scaling.py's conv_mlp workload: global batch 128, the default Adam 2e-3 (95.8 % after epoch 4)."""
    train, val = load_digits_dataset("train"), load_digits_dataset("val")
    torch.manual_seed(0)
    model = ConvMLP(train.input_shape, train.num_classes)
    optimizer = model.configure_optimizers()
    plan = GlobalBatchPlan(len(train), [128], seed=0)
    steps = 4 * plan.steps_per_epoch   # 4 epochs = 44 steps
    for step in range(steps):
        optimizer.zero_grad()
        model.training_step(train[plan.global_indices(step)], step).backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model(val.inputs).argmax(dim=1) == val.targets).float().mean().item()
    assert accuracy >= 0.90, f"val accuracy {accuracy:.3f} after {steps} steps"
