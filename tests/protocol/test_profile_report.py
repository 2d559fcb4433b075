"""The profile report a board's profile job sends: round trips through a job event, malformed fields refused,
and a report of another version refused naming the side to upgrade (by the coordinator, which reads it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from edgefleet.coordinator.planning.profiling import ProfileFailed, read_report
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.profile_report import (
    PROFILE_REPORT_VERSION,
    LinkReport,
    MeasuredPoint,
    ProfileReport,
    ProfileReportVersionError,
    RoundsReport,
)


def _point(batch_size: int) -> MeasuredPoint:
    return MeasuredPoint(batch_size=batch_size, step_time_s=0.01 * batch_size, step_time_min_s=0.009 * batch_size,
                         step_time_max_s=0.012 * batch_size, step_time_spread_s=0.001, samples_per_s=100.0,
                         peak_memory_bytes=400_000_000, power_w=5.5)


LINK = LinkReport(up_bytes_per_s=1.2e7, down_bytes_per_s=1.1e7, nbytes=4_000_000, power_w=None)
REPORT = ProfileReport(agent_version="0.1.0", worker_pid=1234, torch_threads=2, param_count=61_706,
                       points=(_point(8), _point(16)), active_power_w=5.5, idle_power_w=2.7, power_source="estimated",
                       memory_total_bytes=4_000_000_000,
                       link=LINK,
                       link_rounds=RoundsReport(round_bytes=246_824, rounds=16, round_s=0.021, power_w=4.25))


def _data(**over: Any) -> dict[str, Any]:
    return REPORT.to_wire() | over


def test_a_report_round_trips_through_the_event_that_carries_it() -> None:
    event = JobEvent(job_id="p-0", board_id="b1", phase="finished", data=REPORT.to_wire())
    assert ProfileReport.from_wire(JobEvent.from_msgpack(event.to_msgpack()).data) == REPORT
    bare = dataclasses.replace(REPORT, link=None, link_rounds=None)
    assert ProfileReport.from_wire(bare.to_wire()) == bare


def test_points_come_back_in_ascending_batch_size() -> None:
    data = _data(points=[_point(32).to_wire(), _point(4).to_wire()])
    assert [p.batch_size for p in ProfileReport.from_wire(data).points] == [4, 32]


def test_a_report_without_a_version_is_version_1() -> None:
    data = _data()
    del data["v"]
    assert ProfileReport.from_wire(data) == REPORT and PROFILE_REPORT_VERSION == 1


@pytest.mark.parametrize("over, message", [
    ({"points": []}, "points is not a list of 1-64 batch sizes"),
    ({"points": [{"batch_size": 0}]}, "a profile point: batch_size 0 is not a whole number >= 1"),
    ({"points": [_point(8).to_wire() | {"step_time_s": float("nan")}]}, "step_time_s nan is not a finite number > 0"),
    ({"points": [_point(8).to_wire() | {"power_w": None}]}, "a profile point: power_w None is not a finite number >= 0"),
    ({"param_count": "61706"}, "param_count '61706' is not a whole number >= 0"),
    ({"agent_version": ""}, "agent_version '' is not a short string"),
    ({"link": [1, 2]}, "the link report is a list, not a map"),
    ({"link": LINK.to_wire() | {"up_bytes_per_s": 0}}, "up_bytes_per_s 0 is not a finite number > 0"),
    ({"link_rounds": {"round_bytes": 10, "rounds": 2}}, "the link rounds report: round_s None"),
    ({"v": "2"}, "the profile report names no version"),
])
def test_a_malformed_report_names_the_field(over: dict[str, Any], message: str) -> None:
    with pytest.raises(DecodeError) as refused:
        ProfileReport.from_wire(_data(**over))
    assert message in str(refused.value)


@pytest.mark.parametrize("version, upgrade", [(2, "upgrade edge-coordinator"), (0, "upgrade edge-agent on the board")])
def test_a_report_of_another_version_is_refused_naming_the_side_to_upgrade(version: int, upgrade: str) -> None:
    message = f"the board reports its profile in version {version}, this coordinator reads 1: {upgrade}"
    with pytest.raises(ProfileReportVersionError, match=f"^{message}$"):
        ProfileReport.from_wire(_data(v=version))
    with pytest.raises(ProfileFailed, match=f"^board b1, lenet5: {message}$"):
        read_report("b1", "lenet5", _data(v=version))


def test_the_coordinator_reads_a_report_or_fails_the_board_with_what_is_wrong() -> None:
    assert read_report("b1", "lenet5", _data()) == REPORT
    with pytest.raises(ProfileFailed, match=r"board b1 sent an unreadable profile of lenet5 \(the profile report: "
                                            r"torch_threads 0 is not a whole number >= 1\); run the same edgefleet"):
        read_report("b1", "lenet5", _data(torch_threads=0))
