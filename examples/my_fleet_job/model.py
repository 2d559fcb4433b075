"""Your own LightningModule, used unchanged by edgefleet.

edgefleet builds it as ``TinyNet(input_shape, num_classes, **model_options)``, on every board and
on the coordinator (whose replica writes checkpoints and measures validation accuracy with
``forward``). Keep it free of BatchNorm if you want a split batch to give exactly the gradient of
the whole batch (GroupNorm/LayerNorm are per-sample and fine).
"""

from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class TinyNet(pl.LightningModule):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)  # the mean over the board's batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
