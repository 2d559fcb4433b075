"""The profile command and the result-carrying job event: signed round trip, validation, limits."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import MAX_EVENT_BYTES, JobEvent, ProfileCommand, StopCommand, TrainCommand, command_from_dict
from edgefleet.protocol.signing import CommandVerifier, sign_command

KEY = b"k" * 32


def _fields(**over: Any) -> dict[str, Any]:
    fields = {"job_id": "profile-1-0", "board_id": "pi-1", "model": "lenet5", "dataset": "digits",
              "batch_sizes": [8, 16], "probe_host": "10.0.0.2", "probe_port": 40000, "probe_token": "t" * 32}
    fields.update(over)
    return fields


def test_a_signed_profile_command_round_trips_with_its_defaults() -> None:
    command = ProfileCommand(**_fields(model_options={"layers": 3}), seed=4)
    body = CommandVerifier(KEY).verify(sign_command(command.to_dict(), key=KEY))
    decoded = command_from_dict(body)
    assert decoded == command
    assert (decoded.warmup_steps, decoded.timed_steps, decoded.threads, decoded.probe_bytes) == (3, 8, 0, 4_000_000)
    assert decoded.timed_budget_s == 0.0  # every timed step, as a coordinator that predates the budget asks


def test_an_agent_that_predates_the_timed_budget_reads_the_command_without_it() -> None:
    """The budget is sent as a plain profile's schema version: an older agent ignores the key and times
    every step, which costs time and nothing else."""
    body = ProfileCommand(**_fields(), timed_budget_s=3.0).to_dict()
    assert body["schema_version"] == 1 and body["timed_budget_s"] == 3.0
    older = {key: value for key, value in body.items() if key != "timed_budget_s"}
    assert ProfileCommand.from_dict(older) == ProfileCommand(**_fields())


def test_command_from_dict_dispatches_on_kind_and_names_the_known_kinds() -> None:
    assert isinstance(command_from_dict(StopCommand(job_id="j", board_id="b").to_dict()), StopCommand)
    train = TrainCommand(job_id="j", board_id="b", exchange_host="h", exchange_port=1, token="t", model="lenet5",
                         dataset="digits", board_index=0, batch_sizes=[8], seed=0, total_steps=1)
    assert isinstance(command_from_dict(train.to_dict()), TrainCommand)
    with pytest.raises(DecodeError, match="'train', 'profile', 'stop'"):
        command_from_dict({"kind": "reboot"})


@pytest.mark.parametrize("over, fragment", [
    ({"batch_sizes": [16]}, "at least two distinct"),
    ({"batch_sizes": [16, 16]}, "at least two distinct"),
    ({"batch_sizes": [0, 16]}, "each >= 1"),
    ({"batch_sizes": list(range(1, 40))}, "at most 32"),
    ({"timed_steps": 0}, "timed_steps = 0"),
    ({"warmup_steps": -1}, "warmup_steps = -1"),
    ({"probe_port": 0}, "probe_port 0"),
    ({"probe_bytes": 1 << 40}, "probe_bytes"),
    ({"threads": -2}, "threads = -2"),
    ({"timed_budget_s": -1.0}, "timed_budget_s = -1.0"),
    ({"timed_budget_s": 1e9}, "must be 0-3600"),
    ({"timed_budget_s": math.nan}, "a finite number"),
    ({"probe_round_bytes": 1000}, "give both"),
    ({"probe_round_bytes": 1000, "probe_rounds": 1}, "at least 2 rounds"),
    ({"probe_rounds": 5}, "give both"),
    ({"probe_round_bytes": 1000, "probe_rounds": 5000}, "probe_rounds = 5000"),
    ({"kind": "train"}, "is not 'profile'"),
    ({"batch_sizes": "8,16"}, "should be list[int]"),
])
def test_invalid_profile_commands_are_refused_naming_the_field(over: dict, fragment: str) -> None:
    with pytest.raises(DecodeError) as info:
        ProfileCommand.from_dict(_fields(**over))
    assert fragment in str(info.value) and "ProfileCommand" in str(info.value)


def test_required_fields_are_required() -> None:
    data = _fields()
    del data["probe_token"]
    with pytest.raises(DecodeError, match="'probe_token' is missing"):
        ProfileCommand.from_dict(data)


def test_an_event_carries_nested_result_data() -> None:
    data = {"points": [{"batch_size": 8, "step_time_s": 0.012, "peak_memory_bytes": 400_000_000}],
            "link": {"up_bytes_per_s": 1.2e7, "down_bytes_per_s": None}, "power_source": "estimated"}
    event = JobEvent(job_id="j", board_id="b", phase="finished", data=data)
    assert JobEvent.from_msgpack(event.to_msgpack()) == event
    assert JobEvent.from_msgpack(JobEvent(job_id="j", board_id="b", phase="running").to_msgpack()).data is None


@pytest.mark.parametrize("data, fragment", [
    ({"x": math.nan}, "finite numbers"),
    ({"a": {"b": {"c": {"d": {"e": 1}}}}}, "nested at most 4"),
    ([1, 2], "field 'data'"),
])
def test_event_data_that_is_not_plain_is_refused(data: object, fragment: str) -> None:
    payload = msgpack.packb({"job_id": "j", "board_id": "b", "phase": "finished", "data": data})
    with pytest.raises(DecodeError, match=fragment):
        JobEvent.from_msgpack(payload)


def test_an_event_over_the_size_limit_is_refused() -> None:
    event = JobEvent(job_id="j", board_id="b", phase="finished", data={"blob": "x" * MAX_EVENT_BYTES})
    with pytest.raises(DecodeError, match="over the"):
        JobEvent.from_msgpack(event.to_msgpack())
