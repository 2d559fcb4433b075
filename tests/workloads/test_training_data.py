"""Data the fleet cannot split by index is refused by its name, before any board starts."""

from __future__ import annotations

import pytest

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.training_data import load_training_data


def test_an_iterable_dataset_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="IterableDataset") as refused:
        load_training_data(dataset="tests.workloads.iterable_data:make_stream")
    assert "map-style" in str(refused.value) and "Stream" in str(refused.value)
