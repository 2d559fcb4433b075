"""Which modules the replica replays training_step for, and what their hooks then get."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from edgefleet.coordinator.run.replica_replay import Replay, replay_reason


class Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.training_step_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Plain(Base):
    pass


class Ema(Base):
    def on_train_batch_end(self, outputs, batch, batch_idx):  # looks at the model only
        self.layer.weight.data.mul_(1.0)


class ReadsBatch(Base):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen = len(batch[0])


class EpochOutputs(Base):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("mean", torch.stack(self.training_step_outputs).mean())
        self.training_step_outputs.clear()


class EpochLrOnly(Base):
    def on_train_epoch_end(self):  # training_step keeps nothing on the module
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize(("module", "why"), [
    (Plain, ""), (Ema, ""), (EpochLrOnly, ""),
    (ReadsBatch, "on_train_batch_end reads its outputs or batch"),
    (EpochOutputs, "on_train_epoch_end may use what training_step keeps on the module"),
])
def test_only_hooks_that_need_training_steps_products_make_the_replica_replay(module: type, why: str) -> None:
    assert replay_reason(module()) == why


def test_a_replayed_step_keeps_what_training_step_stores_and_gives_lightnings_outputs() -> None:
    model = EpochOutputs()
    replay = Replay(model, accumulate=2)
    replay.install()
    batch = (torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 1, 0]))
    assert model.training_step(batch, 0) is None  # no loss: nothing to backward on the replica
    loss = F.cross_entropy(model.layer(batch[0]), batch[1])
    assert torch.equal(model.training_step_outputs[0], loss.detach()) and not model.training_step_outputs[0].requires_grad
    assert torch.allclose(replay.outputs["loss"], loss / 2)  # Lightning divides by accumulate_grad_batches
    replay.remove()
    assert "training_step" not in model.__dict__
