"""The averaging schedule both sides of periodic averaging follow, and the train command that carries it."""

from __future__ import annotations

import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import (
    PERIODIC_TRAIN_SCHEMA_VERSION,
    TRAIN_SCHEMA_VERSION,
    TrainCommand,
    command_from_dict,
)
from edgefleet.protocol.sync_schedule import SyncSchedule, is_sync_step

BASE = {"kind": "train", "job_id": "j", "board_id": "b", "exchange_host": "127.0.0.1", "exchange_port": 9000,
        "token": "t", "model": "lenet5", "dataset": "digits", "board_index": 0, "batch_sizes": [8, 8], "seed": 1,
        "total_steps": 10}


def test_warmup_steps_are_exact_then_every_h_th_step_averages() -> None:
    schedule = SyncSchedule(every=3, warmup=2, steps_per_epoch=100, total_steps=12)
    assert [schedule.kind(s) for s in range(12)] == ["exact", "exact", "local", "local", "sync", "local", "local",
                                                     "sync", "local", "local", "sync", "sync"]  # 11: the run's last


def test_an_epochs_last_step_always_averages_and_the_count_restarts_only_at_warmup() -> None:
    schedule = SyncSchedule(every=4, warmup=0, steps_per_epoch=6, total_steps=100)
    syncs = [s for s in range(14) if schedule.kind(s) == "sync"]
    assert syncs == [3, 5, 7, 11]  # every 4th step counted from the warm-up's end, and epoch ends 5 and 11
    assert all(is_sync_step(s, every=4, warmup=0, steps_per_epoch=6, total_steps=100) == (s in syncs) for s in range(14))


def test_every_1_is_the_exact_mode_throughout() -> None:
    schedule = SyncSchedule(every=1, warmup=0, steps_per_epoch=5, total_steps=20)
    assert not schedule.periodic and {schedule.kind(s) for s in range(20)} == {"exact"}
    assert "exact" in schedule.describe()
    assert SyncSchedule(every=4, warmup=9).describe() == "local SGD, averaging every 4 steps after 9 exact steps"


def test_an_out_of_range_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        SyncSchedule(every=0)


def test_every_command_is_the_version_whose_agents_train_it_alike() -> None:
    # version 6 seeds the boards, takes the DataModule's batch hooks and exchanges integer buffers: an older
    # agent would train any job differently, so it refuses every command as too new
    assert TrainCommand(**{k: v for k, v in BASE.items() if k != "kind"}).schema_version == TRAIN_SCHEMA_VERSION > \
        PERIODIC_TRAIN_SCHEMA_VERSION
    with pytest.raises(DecodeError, match="newer than this side understands"):
        command_from_dict({**BASE, "schema_version": TRAIN_SCHEMA_VERSION + 1})
    periodic = TrainCommand(**{k: v for k, v in BASE.items() if k != "kind"}, sync_every=3, sync_warmup=5,
                            schema_version=TRAIN_SCHEMA_VERSION)
    assert command_from_dict(periodic.to_dict()) == periodic
    exact = command_from_dict({**BASE, "schema_version": 3})  # an older command: read, with today's defaults
    assert isinstance(exact, TrainCommand) and exact.sync_every == 1


@pytest.mark.parametrize(("change", "fragment"), [
    ({"sync_every": 0}, "sync_every 0 must be >= 1"),
    ({"sync_every": 2, "sync_warmup": -1}, "sync_warmup -1"),
    ({"sync_every": 2, "schema_version": PERIODIC_TRAIN_SCHEMA_VERSION - 1}, "needs schema_version"),
    ({"sync_every": 2, "accumulate_grad_batches": 2}, "accumulate_grad_batches 1"),
])
def test_a_periodic_command_that_cannot_be_carried_out_is_refused(change: dict, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        command_from_dict({**BASE, **change})
