"""What training_step logs on a board, under a real Lightning fit: numbers averaged per step, NaN left out,
and a value that is not a number (a torchmetrics Metric, a tensor of many values) failing the job by name."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from edgefleet.agent.step_logs import StepLogs
from edgefleet.protocol.errors import EdgeTrainError


class LoggingModule(pl.LightningModule):
    """Logs ``value_of(self, logits, y)`` as "train_acc" in training_step."""

    def __init__(self, value_of: Any) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.train_acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)
        self.value_of = value_of
        self.taken: list[dict[str, list[Any]] | None] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.log("train_acc", self.value_of(self, logits, y))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: LoggingModule, steps: int = 2) -> list[dict[str, list[Any]] | None]:
    """Fit ``steps`` steps with the board's StepLogs on the model; each step's :meth:`StepLogs.take`."""
    logs = StepLogs(model)
    taken: list[dict[str, list[Any]] | None] = []

    class Take(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            taken.append(logs.take())

    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[Take()])
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    return taken


def test_a_number_is_taken_each_step() -> None:
    taken = _fit(LoggingModule(lambda self, logits, y: (logits.argmax(dim=1) == y).float().mean()))

    assert len(taken) == 2
    for step in taken:
        assert step is not None
        mean, on_step, on_epoch, prog_bar = step["train_acc"]
        assert 0.0 <= mean <= 1.0 and (on_step, on_epoch, prog_bar) == (True, False, False)


def test_nan_is_left_out() -> None:
    taken = _fit(LoggingModule(lambda self, logits, y: torch.tensor(math.nan)))

    assert taken == [None, None]


def test_a_metric_fails_the_job_naming_it() -> None:
    # Prepare: Lightning's torchmetrics docs, the Metric logged as an object
    def metric(self: LoggingModule, logits: torch.Tensor, y: torch.Tensor) -> Any:
        self.train_acc(logits, y)
        return self.train_acc

    # Execute
    with pytest.raises(EdgeTrainError) as failed:
        _fit(LoggingModule(metric))

    # Assert
    message = str(failed.value)
    assert "'train_acc'" in message and "a torchmetrics MulticlassAccuracy" in message
    assert "(preds == y).float().mean()" in message and "validation_step only" in message


def test_a_tensor_of_many_values_fails_the_job_naming_its_shape() -> None:
    with pytest.raises(EdgeTrainError, match=r"logs a Tensor of shape \(4,\), not a number"):
        _fit(LoggingModule(lambda self, logits, y: (logits.argmax(dim=1) == y).float()))


def test_a_value_in_the_graph_is_taken_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    """A loss logged before its backward (a pipeline stage's training_step logs its own) is read detached, as
    Lightning's own logging reads it: torch warns when a tensor that requires grad is made a Python number."""
    taken = _fit(LoggingModule(lambda self, logits, y: F.cross_entropy(logits, y)))
    assert all(step is not None and step["train_acc"][0] > 0 for step in taken), taken
    assert not [w for w in recwarn if "requires_grad" in str(w.message)], [str(w.message) for w in recwarn]
