"""Every JSON message from a board is decoded under a size, a depth and a physical-range limit."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from edgefleet.agent.caps import read_caps
from edgefleet.agent.sensors.sampler import Sampler
from edgefleet.protocol import _validate
from edgefleet.protocol._validate import MAX_JSON_BYTES, MAX_JSON_DEPTH, json_depth, load_json
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.topics import parse_board_topic
from tests.hostile.mqtt_payloads import ABSURD_TELEMETRY, HUGE_INT, NESTED_100K, NESTED_OBJECTS, NESTED_VALID_60K, telemetry

P = "edgefleet/v1"


@pytest.mark.parametrize("cls", [TelemetrySample, BoardStatus, BoardCaps])
@pytest.mark.parametrize("payload, fragment", [
    (NESTED_100K, f"over the limit of {MAX_JSON_BYTES}"),
    (NESTED_VALID_60K, f"nested 30000 deep, over the limit of {MAX_JSON_DEPTH}"),
    (NESTED_OBJECTS, f"nested 5000 deep, over the limit of {MAX_JSON_DEPTH}"),
], ids=["100KB-arrays", "60KB-valid-arrays", "objects"])
def test_nested_json_is_refused_in_words_not_with_recursion_error(cls: Any, payload: bytes, fragment: str) -> None:
    # Before the limits, json.loads raised RecursionError (not a DecodeError) on these.
    with pytest.raises(DecodeError, match=fragment):
        cls.from_json(payload)


def test_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, {"c": "\\"]]]"}]}') == 3
    assert json_depth(b"[]" * 1000) == 1
    # Few brackets but all in strings: the fast path and the exact one agree that it is flat.
    assert load_json(json.dumps({"k": "[" * 50}).encode(), what="t") == {"k": "[" * 50}


def test_depth_scan_is_cheap_on_the_largest_hostile_payload() -> None:
    payload = b'"' + b"\\[" * (MAX_JSON_BYTES // 2 - 1)  # one unterminated string of escapes: a linear scan
    started = time.perf_counter()
    with pytest.raises(DecodeError):
        load_json(payload + b"[" * 20, what="t")
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("field, value", ABSURD_TELEMETRY, ids=[f"{f}={v!r:.20}" for f, v in ABSURD_TELEMETRY])
def test_a_value_no_board_can_report_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(DecodeError) as refused:
        TelemetrySample.from_json(telemetry("pi-1", **{field: value}))
    message = str(refused.value)
    assert f"'{field}'" in message and "TelemetrySample" in message
    assert len(message) < 300  # never the 400 digits, never the 10,000 characters


def test_memory_used_cannot_exceed_the_total() -> None:
    with pytest.raises(DecodeError, match="'mem_used_bytes' = 9000000000 is more than mem_total_bytes"):
        TelemetrySample.from_json(telemetry("pi-1", mem_used_bytes=9_000_000_000))


@pytest.mark.parametrize("cls, payload, field", [
    (BoardStatus, {"state": "online", "interval_s": 1e308}, "interval_s"),
    (BoardStatus, {"state": "online", "keepalive_s": -1}, "keepalive_s"),
    (BoardStatus, {"state": "offline", "reason": "x" * 1000}, "reason"),
    (BoardStatus, {"state": "offline", "reason": "stopped\r\x1b[31m"}, "reason"),
    (BoardCaps, {"board_id": "pi-1", "hostname": "h", "model": "m", "machine": "aarch64", "cores": HUGE_INT,
                 "ram_bytes": 1}, "cores"),
    (BoardCaps, {"board_id": "pi-1", "hostname": "h", "model": "m", "machine": "aarch64", "cores": 4,
                 "ram_bytes": -1}, "ram_bytes"),
])
def test_status_and_caps_are_range_checked_too(cls: Any, payload: dict[str, Any], field: str) -> None:
    with pytest.raises(DecodeError, match=f"'{field}'"):
        cls.from_json(json.dumps(payload))


def test_every_number_and_text_of_every_board_message_has_a_bound() -> None:
    for cls in (TelemetrySample, BoardStatus, BoardCaps):
        bounds = _validate._BOUNDS[cls]
        for f in dataclasses.fields(cls):
            if str(f.type) not in ("bool", "bool | None"):
                assert f.name in bounds, f"{cls.__name__}.{f.name} has no bound"


def test_what_a_real_agent_samples_on_this_machine_passes_the_limits() -> None:
    sampler = Sampler(board_id="pi-1", interval_s=0.2, sysfs_root=Path("/sys"), net_interfaces=(),
                      power_kind="estimated", idle_w=2.0, max_w=6.0)
    try:
        first = sampler.read()
        samples = [first, sampler.read()]
    finally:
        sampler.close()
    for sample in samples:
        assert TelemetrySample.from_json(sample.to_json()) == sample
    caps = read_caps("pi-1", first.power_source, Path("/sys"))
    assert BoardCaps.from_json(caps.to_json()) == caps


@pytest.mark.parametrize("level", ["[bold]x", "a b", "x" * 64, "-lead", "é"])
def test_a_topic_level_that_is_no_board_id_is_not_a_board(level: str) -> None:
    assert parse_board_topic(P, f"{P}/boards/{level}/telemetry") is None
    assert parse_board_topic(P, f"{P}/boards/pi-1/telemetry") is not None
