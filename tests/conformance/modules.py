"""Small LightningModules written the way an ordinary user writes them, one per feature.

Each module is tiny (< 20k parameters) and trains in milliseconds on a CPU. Every
``training_step`` returns the *mean* loss over its batch: the fleet weights each
board's mean gradient by its batch size, so a sum reduction would be wrong.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


def _mlp(features: int, hidden: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class OwnCtorNet(pl.LightningModule):
    """Exercises a user constructor ``(lr, hidden)``, ``save_hyperparameters`` and SGD with momentum."""

    def __init__(self, lr: float = 0.1, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _mlp(8, hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class LightningImportNet(L.LightningModule):
    """Exercises a module derived from ``lightning.pytorch.LightningModule`` (the unified package)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EmbeddingNet(pl.LightningModule):
    """Exercises int64 token-id inputs (B, 6) through ``nn.Embedding`` and mean pooling."""

    def __init__(self, vocab: int = 50, dim: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self(ids), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RegressionNet(pl.LightningModule):
    """Exercises float32 targets (non-integer reals) with an MSE loss."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = _mlp(8, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y.reshape(-1).float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DictBatchNet(pl.LightningModule):
    """Exercises batches that are dicts ``{"features": (B, 8) float, "label": (B,) int64}``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["features"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class CollateNet(pl.LightningModule):
    """Exercises a custom collate_fn: batches are ``(x_padded (B, T, 4), y (B,), lengths (B,))``.

    The model averages each sequence over its real (unpadded) steps, then classifies it.
    """

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.step = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1).to(x.dtype)
        pooled = (torch.relu(self.step(x)) * mask).sum(dim=1) / lengths[:, None].to(x.dtype)
        return self.head(pooled)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, lengths = batch
        return F.cross_entropy(self(x, lengths), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _Classifier(pl.LightningModule):
    """Shared body of the optimizer/scheduler variants below: an MLP over 8 features, 3 classes."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class StepSchedulerNet(_Classifier):
    """Exercises a per-step LR scheduler (StepLR every 3 optimizer steps, ``interval="step"``)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class EpochSchedulerNet(_Classifier):
    """Exercises the ``([optimizers], [schedulers])`` form with a per-epoch StepLR."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


class PlateauNet(_Classifier):
    """Exercises ReduceLROnPlateau monitoring ``val_loss`` logged in ``validation_step``."""

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


class AdamNet(_Classifier):
    """Exercises Adam (per-parameter state that must stay in step across boards)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr=lr)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class SgdNet(_Classifier):
    """Exercises plain SGD without momentum (the simplest optimizer state: none)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BatchNormNet(pl.LightningModule):
    """Exercises BatchNorm1d: running statistics are float buffers, and batch statistics
    depend on how a global batch is split across boards."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LoggingNet(pl.LightningModule):
    """The module "as in Lightning's docs": lr in the constructor, ``self.log`` in training,
    a ``validation_step`` logging ``val_loss`` and ``val_acc``, and a StepLR."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class TwoOptimizersNet(_Classifier):
    """Returns two optimizers (one per layer) under automatic optimization: edgefleet must
    refuse it (Lightning 2.x refuses it too; only one optimizer is supported per step)."""

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=self.lr),
                torch.optim.SGD(self.net[2].parameters(), lr=self.lr))


class ManualOptNet(_Classifier):
    """Uses manual optimization (``automatic_optimization = False``): edgefleet must refuse it."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss.detach()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
