"""A user's own model and datasets, loaded by import path (``tests.workloads.user_plugins:Name``)."""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class TinyModel(pl.LightningModule):
    """The smallest model the registry accepts: (input_shape, num_classes, **options)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, lr: float = 0.01, hidden: int = 8) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class NotAModel(nn.Module):
    """A plain torch module: the registry must refuse it as a model."""


def make_blobs(n: int = 50, classes: int = 3) -> list[tuple[np.ndarray, int]]:
    """A factory without ``split``: a plain list of (float64 numpy array, int) pairs, no attributes."""
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(2, 3)) + i % classes, i % classes) for i in range(n)]


class SplitBlobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset class that takes ``split`` and declares its attributes."""

    input_shape = (4,)
    num_classes = 5

    def __init__(self, split: str = "train", n: int = 20) -> None:
        self.offset = 0 if split == "train" else 1000
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(self.offset + index)), torch.tensor(index % 5)


NOT_CALLABLE = 42
