"""The coordinator's own replica of the model: it applies every step's average like the boards do,
so it can write checkpoints and hand the current state to a board that joins late."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from workloads.params import (assign_grads, param_count, restore_optimizer_state, single_optimizer, to_numpy_tree,
                              trainable_params)

log = logging.getLogger(__name__)


class Replica:
    """A LightningModule and its optimizer, stepped with averaged gradients only."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.optimizer = single_optimizer(model.configure_optimizers())
        self.params = trainable_params(self.optimizer)
        self.param_count = param_count(self.params)
        self.step = 0  # the next global step

    @torch.no_grad()
    def apply(self, avg: np.ndarray) -> None:
        """One optimizer step with the fleet's average gradient (the same step every board takes)."""
        assign_grads(self.params, avg)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.step += 1

    def wire_state(self) -> tuple[int, Any, Any]:
        """(next step, model state, optimizer state) as numpy trees for the exchange's welcome."""
        return self.step, to_numpy_tree(self.model.state_dict()), to_numpy_tree(self.optimizer.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        restore_optimizer_state(self.optimizer, to_numpy_tree(state["optimizer"]))
        self.step = int(state["step"])

    @torch.no_grad()
    def evaluate(self, dataset: Any, batch_size: int = 256) -> tuple[float, float]:
        """(mean loss, accuracy) of the replica on ``dataset``."""
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        try:
            for x, y in loader:
                logits = self.model(x)
                loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
                total += len(y)
        finally:
            self.model.train()
        return (loss_sum / total, correct / total) if total else (float("nan"), float("nan"))



__all__ = ["Replica"]
