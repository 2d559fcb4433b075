"""A module that keeps state outside its ``state_dict`` through Lightning's checkpoint hooks, as users write them."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class WarmupCounterNet(pl.LightningModule):
    """Counts its optimizer steps in a plain attribute, kept by ``on_save_checkpoint``/``on_load_checkpoint``,
    and warms its gradient up with it: a resumed run that lost the count would train differently."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.updates = 0  # not a buffer: only the checkpoint hooks keep it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        scale = min(1.0, (self.updates + 1) / 10)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.updates += 1

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["updates"] = self.updates

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.updates = checkpoint["updates"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
