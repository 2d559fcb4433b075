"""Built-in LightningModules: LeNet-5, an MLP, a small residual CNN and a CNN with a wide dense head.

Every built-in is constructed as ``Cls(input_shape, num_classes, lr=..., optimizer=..., **variant)``.

None of them has BatchNorm or dropout, on purpose: the fleet splits one global batch across boards
and averages the per-board mean gradients weighted by batch size, which equals the whole-batch
gradient only when every sample's loss depends on that sample alone. BatchNorm mixes samples
through the batch statistics and dropout draws a different mask on every board, so either would
break the split invariance. GroupNorm normalises each sample on its own and is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from edgefleet.protocol.errors import ConfigError

OPTIMIZERS = ("adam", "sgd")


class ClassifierModule(pl.LightningModule):
    """Shared training logic for the built-ins: cross-entropy, accuracy and the optimizer choice.

    Subclasses build ``self.net`` (input batch to logits) in ``__init__``.

    Args:
        input_shape: One sample's shape, without the batch dimension, e.g. ``(1, 32, 32)``.
        num_classes: Number of target classes.
        lr: Learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum (ignored by Adam).
    """

    net: nn.Module

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 1e-3,
                 optimizer: str = "adam", momentum: float = 0.9) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer = {optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
        if num_classes < 2:
            raise ConfigError(f"num_classes = {num_classes}: a classifier needs at least 2 classes")
        if not input_shape or any(int(d) < 1 for d in input_shape):
            raise ConfigError(f"input_shape = {tuple(input_shape)} must be non-empty with positive sizes")
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        self.lr = float(lr)
        self.optimizer_name = optimizer
        self.momentum = float(momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits, shape ``(batch, num_classes)``."""
        logits: torch.Tensor = self.net(x)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Return the mean cross-entropy over the batch (the reducer weights it by batch size)."""
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs), targets)
        self._log_if_attached("train_loss", loss, batch_size=len(targets))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Log ``val_loss`` and ``val_acc`` for the batch and return the loss."""
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits, targets)
        accuracy = (logits.argmax(dim=1) == targets).float().mean()
        self._log_if_attached("val_loss", loss, batch_size=len(targets), prog_bar=True)
        self._log_if_attached("val_acc", accuracy, batch_size=len(targets), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam by default, or SGD with momentum when ``optimizer="sgd"``."""
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def _log_if_attached(self, name: str, value: torch.Tensor, **kwargs: Any) -> None:
        # The coordinator's replica and the tests call the step methods without a Trainer; Lightning
        # would warn on every self.log() there, so only log when something will record it.
        try:
            self.trainer  # noqa: B018 - raises RuntimeError when not attached
        except RuntimeError:
            return
        self.log(name, value, **kwargs)


class LeNet5(ClassifierModule):
    """LeNet-5: conv 6@5x5, pool, conv 16@5x5, pool, fc 120, fc 84, fc num_classes, ReLU.

    Designed for 1x32x32 input (16x5x5 features before the classifier); other image sizes and
    channel counts work too, the flatten size is computed from ``input_shape``.

    Args:
        input_shape: ``(channels, height, width)``; height and width at least 16.
        num_classes: Number of target classes.
        lr: Learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum.
        pool: ``"max"`` or ``"avg"`` pooling after each convolution.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 2e-3,
                 optimizer: str = "adam", momentum: float = 0.9, pool: str = "max") -> None:
        super().__init__(input_shape, num_classes, lr=lr, optimizer=optimizer, momentum=momentum)
        if len(self.input_shape) != 3:
            raise ConfigError(f"lenet5 needs (channels, height, width) input, got input_shape = {self.input_shape}")
        if pool not in ("max", "avg"):
            raise ConfigError(f"pool = {pool!r} is not supported; use max or avg")
        self.save_hyperparameters()
        channels, height, width = self.input_shape
        feature_h, feature_w = _lenet_feature_size(height), _lenet_feature_size(width)
        if feature_h < 1 or feature_w < 1:
            raise ConfigError(f"lenet5 input {height}x{width} is too small: height and width must be at least 16")
        pool_layer = nn.MaxPool2d if pool == "max" else nn.AvgPool2d
        self.net = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5), nn.ReLU(), pool_layer(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), pool_layer(2),
            nn.Flatten(),
            nn.Linear(16 * feature_h * feature_w, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, self.num_classes),
        )


def _lenet_feature_size(size: int) -> int:
    """Spatial size after LeNet's two (5x5 valid conv, 2x2 pool) stages."""
    for _ in range(2):
        size = (size - 4) // 2
    return size


