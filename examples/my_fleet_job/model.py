"""Your own LightningModule, written as Lightning's documentation writes one, used unchanged.

edgefleet builds it with its own constructor (``--model-options hidden=32,lr=0.05`` are its keyword
arguments), on every board and on the coordinator. The boards run ``training_step``; the
coordinator's replica takes every step the boards take (optimizer, StepLR) and runs
``validation_step`` at the end of each epoch, so what it logs there reaches the progress line,
``result.json`` and ``--logger csv|tensorboard``.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn


class LitClassifier(L.LightningModule):
    def __init__(self, features: int = 16, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return [optimizer], [scheduler]
