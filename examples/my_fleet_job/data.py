"""Your own dataset: a factory returning a map-style dataset of (input, target) pairs.

With a ``split`` parameter it is called with ``split="train"`` and ``split="val"``; without one,
edgefleet splits its data 90/10 with a fixed seed. Options come from ``--dataset-options``.
Every board (and the coordinator) must produce the same data for ``--data-mode global``; with
``--data-mode local`` each board trains on its own files.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_dataset(split: str = "train", n: int = 2048, features: int = 16, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
    x = torch.randn(n, features, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long()  # a rule the model can learn
    dataset = TensorDataset(x, y)
    dataset.input_shape = (features,)  # optional: saves edgefleet a pass over the data
    dataset.num_classes = 2
    return dataset
