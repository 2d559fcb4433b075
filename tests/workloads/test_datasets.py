"""The built-in datasets: sizes, shapes, deterministic disjoint splits, and npz errors that name the file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.datasets import (
    load_digits_dataset,
    load_npz_dataset,
    make_synthetic_dataset,
    parse_shape,
)


def test_digits_is_all_1797_samples_split_80_20_without_overlap() -> None:
    train, val = load_digits_dataset("train"), load_digits_dataset("val")
    assert (len(train), len(val)) == (1438, 359)
    assert set(train.source_indices.tolist()).isdisjoint(val.source_indices.tolist())
    assert sorted(train.source_indices.tolist() + val.source_indices.tolist()) == list(range(1797))
    for split in (train, val):
        assert split.input_shape == (1, 32, 32) and split.num_classes == 10
        inputs, target = split[0]
        assert inputs.shape == (1, 32, 32) and inputs.dtype == torch.float32 and target.dtype == torch.int64
    assert set(val.targets.tolist()) == set(range(10))


def test_digits_is_standardised_and_independent_of_the_global_seed() -> None:
    torch.manual_seed(123)
    first = load_digits_dataset("train")
    from edgefleet.workloads import datasets
    datasets._digits_tensors.cache_clear()   # really load again, not the cached tensors
    torch.manual_seed(456)
    second = load_digits_dataset("train")
    assert torch.equal(first.inputs, second.inputs) and torch.equal(first.targets, second.targets)
    assert abs(first.inputs.mean().item()) < 1e-4 and abs(first.inputs.std().item() - 1) < 1e-4


def test_synthetic_is_seeded_and_shaped() -> None:
    train = make_synthetic_dataset("train", n=256, shape=(3, 8, 8), classes=4, seed=7)
    assert len(train) == 256 and train.input_shape == (3, 8, 8) and train.num_classes == 4
    again = make_synthetic_dataset("train", n=256, shape="3x8x8", classes=4, seed=7)
    assert torch.equal(train.inputs, again.inputs) and torch.equal(train.targets, again.targets)
    other_seed = make_synthetic_dataset("train", n=256, shape=(3, 8, 8), classes=4, seed=8)
    assert not torch.equal(train.inputs, other_seed.inputs)


def test_synthetic_val_shares_the_classes_but_not_the_samples() -> None:
    train = make_synthetic_dataset("train", n=2000, shape=(16,), classes=3, seed=1)
    val = make_synthetic_dataset("val", n=2000, shape=(16,), classes=3, seed=1)
    assert len(val) == 400
    assert not any(torch.equal(val.inputs[0], row) for row in train.inputs)
    # Same centres: each class's mean in val is close to its mean in train.
    for label in range(3):
        gap = train.inputs[train.targets == label].mean(0) - val.inputs[val.targets == label].mean(0)
        assert gap.norm() < 1.0


@pytest.mark.parametrize("loader", [load_digits_dataset, make_synthetic_dataset])
def test_unknown_split_is_a_config_error(loader) -> None:
    with pytest.raises(ConfigError, match="train, val"):
        loader("test")


def test_parse_shape() -> None:
    assert parse_shape("1x32x32") == (1, 32, 32) and parse_shape([3, 4]) == (3, 4) and parse_shape(5) == (5,)
    with pytest.raises(ConfigError, match="1x32x32"):
        parse_shape("big")


def test_npz_with_val_arrays_uses_them(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((10, 2, 3), np.float64), y=np.arange(10) % 3, x_val=np.ones((4, 2, 3)), y_val=np.array([0, 1, 2, 5]))
    train, val = load_npz_dataset("train", path=path), load_npz_dataset("val", path=str(path))
    assert (len(train), len(val)) == (10, 4)
    assert train.input_shape == (2, 3) and train.inputs.dtype == torch.float32
    assert train.num_classes == val.num_classes == 6   # from both splits, so the model is the same


def test_npz_without_val_arrays_splits_90_10_deterministically(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.arange(100, dtype=np.float32).reshape(100, 1), y=np.arange(100) % 4)
    train, val = load_npz_dataset("train", path=path), load_npz_dataset("val", path=path)
    assert (len(train), len(val)) == (90, 10)
    train_rows = set(train.inputs[:, 0].tolist())
    assert train_rows.isdisjoint(val.inputs[:, 0].tolist()) and len(train_rows | set(val.inputs[:, 0].tolist())) == 100
    assert torch.equal(load_npz_dataset("val", path=path).inputs, val.inputs)


def test_npz_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.npz"
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))}.*does not exist"):
        load_npz_dataset("train", path=path)
    with pytest.raises(ConfigError, match="needs a path"):
        load_npz_dataset("train")


def test_npz_missing_arrays_names_the_path_and_the_keys_found(tmp_path: Path) -> None:
    path = tmp_path / "wrong.npz"
    np.savez(path, features=np.zeros((4, 2)), labels=np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))} needs arrays x and y; keys found: features, labels"):
        load_npz_dataset("train", path=path)
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(4, np.int64), x_val=np.zeros((2, 2)))
    with pytest.raises(ConfigError, match="x_val and y_val"):
        load_npz_dataset("train", path=path)


def test_npz_bad_labels_and_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "floats.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))}: y must be a 1-d array of non-negative integer labels"):
        load_npz_dataset("train", path=path)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=f"{re.escape(str(garbage))} could not be read"):
        load_npz_dataset("train", path=garbage)
