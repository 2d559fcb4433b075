"""The profile command's version: a plain profile stays version 1 (every agent takes it); one that measures
a DataModule, a precision or gradient accumulation is version 2, which an agent from before refuses as too
new instead of timing fp32 steps of a dataset without a word."""

from __future__ import annotations

from typing import Any

import pytest

from edgefleet.protocol._validate import message_from_dict
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import (
    JOB_SCHEMA_VERSION,
    JOB_SETTINGS_PROFILE_SCHEMA_VERSION,
    ProfileCommand,
    command_from_dict,
    profile_schema_version,
)
from edgefleet.protocol.signing import CommandVerifier, sign_command

KEY = b"k" * 32
SENSOR = "tests.conformance.data:SensorDataModule"


def _fields(**over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"job_id": "profile-1-0", "board_id": "pi-1", "model": "lenet5", "dataset": "digits",
                              "batch_sizes": [8, 16], "probe_host": "10.0.0.2", "probe_port": 40000,
                              "probe_token": "t" * 32}
    fields.update(over)
    return fields


def _old_agent(data: dict[str, Any]) -> ProfileCommand:
    """What an agent from before version 2 does with a command: the highest version it knows is 1."""
    return message_from_dict(ProfileCommand, data, schema_version=JOB_SCHEMA_VERSION)


def test_a_plain_profile_is_version_1_and_an_old_agent_still_takes_it() -> None:
    version = profile_schema_version(datamodule="", precision="32-true", accumulate_grad_batches=1)
    command = ProfileCommand(**_fields(), schema_version=version)

    assert version == JOB_SCHEMA_VERSION == 1
    assert _old_agent(command.to_dict()).model == "lenet5"


@pytest.mark.parametrize("settings", [
    {"precision": "bf16-mixed"},
    {"precision": "16-mixed"},
    {"accumulate_grad_batches": 2},
    {"dataset": "", "datamodule": SENSOR, "datamodule_options": {"n": 64}},
])
def test_a_profile_of_the_jobs_settings_is_version_2_which_an_old_agent_refuses(settings: dict[str, Any]) -> None:
    version = profile_schema_version(**{k: v for k, v in settings.items() if k not in ("dataset", "datamodule_options")})
    command = ProfileCommand(**_fields(**settings), schema_version=version)
    body = CommandVerifier(KEY).verify(sign_command(command.to_dict(), key=KEY))

    assert version == JOB_SETTINGS_PROFILE_SCHEMA_VERSION == 2
    assert command_from_dict(body) == command  # this agent takes it, settings and all
    with pytest.raises(DecodeError, match="schema_version 2 is newer than this side understands \\(1\\); upgrade"):
        _old_agent(body)


def test_a_command_that_asks_for_the_settings_at_version_1_is_refused() -> None:
    with pytest.raises(DecodeError, match="need schema_version 2, the command says 1"):
        ProfileCommand.from_dict(_fields(accumulate_grad_batches=2, schema_version=1))
    with pytest.raises(ValueError, match="need schema_version 2"):
        ProfileCommand(**_fields(precision="bf16-mixed"))


@pytest.mark.parametrize(("over", "fragment"), [
    ({"dataset": "", "schema_version": 2}, "exactly one of dataset and datamodule"),
    ({"datamodule": SENSOR, "schema_version": 2}, "exactly one of dataset and datamodule"),
    ({"datamodule_options": {"n": 1}}, "datamodule_options need a datamodule"),
    ({"accumulate_grad_batches": 0, "schema_version": 2}, "accumulate_grad_batches = 0 must be 1-10000"),
    ({"precision": "", "schema_version": 2}, "is not a Lightning precision"),
])
def test_invalid_settings_are_refused_naming_the_field(over: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        ProfileCommand.from_dict(_fields(**over))
