from __future__ import annotations

import json

import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample, is_measured
from edgefleet.protocol.topics import fleet_filter, parse_board_topic, status_topic, telemetry_topic, valid_board_id, valid_prefix


def _sample(**over: object) -> TelemetrySample:
    base = dict(board_id="pi-1", ts=1.5, seq=3, interval_s=1.0, cpu_percent=12.5, mem_total_bytes=4_000_000_000,
                power_w=3.2, power_source="estimated", temps_c={"cpu-thermal": 48.3}, cpu_percent_per_core=[10.0, 15.0])
    base.update(over)
    return TelemetrySample(**base)  # type: ignore[arg-type]


def test_telemetry_round_trip_keeps_every_field() -> None:
    sample = _sample()
    assert TelemetrySample.from_json(sample.to_json()) == sample


def test_telemetry_keys_carry_units_as_designed() -> None:
    keys = json.loads(_sample().to_json())
    for key in ("cpu_percent", "mem_used_bytes", "net_rx_bytes_per_s", "power_w", "power_source", "temp_c", "ts"):
        assert key in keys


@pytest.mark.parametrize("payload, fragment", [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"ts": 1, "seq": 1, "interval_s": 1}', "'board_id' is missing"),
    (b'{"board_id": "a", "ts": "noon", "seq": 1, "interval_s": 1}', "'ts' should be float"),
    (b'{"board_id": "a", "ts": 1, "seq": true, "interval_s": 1}', "'seq' should be int"),
    (b'{"board_id": "a", "ts": 1, "seq": 1, "interval_s": 1, "temps_c": {"x": "hot"}}', "'temps_c'"),
    (b'{"board_id": "a", "ts": 1, "seq": 1, "interval_s": 1, "schema_version": 99}', "newer"),
    (b'\xff\xfe', "not valid JSON"),
])
def test_malformed_telemetry_raises_decode_error_naming_the_problem(payload: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment.replace("(", r"\(")):
        TelemetrySample.from_json(payload)


def test_unknown_keys_from_a_newer_agent_are_ignored() -> None:
    data = json.loads(_sample().to_json()) | {"gpu_percent": 40}
    assert TelemetrySample.from_json(json.dumps(data)).cpu_percent == 12.5


def test_status_rejects_unknown_state_and_nan() -> None:
    with pytest.raises(DecodeError, match="state"):
        BoardStatus.from_json(b'{"state": "sleeping"}')
    with pytest.raises(DecodeError, match="ts"):
        BoardStatus.from_json(b'{"state": "online", "ts": NaN}')
    assert BoardStatus.from_json(BoardStatus(state="offline", reason="stopped").to_json()).reason == "stopped"


def test_caps_round_trip() -> None:
    caps = BoardCaps(board_id="orin-1", hostname="orin", model="NVIDIA Jetson Orin Nano", machine="aarch64",
                     cores=6, ram_bytes=8 << 30, accelerator="jetson-igpu", power_source="ina3221")
    assert BoardCaps.from_json(caps.to_json()) == caps


def test_estimates_are_never_measurements() -> None:
    assert not is_measured("estimated") and not is_measured("none")
    assert is_measured("hwmon:ina219") and is_measured("rpi5-pmic") and is_measured("jtop")


def test_topics() -> None:
    assert status_topic("edgefleet/v1", "pi-1") == "edgefleet/v1/boards/pi-1/status"
    assert fleet_filter("p", "telemetry") == "p/boards/+/telemetry"
    parsed = parse_board_topic("edgefleet/v1", telemetry_topic("edgefleet/v1", "pi-1"))
    assert parsed is not None and (parsed.board_id, parsed.kind) == ("pi-1", "telemetry")
    assert parse_board_topic("edgefleet/v1", "edgefleet/v1/boards/pi-1/other") is None
    assert parse_board_topic("edgefleet/v1", "other/boards/pi-1/status") is None
    assert valid_board_id("pi-1") and not valid_board_id("pi/1") and not valid_board_id("+") and not valid_board_id("")
    assert not valid_board_id("pi-1\n"), "a trailing newline is not part of an id (issue 36: the agent looped on protocol errors)"
    assert valid_prefix("a/b") and not valid_prefix("a/#") and not valid_prefix("/a") and not valid_prefix("a//b")
