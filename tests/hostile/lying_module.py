"""LeNet-5 whose board lies in its gradient when its agent's environment says so (issue 36, item 2's attacks).

``EDGEFLEET_TEST_LIE=scale:K:FROM`` multiplies the gradient by K from step FROM on; ``flip::FROM`` turns it
around (the same norm). The loss the board reports stays the honest one: only the gradient lies, so no
range check on the reported values catches it; only an audit can. On the coordinator (no such variable)
the module is plain LeNet-5.
"""

from __future__ import annotations

import os

import torch

from edgefleet.workloads.models import LeNet5


class LyingLeNet(LeNet5):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        kind, _, rest = os.environ.get("EDGEFLEET_TEST_LIE", "").partition(":")
        factor, _, start = rest.partition(":")
        if not kind or self.global_step < int(start or 0):
            return loss
        scale = -1.0 if kind == "flip" else float(factor)
        return loss * scale - loss.detach() * (scale - 1)  # the value of the loss, the gradient times scale
