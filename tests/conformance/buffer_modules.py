"""Modules whose integer buffers matter: the fleet must keep them as DDP does (rank 0's, every step).

``BatchNorm1d(momentum=None)`` keeps a cumulative moving average, dividing by its
``num_batches_tracked``; ``seen`` is a user's own integer counter, advanced in ``training_step``.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class CountingBatchNormNet(pl.LightningModule):
    """BatchNorm with a cumulative average (``momentum=None``) and a counter of the samples seen, ``count_by`` each
    (1000: past what float16 and bfloat16 hold exactly)."""

    def __init__(self, lr: float = 0.1, count_by: int = 1) -> None:
        super().__init__()
        self.lr = lr
        self.count_by = count_by
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 3))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen += x.shape[0] * self.count_by
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
