"""The train command across versions: an agent refuses one it cannot carry out in full."""

from __future__ import annotations

import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import TRAIN_SCHEMA_VERSION, TrainCommand, command_from_dict

BASE = {"kind": "train", "job_id": "j", "board_id": "b", "exchange_host": "127.0.0.1", "exchange_port": 9000,
        "token": "t", "model": "lenet5", "dataset": "digits", "board_index": 0, "batch_sizes": [8, 8], "seed": 1,
        "total_steps": 10}


def test_a_new_train_command_round_trips_with_the_lightning_flags() -> None:
    command = TrainCommand(**{k: v for k, v in BASE.items() if k != "kind"}, accumulate_grad_batches=2,
                           gradient_clip_val=0.5, gradient_clip_algorithm="value", precision="bf16-mixed",
                           deterministic=True, batches_per_epoch=7, max_epochs=3)
    assert command.schema_version == TRAIN_SCHEMA_VERSION == 11
    assert command_from_dict(command.to_dict()) == command


def test_a_train_command_from_a_coordinator_before_the_flags_keeps_lightnings_defaults() -> None:
    command = command_from_dict({**BASE, "schema_version": 1})
    assert isinstance(command, TrainCommand) and command.accumulate_grad_batches == 1
    assert command.gradient_clip_val is None and command.precision == "32-true" and command.datamodule == ""


def test_a_newer_train_command_is_refused_not_half_understood() -> None:
    with pytest.raises(DecodeError, match="newer than this side understands"):
        command_from_dict({**BASE, "schema_version": TRAIN_SCHEMA_VERSION + 1})


@pytest.mark.parametrize(("change", "fragment"), [
    ({"datamodule": "pkg.dm:DM"}, "exactly one of dataset and datamodule"),
    ({"dataset": ""}, "exactly one of dataset and datamodule"),
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches"),
    ({"gradient_clip_algorithm": "norm2"}, "gradient_clip_algorithm"),
    ({"gradient_clip_val": "big"}, "gradient_clip_val"),
])
def test_bad_train_fields_are_refused_naming_them(change: dict, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        command_from_dict({**BASE, **change})
