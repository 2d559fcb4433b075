"""A module with a Lightning-shaped training_step and no torchmetrics anywhere, built from torch alone.

Both Lightning packages import torchmetrics themselves, so the check that auditing does not
import it runs on a torch-only module: the audit needs only ``named_modules`` and the class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainAccuracy(nn.Module):
    """Accuracy as a plain tensor in training_step: what the fleet averages over the boards' samples."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.logged: dict[str, torch.Tensor] = {}

    def log(self, name: str, value: torch.Tensor) -> None:
        self.logged[name] = value

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.log("train_acc", (logits.argmax(dim=1) == y).float().mean())
        return F.cross_entropy(logits, y)
