"""Built-in datasets: scikit-learn's digits, seeded synthetic clusters, and an ``.npz`` file on the board.

Each factory is called as ``factory(split="train"|"val", **options)`` and returns a
:class:`TensorDataset`-like map-style dataset of ``(float32 input, int64 target)`` with
``input_shape`` and ``num_classes`` attributes. Every split is deterministic and independent of
the training seed, so every board and the coordinator see the same samples at the same indices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from edgefleet.protocol.errors import ConfigError

SPLITS = ("train", "val")

# Fixed seeds for the train/val splits. They are deliberately not the training seed: changing the
# training seed must reshuffle batches, never move samples between train and val.
DIGITS_SPLIT_SEED = 1797
NPZ_SPLIT_SEED = 90
# The synthetic val split is drawn with ``seed + SYNTHETIC_VAL_OFFSET`` (the train split with ``seed + 1``,
# the class centres with ``seed``), so train and val share centres but never samples.
SYNTHETIC_VAL_OFFSET = 1_000_003


class ClassificationDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """What the fleet needs of a dataset: map-style ``(input, target)`` pairs plus two attributes.

    Every :func:`~workloads.registry.build_dataset` result is one, so callers get ``len()``,
    ``input_shape`` and ``num_classes`` with their types, and can pass it to a DataLoader.

    Attributes:
        input_shape: One sample's shape, without the batch dimension.
        num_classes: Number of classes; targets are in ``range(num_classes)``.
    """

    input_shape: tuple[int, ...]
    num_classes: int

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TensorClassificationDataset(ClassificationDataset):
    """Inputs and targets held in memory as two tensors.

    Attributes:
        inputs: float32, shape ``(n, *input_shape)``.
        targets: int64, shape ``(n,)``.
        input_shape: One sample's shape.
        num_classes: Number of classes (shared by both splits, even if one lacks a class).
        source_indices: Rows of the source data this split holds, or None if generated.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, num_classes: int,
                 source_indices: torch.Tensor | None = None) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs.to(torch.float32).contiguous()
        self.targets = targets.to(torch.int64).contiguous()
        self.input_shape = tuple(self.inputs.shape[1:])
        self.num_classes = int(num_classes)
        self.source_indices = source_indices

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def check_split(split: str) -> None:
    """Raise ConfigError unless ``split`` is ``"train"`` or ``"val"``."""
    if split not in SPLITS:
        raise ConfigError(f"split = {split!r} is not one of {', '.join(SPLITS)}")


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/val index split of ``range(n)``.

    Args:
        n: Number of samples.
        val_fraction: Share of samples that go to val (rounded, at least 1 if ``n >= 2``).
        seed: Seed of the permutation; keep it fixed, independent of the training seed.

    Returns:
        ``(train_indices, val_indices)``, each sorted, disjoint, together ``range(n)``.
    """
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction = {val_fraction} must be between 0 and 1")
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(max(round(n * val_fraction), 1), n - 1) if n >= 2 else 0
    return permutation[n_val:].sort().values, permutation[:n_val].sort().values


# ---------------------------------------------------------------------------------------------- digits

def load_digits_dataset(split: str = "train", size: int = 32) -> TensorClassificationDataset:
    """scikit-learn's bundled 8x8 digits (1797 real samples, no download), upscaled to ``1 x size x size``.

    80 % train / 20 % val with a fixed seed. Inputs are standardised with the train split's mean
    and standard deviation.

    Args:
        split: ``"train"`` (1438 samples) or ``"val"`` (359 samples).
        size: Side of the upscaled image (bilinear, done once at load).
    """
    check_split(split)
    inputs, targets, train_idx, val_idx = _digits_tensors(int(size))
    indices = train_idx if split == "train" else val_idx
    return TensorClassificationDataset(inputs[indices], targets[indices], num_classes=10, source_indices=indices)


@functools.lru_cache(maxsize=2)
def _digits_tensors(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Cached: train and val are usually loaded together, and the upscale is the slow part.
    from sklearn.datasets import load_digits  # here: slow to import

    digits = load_digits()
    images = torch.from_numpy(digits.images).to(torch.float32).unsqueeze(1) / 16.0   # (1797, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    targets = torch.from_numpy(digits.target).to(torch.int64)
    train_idx, val_idx = split_indices(len(targets), 0.2, DIGITS_SPLIT_SEED)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    return (images - mean) / std, targets, train_idx, val_idx


# ------------------------------------------------------------------------------------------- synthetic

def make_synthetic_dataset(split: str = "train", n: int = 4096, shape: Sequence[int] | str | int = (1, 32, 32),
                           classes: int = 10, seed: int = 0, n_val: int | None = None, separation: float = 3.0,
                           noise: float = 1.0) -> TensorClassificationDataset:
    """Seeded Gaussian-cluster classification: each class is a random centre plus isotropic noise.

    Args:
        split: ``"train"`` or ``"val"``.
        n: Number of train samples.
        shape: Sample shape, as a sequence, an int, or a string like ``"1x32x32"`` (from the CLI).
        classes: Number of classes.
        seed: Seeds the class centres (shared by both splits) and, offset, the samples.
        n_val: Number of val samples; default ``n // 5``.
        separation: Expected norm of each class centre, in units of ``noise``.
        noise: Standard deviation of the per-coordinate noise.
    """
    check_split(split)
    sample_shape = parse_shape(shape)
    if n < 1 or classes < 2:
        raise ConfigError(f"synthetic needs n >= 1 and classes >= 2, got n = {n}, classes = {classes}")
    count = n if split == "train" else (n_val if n_val is not None else max(n // 5, 1))
    dims = math.prod(sample_shape)
    # The centres' norm is ~separation * noise whatever the dimension, so the task's difficulty
    # does not change with ``shape``.
    centres = torch.randn(classes, dims, generator=torch.Generator().manual_seed(seed)) * (separation * noise / math.sqrt(dims))
    sample_seed = seed + 1 if split == "train" else seed + SYNTHETIC_VAL_OFFSET
    generator = torch.Generator().manual_seed(sample_seed)
    targets = torch.randint(classes, (count,), generator=generator)
    inputs = centres[targets] + noise * torch.randn(count, dims, generator=generator)
    return TensorClassificationDataset(inputs.reshape(count, *sample_shape), targets, num_classes=classes)


def parse_shape(shape: Sequence[int] | str | int) -> tuple[int, ...]:
    """``(1, 32, 32)``, ``[1, 32, 32]``, ``"1x32x32"`` or ``64`` to a tuple of positive ints."""
    try:
        if isinstance(shape, str):
            dims = tuple(int(part) for part in shape.lower().replace(",", "x").split("x") if part.strip())
        elif isinstance(shape, int):
            dims = (shape,)
        else:
            dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"shape = {shape!r} is not a shape; write it like 1x32x32")
    return dims


# ------------------------------------------------------------------------------------------------- npz

def load_npz_dataset(split: str = "train", path: str | Path = "", val_fraction: float = 0.1) -> TensorClassificationDataset:
    """Arrays ``x`` and ``y`` from an ``.npz`` file on the board, plus ``x_val``/``y_val`` if present.

    Without ``x_val``/``y_val``, a deterministic split (``val_fraction``, fixed seed) of ``x``/``y``
    is used. ``num_classes`` is ``max(y, y_val) + 1`` so both splits agree.

    Args:
        split: ``"train"`` or ``"val"``.
        path: The ``.npz`` file.
        val_fraction: Share of ``x`` used for val when the file has no val arrays.

    Raises:
        ConfigError: The file is missing or unreadable, or lacks the arrays (names path and keys found).
    """
    check_split(split)
    if not str(path):
        raise ConfigError("the npz dataset needs a path option, e.g. path=/data/train.npz")
    arrays = _read_npz(Path(path))
    if "x_val" in arrays:
        indices = None
        x, y = (arrays["x"], arrays["y"]) if split == "train" else (arrays["x_val"], arrays["y_val"])
    else:
        train_idx, val_idx = split_indices(len(arrays["y"]), val_fraction, NPZ_SPLIT_SEED)
        indices = train_idx if split == "train" else val_idx
        x, y = arrays["x"][indices.numpy()], arrays["y"][indices.numpy()]
    num_classes = max(int(arrays[key].max()) for key in ("y", "y_val") if key in arrays and arrays[key].size) + 1
    return TensorClassificationDataset(torch.from_numpy(x), torch.from_numpy(y), num_classes=num_classes,
                                       source_indices=indices)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"npz dataset file {path} does not exist (on this board)")
    try:
        # allow_pickle=False: a data file must never be able to run code on the board.
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"npz dataset file {path} could not be read: {exc}") from exc
    found = ", ".join(sorted(arrays)) or "none"
    if "x" not in arrays or "y" not in arrays:
        raise ConfigError(f"npz dataset file {path} needs arrays x and y; keys found: {found}")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ConfigError(f"npz dataset file {path} needs both x_val and y_val, or neither; keys found: {found}")
    for x_key, y_key in (("x", "y"), ("x_val", "y_val")):
        if x_key not in arrays:
            continue
        x, y = arrays[x_key], arrays[y_key]
        if x.ndim < 1 or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
            raise ConfigError(f"npz dataset file {path}: {x_key} must be a numeric array with one row per sample "
                              f"(got shape {x.shape}, dtype {x.dtype})")
        if y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer) or (y.size and y.min() < 0):
            raise ConfigError(f"npz dataset file {path}: {y_key} must be a 1-d array of non-negative integer labels, "
                              f"one per row of {x_key} (got {x_key} {x.shape}, {y_key} {y.shape} {y.dtype})")
        arrays[x_key] = x.astype(np.float32, copy=False)
        arrays[y_key] = y.astype(np.int64, copy=False)
    if len(arrays["y"]) < 2:
        raise ConfigError(f"npz dataset file {path} has {len(arrays['y'])} samples in x/y; need at least 2")
    return arrays


DatasetFactory = Callable[..., Dataset[Any]]

BUILTIN_DATASETS: dict[str, DatasetFactory] = {
    "digits": load_digits_dataset,
    "synthetic": make_synthetic_dataset,
    "npz": load_npz_dataset,
}

__all__ = [
    "BUILTIN_DATASETS",
    "DIGITS_SPLIT_SEED",
    "SPLITS",
    "DatasetFactory",
    "TensorClassificationDataset",
    "check_split",
    "load_digits_dataset",
    "load_npz_dataset",
    "make_synthetic_dataset",
    "parse_shape",
    "split_indices",
]
