"""Small LightningModules written the way an ordinary user writes them, one per feature.

Each module is tiny (< 20k parameters) and trains in milliseconds on a CPU. Every
``training_step`` returns the *mean* loss over its batch: the fleet weights each
board's mean gradient by its batch size, so a sum reduction would be wrong. Every
module is device-agnostic, as Lightning asks: a tensor made inside a hook takes its
device from the model or the batch (``device=``, ``type_as``), never the CPU default.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import lightning.pytorch as L
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
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


class LossGainNet(pl.LightningModule):
    """A loss multiplied by ``gain``: under 16-mixed its first steps overflow at the default loss scale (2**16),
    on the boards with the smallest slices first, until the scale has come down (DDP's rule, not one process's)."""

    def __init__(self, lr: float = 0.05, gain: float = 256.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.hparams.gain * F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr / self.hparams.gain, momentum=0.9)


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
        mask = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1).to(x.dtype)
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


# ------------------------------------------------------------------------------------------------
# Issue 39: what outside users write (Lightning's docs, real projects).


class OneCycleNet(_Classifier):
    """OneCycleLR exactly as Lightning's docs write it: ``total_steps=self.trainer.estimated_stepping_batches``,
    stepped every optimizer step."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr / 10, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class EmaNet(_Classifier):
    """An exponential moving average of the weights, one float buffer per parameter (``ema_0_weight``, ...),
    updated in ``on_train_batch_end`` after each optimizer step; ``ema_state()`` is the averaged model."""

    def __init__(self, lr: float = 0.1, decay: float = 0.8) -> None:
        super().__init__(lr=lr)
        self.decay = decay
        for name, p in self.net.named_parameters():
            self.register_buffer("ema_" + name.replace(".", "_"), p.detach().clone())

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                ema = getattr(self, "ema_" + name.replace(".", "_"))
                ema.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EpochOutputsNet(_Classifier):
    """The Lightning 2.x replacement of ``training_epoch_end``, as in the migration guide: losses collected in
    ``training_step``, their mean logged and the list cleared in ``on_train_epoch_end``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.training_step_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        epoch_mean = torch.stack(self.training_step_outputs).mean()
        self.log("training_epoch_mean", epoch_mean)
        self.training_step_outputs.clear()  # free memory

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TransferHooksNet(pl.LightningModule):
    """A module that prepares its own batches with the three batch-transfer hooks (data of
    ``make_raw_classification``: float64 readings in raw units), for training and validation alike:
    ``on_before_batch_transfer`` clips the readings to the sensor's range (on the CPU),
    ``transfer_batch_to_device`` moves them, cast to float32 in one copy, and ``on_after_batch_transfer``
    standardises them on the device."""

    def __init__(self, lr: float = 0.1, shift: float = 5.0, scale: float = 10.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        x, y = batch
        low, high = self.hparams.shift - 2 * self.hparams.scale, self.hparams.shift + 2 * self.hparams.scale
        return x.clamp(low, high), y

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        x, y = batch
        return x.to(device, torch.float32), y.to(device)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x, y = batch
        return (x - self.hparams.shift) / self.hparams.scale, y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class CumulativeBatchNormNet(BatchNormNet):
    """BatchNorm1d with ``momentum=None``: the running statistics are a cumulative average whose factor is
    ``1 / num_batches_tracked``, so the integer buffer steers the float ones."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.net[1] = nn.BatchNorm1d(16, momentum=None)


