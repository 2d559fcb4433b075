"""The profile report's pipeline units (issue 35): a round trip through the job event, a report without them
unchanged on the wire (version 1, read by an older coordinator as before), malformed units refused naming the field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.profile_report import (
    MAX_UNITS,
    PROFILE_REPORT_VERSION,
    MeasuredPoint,
    ProfileReport,
    UnitReport,
)


def _unit(name: str, scale: float = 1.0) -> UnitReport:
    return UnitReport(name=name, forward_intercept_s=1e-5 * scale, forward_s_per_sample=2e-6 * scale,
                      backward_intercept_s=3e-5 * scale, backward_s_per_sample=4e-6 * scale, param_bytes=624,
                      activation_bytes_per_sample=18_816, held_bytes_per_sample=4096)


def _point(batch_size: int) -> MeasuredPoint:
    return MeasuredPoint(batch_size=batch_size, step_time_s=0.01 * batch_size, step_time_min_s=0.009 * batch_size,
                         step_time_max_s=0.012 * batch_size, step_time_spread_s=0.001, samples_per_s=100.0,
                         peak_memory_bytes=400_000_000, power_w=5.5)


BARE = ProfileReport(agent_version="0.1.0", worker_pid=1234, torch_threads=2, param_count=61_706,
                     points=(_point(8), _point(16)), active_power_w=5.5, idle_power_w=2.7, power_source="estimated",
                     memory_total_bytes=4_000_000_000)
REPORT = dataclasses.replace(BARE, units=(_unit("net.0"), _unit("net.1", 0.5), _unit("net.2", 0.0)))


def _data(**unit_over: Any) -> dict[str, Any]:
    wire = REPORT.to_wire()
    wire["units"][1] |= unit_over
    return wire


def test_units_round_trip_through_the_event_in_forward_order() -> None:
    event = JobEvent(job_id="p-0", board_id="b1", phase="finished", data=REPORT.to_wire())
    report = ProfileReport.from_wire(JobEvent.from_msgpack(event.to_msgpack()).data)
    assert report == REPORT and [u.name for u in report.units] == ["net.0", "net.1", "net.2"]
    assert report.v == PROFILE_REPORT_VERSION == 1


def test_a_report_without_units_is_todays_version_1_and_units_are_only_an_added_key() -> None:
    assert "units" not in BARE.to_wire()  # an older agent's report reads as no units
    assert ProfileReport.from_wire(BARE.to_wire()).units == ()
    with_units = REPORT.to_wire()
    del with_units["units"]
    assert with_units == BARE.to_wire()  # every key an older coordinator reads is what it was: it ignores the new one


@pytest.mark.parametrize("over, message", [
    ({"forward_s_per_sample": -1e-6}, "a pipeline unit: forward_s_per_sample -1e-06 is not a finite number >= 0"),
    ({"backward_s_per_sample": math.nan}, "a pipeline unit: backward_s_per_sample nan is not a finite number >= 0"),
    ({"forward_intercept_s": math.inf}, "a pipeline unit: forward_intercept_s inf is not a finite number >= 0"),
    ({"backward_intercept_s": "0.1"}, "a pipeline unit: backward_intercept_s '0.1' is not a finite number >= 0"),
    ({"param_bytes": 1.5}, "a pipeline unit: param_bytes 1.5 is not a whole number >= 0"),
    ({"activation_bytes_per_sample": True}, "a pipeline unit: activation_bytes_per_sample True is not a whole number"),
    ({"held_bytes_per_sample": -4}, "a pipeline unit: held_bytes_per_sample -4 is not a whole number >= 0"),
    ({"name": ""}, "a pipeline unit: name '' is not a short string"),
    ({"name": "x" * 201}, "a pipeline unit: name 'xxxx"),
])
def test_a_malformed_unit_is_refused_naming_the_field(over: dict[str, Any], message: str) -> None:
    with pytest.raises(DecodeError) as refused:
        ProfileReport.from_wire(_data(**over))
    assert message in str(refused.value)


def test_a_missing_figure_or_a_malformed_list_is_refused() -> None:
    data = REPORT.to_wire()
    del data["units"][0]["held_bytes_per_sample"]
    with pytest.raises(DecodeError, match="held_bytes_per_sample None is not a whole number"):
        ProfileReport.from_wire(data)
    with pytest.raises(DecodeError, match="a pipeline unit is a list, not a map"):
        ProfileReport.from_wire(BARE.to_wire() | {"units": [[1, 2]]})
    with pytest.raises(DecodeError, match=f"units is not a list of at most {MAX_UNITS} pipeline units"):
        ProfileReport.from_wire(BARE.to_wire() | {"units": {"net.0": _unit("net.0").to_wire()}})
    with pytest.raises(DecodeError, match=f"units is not a list of at most {MAX_UNITS} pipeline units"):
        ProfileReport.from_wire(BARE.to_wire() | {"units": [_unit(f"u{i}").to_wire() for i in range(MAX_UNITS + 1)]})
    most = BARE.to_wire() | {"units": [_unit(f"u{i}").to_wire() for i in range(MAX_UNITS)]}
    assert len(ProfileReport.from_wire(most).units) == MAX_UNITS
