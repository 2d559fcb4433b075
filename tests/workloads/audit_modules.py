"""Small LightningModules the training-metric audit refuses or accepts (one way of using torchmetrics each)."""

from __future__ import annotations

import lightning.pytorch as lpl
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


def _accuracy() -> torchmetrics.Metric:
    return torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(x)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AccuracyInTrainingStep(_Classifier):
    """Lightning's torchmetrics docs: the Metric updated and logged as an object in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = _accuracy()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)


class AccuracyInSharedStep(_Classifier):
    """The common ``_shared_step(batch, stage)`` helper, with the Metric named literally there."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = _accuracy()
        self.val_acc = _accuracy()

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        metric = self.train_acc if stage == "train" else self.val_acc
        metric(logits, y)
        return F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")


class AccuracyByGetattr(_Classifier):
    """The Metric fetched by a computed name: the audit cannot tell which, so it refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = _accuracy()
        self.val_acc = _accuracy()

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        acc = getattr(self, f"{stage}_acc")
        acc(logits, y)
        self.log(f"{stage}_acc", acc)
        return F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")


class CollectionAtEpochEnd(_Classifier):
    """A MetricCollection updated per batch and logged at the end of the training epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_metrics = torchmetrics.MetricCollection({"acc": _accuracy()}, prefix="train_")

    def on_train_batch_end(self, outputs: object, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.train_metrics.update(self(x), y)

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.train_metrics.compute())


class AccuracyInValidationOnly(_Classifier):
    """The Metric in validation_step only: the coordinator validates the whole set on one process."""

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = _accuracy()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc)


class LightningPackageAccuracy(lpl.LightningModule):
    """The refused case written against ``lightning.pytorch``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.train_acc = _accuracy()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.log("train_acc", self.train_acc(logits, y))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