class ConfigureModelNet(pl.LightningModule):
    """Layers built in ``configure_model()`` (Lightning calls it before ``configure_optimizers``), idempotent
    as Lightning's docs ask; ``__init__`` creates no parameter."""

    def __init__(self, lr: float = 0.1, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = _mlp(8, self.hparams.hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class SetupNet(ConfigureModelNet):
    """Layers built in ``setup(stage)``, the pre-2.1 way to build a model once the run is known."""

    def configure_model(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        if self.net is None:
            self.net = _mlp(8, self.hparams.hidden, 3)


class TrainMetricNet(_Classifier):
    """A torchmetrics ``Accuracy`` updated in ``training_step`` and logged as the metric object (Lightning's
    torchmetrics docs): its state lives on one process, so the fleet must refuse it."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.train_acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ModuleCallbacksNet(LoggingNet):
    """The docs' module returning an ``EarlyStopping`` on the validation accuracy and a ``ModelCheckpoint`` from
    ``configure_callbacks`` (Lightning's docs): Lightning adds them to every Trainer that fits the module, the replica's
    and each board's, so the fleet must refuse it. The checkpoints go to a temporary folder where plain Lightning fits it."""

    def configure_callbacks(self):
        folder = Path(tempfile.gettempdir()) / "edgefleet-conformance" / type(self).__name__
        return [pl.callbacks.EarlyStopping(monitor="val_acc", mode="max", patience=2),
                pl.callbacks.ModelCheckpoint(dirpath=folder, monitor="val_acc", mode="max")]


class ValMetricNet(_Classifier):
    """A torchmetrics ``Accuracy`` used only in ``validation_step`` (the coordinator validates on one process)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.val_acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DropoutNet(pl.LightningModule):
    """Dropout between the layers: each run's masks come from its seed."""

    def __init__(self, lr: float = 0.1, p: float = 0.3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BatchNormDropoutNet(pl.LightningModule):
    """BatchNorm (split-dependent statistics), dropout (seeded draws) and a validation_step (the replica's threads):
    everything in a run that a busy host could disturb, if anything did."""

    def __init__(self, lr: float = 0.1, p: float = 0.3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 3))

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
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SlowValidationNet(pl.LightningModule):
    """A validation that takes ``val_s`` seconds (a large validation set on a slow coordinator), and ``end_s`` more in
    its own ``on_validation_end`` (a report written after it), which Lightning calls after its callbacks' hook."""

    def __init__(self, lr: float = 0.1, val_s: float = 0.8, end_s: float = 0.0) -> None:
        super().__init__()
        self.lr, self.val_s, self.end_s = lr, val_s, end_s
        self.net = _mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_validation_epoch_start(self) -> None:
        time.sleep(self.val_s)  # the validation's own cost, not a synchronisation

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=1) == y).float().mean())

    def on_validation_end(self) -> None:
        time.sleep(self.end_s)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ParamGroupsNet(_Classifier):
    """One AdamW, two parameter groups: weight decay on the weights only, and the biases at another lr
    (the split nanoGPT and Hugging Face's examples make)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr=lr)

    def configure_optimizers(self):
        decay = [p for name, p in self.named_parameters() if name.endswith("weight")]
        no_decay = [p for name, p in self.named_parameters() if name.endswith("bias")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0, "lr": self.lr * 3}], lr=self.lr)


class FrozenLayerNet(pl.LightningModule):
    """Transfer learning's frozen feature extractor: ``requires_grad_(False)`` on the first layer, while the
    optimizer (with weight decay) still gets ``self.parameters()``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Linear(8, 16)
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-3)


class TiedWeightsNet(pl.LightningModule):
    """A bag-of-words language model whose output projection shares the embedding's Parameter
    (``head.weight = embed.weight``, as GPT-2 and nanoGPT tie them): predicts a sequence's last token
    from the others (``make_tokens`` ids; its label is unused)."""

    def __init__(self, vocab: int = 50, dim: int = 8, lr: float = 0.5) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids).mean(dim=1))))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return F.cross_entropy(self(ids[:, :-1]), ids[:, -1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class EpochLogNet(_Classifier):
    """``self.log("train_loss", loss, on_step=False, on_epoch=True)``: Lightning reports the epoch's mean."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TrainerFiguresNet(_Classifier):
    """Reads the Trainer's figures in ``configure_optimizers`` (as a user sizing a schedule does) and keeps them
    in an int64 buffer saved with the weights. ``trainer_figures`` is (max_epochs, max_steps,
    num_training_batches, estimated_stepping_batches, accumulate_grad_batches) as ``configure_optimizers`` sees
    them, then num_training_batches again as ``on_train_start`` sees it. Under ``max_steps`` Lightning has not
    loaded the training data by ``configure_optimizers`` (num_training_batches is inf there, kept as -1)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.register_buffer("trainer_figures", torch.zeros(6, dtype=torch.int64))

    def configure_optimizers(self):
        trainer = self.trainer
        total_steps = trainer.estimated_stepping_batches
        figures = [trainer.max_epochs, trainer.max_steps, trainer.num_training_batches, total_steps,
                   trainer.accumulate_grad_batches]
        figures = [-1 if math.isinf(f) else int(f) for f in figures]
        self.trainer_figures[:5] = torch.tensor(figures, device=self.trainer_figures.device)
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        self.trainer_figures[5] = self.trainer.num_training_batches