class MLP(ClassifierModule):
    """A multilayer perceptron on the flattened input: ``layers`` hidden layers of ``width`` units, ReLU.

    Args:
        input_shape: Any sample shape; it is flattened.
        num_classes: Number of target classes.
        lr: Learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum.
        layers: Number of hidden layers (0 gives logistic regression).
        width: Units per hidden layer.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 1e-3,
                 optimizer: str = "adam", momentum: float = 0.9, layers: int = 2, width: int = 128) -> None:
        super().__init__(input_shape, num_classes, lr=lr, optimizer=optimizer, momentum=momentum)
        if layers < 0 or width < 1:
            raise ConfigError(f"mlp needs layers >= 0 and width >= 1, got layers = {layers}, width = {width}")
        self.save_hyperparameters()
        modules: list[nn.Module] = [nn.Flatten()]
        in_features = math.prod(self.input_shape)
        for _ in range(layers):
            modules += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        modules.append(nn.Linear(in_features, self.num_classes))
        self.net = nn.Sequential(*modules)


class ResidualBlock(nn.Module):
    """``x + conv(relu(norm(conv(relu(norm(x))))))`` (pre-activation), channels unchanged.

    Args:
        channels: Input and output channels.
        norm_groups: GroupNorm groups, or 0 for no normalisation.
        norm: ``"group"`` (GroupNorm, per sample) or ``"batch"`` (BatchNorm2d).
    """

    def __init__(self, channels: int, norm_groups: int, norm: str = "group") -> None:
        super().__init__()
        self.body = nn.Sequential(
            _norm(norm, channels, norm_groups), nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1),
            _norm(norm, channels, norm_groups), nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1),
        )
        # Without BatchNorm the residual branch must start small, or the activations grow with
        # depth; zeroing its last layer makes every block the identity at initialisation.
        last_conv = self.body[-1]
        assert isinstance(last_conv, nn.Conv2d) and last_conv.bias is not None
        nn.init.zeros_(last_conv.weight)
        nn.init.zeros_(last_conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Add the residual branch to the input."""
        out: torch.Tensor = x + self.body(x)
        return out


NORMS = ("group", "batch")


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(groups, channels) if groups else nn.Identity()


class ResNetSmall(ClassifierModule):
    """A small residual CNN: a 3x3 stem conv, ``depth`` residual blocks, global average pool, linear.

    Normalisation is GroupNorm by default, which works per sample, so a split batch gives exactly
    the whole batch's gradient; ``norm="batch"`` uses BatchNorm, trained with DDP's meaning (each
    board normalises with its own slice; the running statistics are the first board's).

    Args:
        input_shape: ``(channels, height, width)``, any size.
        num_classes: Number of target classes.
        lr: Learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum.
        depth: Number of residual blocks.
        width: Channels in every block.
        norm_groups: GroupNorm groups (must divide ``width``); 0 disables normalisation.
        norm: ``"group"`` or ``"batch"``.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 1e-3,
                 optimizer: str = "adam", momentum: float = 0.9, depth: int = 2, width: int = 16,
                 norm_groups: int = 4, norm: str = "group") -> None:
        super().__init__(input_shape, num_classes, lr=lr, optimizer=optimizer, momentum=momentum)
        if len(self.input_shape) != 3:
            raise ConfigError(f"resnet_small needs (channels, height, width) input, got input_shape = {self.input_shape}")
        if depth < 0 or width < 1:
            raise ConfigError(f"resnet_small needs depth >= 0 and width >= 1, got depth = {depth}, width = {width}")
        if norm_groups < 0 or (norm_groups and width % norm_groups):
            raise ConfigError(f"norm_groups = {norm_groups} must be 0 or divide width = {width}")
        if norm not in NORMS:
            raise ConfigError(f"norm = {norm!r} is not one of {', '.join(NORMS)}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(self.input_shape[0], width, kernel_size=3, padding=1),
            *(ResidualBlock(width, norm_groups, norm) for _ in range(depth)),
            _norm(norm, width, norm_groups), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(width, self.num_classes),
        )


class ConvMLP(ClassifierModule):
    """Small convolutions, then a wide fully connected head: the parameters sit almost all after the flatten.

    ``conv width@5x5, ReLU, max pool to 8x8, conv 2*width@3x3, ReLU, max pool to 4x4, flatten (net.6),
    fc hidden, ReLU, fc num_classes``. The convolutions do most of a sample's arithmetic on few parameters
    (5,056 at the defaults) and hand 32*width values a sample to the head, whose
    ``32*width*hidden + hidden*(num_classes+1) + num_classes`` parameters (535,562 at the defaults, 99%
    of the model) make data-parallel's gradient large: the model where layer placement at ``net.6``
    (the flatten) pays most. The pools are adaptive, so any image size works (1x32x32 digits: pools
    of 4 and 2).

    Args:
        input_shape: ``(channels, height, width)``, any size.
        num_classes: Number of target classes.
        lr: Learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum.
        width: Channels of the first convolution (the second has twice as many).
        hidden: Units of the head's hidden layer.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 2e-3,
                 optimizer: str = "adam", momentum: float = 0.9, width: int = 16, hidden: int = 1024) -> None:
        super().__init__(input_shape, num_classes, lr=lr, optimizer=optimizer, momentum=momentum)
        if len(self.input_shape) != 3:
            raise ConfigError(f"conv_mlp needs (channels, height, width) input, got input_shape = {self.input_shape}")
        if width < 1 or hidden < 1:
            raise ConfigError(f"conv_mlp needs width >= 1 and hidden >= 1, got width = {width}, hidden = {hidden}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(self.input_shape[0], width, kernel_size=5, padding=2), nn.ReLU(), nn.AdaptiveMaxPool2d(8),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4),
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, hidden), nn.ReLU(),
            nn.Linear(hidden, self.num_classes),
        )


BUILTIN_MODELS: dict[str, type[ClassifierModule]] = {
    "lenet5": LeNet5,
    "mlp": MLP,
    "resnet_small": ResNetSmall,
    "resnet": ResNetSmall,
    "conv_mlp": ConvMLP,
}


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters in ``model`` (only those with ``requires_grad`` if asked).

    Args:
        model: Any torch module.
        trainable_only: Skip frozen parameters.

    Returns:
        The total element count.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "BUILTIN_MODELS",
    "MLP",
    "OPTIMIZERS",
    "ClassifierModule",
    "ConvMLP",
    "LeNet5",
    "ResNetSmall",
    "ResidualBlock",
    "count_parameters",
]
