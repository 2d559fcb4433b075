"""Generated data sets and DataModules for the conformance modules (no downloads).

Every factory is called ``factory(split="train"|"val", **options)`` and returns a
map-style Dataset. Data are deterministic in ``seed``; the train and val splits are
drawn from different streams of the same teacher.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

FEATURES = 8
CLASSES = 3
SEQ = 6
VOCAB = 50
# make_raw_classification's features are readings in raw units: RAW_SHIFT + RAW_SCALE * (a standard normal).
RAW_SHIFT = 5.0
RAW_SCALE = 10.0


class ListDataset(Dataset):
    """A map-style dataset over a list of ready-made samples (tuples or dicts)."""

    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def _generator(split: str, seed: int) -> torch.Generator:
    """The sample stream of a split: the teacher uses ``seed``, samples ``seed`` plus an offset."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    return torch.Generator().manual_seed(seed * 1000 + (1 if split == "train" else 2))


def _teacher(seed: int, outputs: int) -> torch.Tensor:
    """A fixed random linear map (FEATURES -> outputs), the same for both splits."""
    return torch.randn(FEATURES, outputs, generator=torch.Generator().manual_seed(seed * 1000))


def make_classification(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """Samples ``(x: float32 (8,), y: int64 scalar)``, 3 classes from a linear teacher."""
    g = _generator(split, seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ _teacher(seed, CLASSES)).argmax(dim=1)
    return TensorDataset(x, y)


def make_tokens(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """Samples ``(ids: int64 (6,), y: int64 scalar)``: y is 1 when the ids lean to the upper half
    of a vocabulary of 50 (the sequences' mean id is above the middle)."""
    g = _generator(split, seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = (ids.float().mean(dim=1) >= (VOCAB - 1) / 2).long()
    return TensorDataset(ids, y)


def make_regression(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """Samples ``(x: float32 (8,), y: float32 scalar)``; y is a non-integer real, so a target
    truncated to int would change the loss visibly."""
    g = _generator(split, seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ _teacher(seed, 1)).squeeze(1) + 0.1 * torch.randn(n, generator=g) + 0.37
    return TensorDataset(x, y.float())


def make_dicts(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """Samples ``{"features": float32 (8,), "label": int64 scalar}`` (classification data)."""
    x, y = make_classification(split, n=n, seed=seed).tensors
    return ListDataset([{"features": x[i], "label": y[i]} for i in range(n)])


def make_raw_classification(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """``make_classification`` in raw units, as numpy hands data over: ``(x: float64 (8,), y: int64)``
    with x = 5 + 10 * (the standard-normal features). A model needs them cast and standardised."""
    x, y = make_classification(split, n=n, seed=seed).tensors
    return TensorDataset(RAW_SHIFT + RAW_SCALE * x.double(), y)


def make_sequences(split: str = "train", n: int = 240, seed: int = 0) -> Dataset:
    """Samples ``(x: float32 (T, 4), y: int64 scalar)`` with T in 2..7; y is the class of the
    sequence's mean under a linear teacher."""
    g = _generator(split, seed)
    teacher = torch.randn(4, CLASSES, generator=torch.Generator().manual_seed(seed * 1000))
    samples = []
    for _ in range(n):
        length = int(torch.randint(2, 8, (1,), generator=g))
        x = torch.randn(length, 4, generator=g)
        samples.append((x, (x.mean(dim=0) @ teacher).argmax()))
    return ListDataset(samples)


def pad_collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pads variable-length sequences with zeros to the longest: ``(x_padded (B, T, 4), y (B,), lengths (B,))``."""
    xs, ys = zip(*samples)
    lengths = torch.tensor([len(x) for x in xs], dtype=torch.int64)
    return torch.nn.utils.rnn.pad_sequence(list(xs), batch_first=True), torch.stack(ys), lengths


class ClassificationDataModule(pl.LightningDataModule):
    """The classification data behind a DataModule, as a user writes one."""

    def __init__(self, n: int = 240, seed: int = 0, batch_size: int = 32) -> None:
        super().__init__()
        self.n = n
        self.seed = seed
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train_set = make_classification("train", n=self.n, seed=self.seed)
        self.val_set = make_classification("val", n=max(self.n // 4, 1), seed=self.seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class CollateDataModule(pl.LightningDataModule):
    """Variable-length sequences whose loaders batch with the module-level ``pad_collate``."""

    def __init__(self, n: int = 240, seed: int = 0, batch_size: int = 32) -> None:
        super().__init__()
        self.n = n
        self.seed = seed
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train_set = make_sequences("train", n=self.n, seed=self.seed)
        self.val_set = make_sequences("val", n=max(self.n // 4, 1), seed=self.seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=pad_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=pad_collate)


class SensorBatch:
    """A batch type of the user's own, as in Lightning's ``transfer_batch_to_device`` docs."""

    def __init__(self, readings: torch.Tensor, label: torch.Tensor) -> None:
        self.readings = readings
        self.label = label


class SensorDataModule(pl.LightningDataModule):
    """Raw float64 readings in dict samples ``{"readings", "label"}``, turned into model inputs by the three
    batch-transfer hooks, for training and validation batches alike:

    ``on_before_batch_transfer`` wraps the dict into a ``SensorBatch``; ``transfer_batch_to_device`` moves it,
    casting the readings to float32 in the same copy; ``on_after_batch_transfer`` standardises them with the
    training set's mean and std (computed in ``setup``) and hands the model ``(x, y)``. Skipping any one hook
    leaves the model a batch it cannot take.
    """

    def __init__(self, n: int = 240, seed: int = 0, batch_size: int = 32) -> None:
        super().__init__()
        self.n = n
        self.seed = seed
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        train = make_raw_classification("train", n=self.n, seed=self.seed)
        val = make_raw_classification("val", n=max(self.n // 4, 1), seed=self.seed)
        self.mean = train.tensors[0].mean(dim=0).float()
        self.std = train.tensors[0].std(dim=0).float()
        self.train_set = ListDataset([{"readings": x, "label": y} for x, y in train])
        self.val_set = ListDataset([{"readings": x, "label": y} for x, y in val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        return SensorBatch(batch["readings"], batch["label"])

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        if isinstance(batch, SensorBatch):
            return SensorBatch(batch.readings.to(device, torch.float32), batch.label.to(device))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x = (batch.readings - self.mean.to(batch.readings.device)) / self.std.to(batch.readings.device)
        return x, batch.label
