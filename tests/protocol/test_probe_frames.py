"""The link probe's frames: round trips, malformed fields refused, and a peer of another version told which side to upgrade."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.framing import decode_frame, encode_frame
from edgefleet.protocol.jobs import MAX_PROBE_BYTES
from edgefleet.protocol.probe_frames import (
    PROBE_VERSION,
    Aggregate,
    Done,
    Down,
    End,
    Go,
    Got,
    ProbeHello,
    ProbeRefusal,
    ProbeRound,
    ProbeVersionError,
    decode_probe_frame,
    frame_name,
)


def _wire(frame: Any) -> dict[str, Any]:
    joined = b"".join(bytes(segment) for segment in encode_frame(frame.to_wire()))
    (size,) = struct.unpack(">I", joined[:4])
    return decode_frame(memoryview(bytearray(joined[4:4 + size])))


def _hello(**over: Any) -> dict[str, Any]:
    return _wire(ProbeHello(job_id="p-0", board_id="b1", token="secret", nbytes=1000, round_bytes=0, rounds=0)) | over


@pytest.mark.parametrize("frame", [
    ProbeHello(job_id="p-0", board_id="b1", token="secret", nbytes=1000, round_bytes=250, rounds=5),
    ProbeHello(job_id="p-1", board_id="b1", token="secret", nbytes=0, round_bytes=250, rounds=2),
    Go(), Got(), Down(), End(), Aggregate(), Done(), ProbeRefusal("wrong profile job or token"),
])
def test_every_frame_round_trips(frame: Any) -> None:
    assert decode_probe_frame(_wire(frame)) == frame
    assert frame_name(frame) == _wire(frame)["type"]


def test_a_round_carries_its_payload_and_must_be_the_size_announced() -> None:
    back = decode_probe_frame(_wire(ProbeRound(bytes(300))), round_bytes=300)
    assert isinstance(back, ProbeRound) and bytes(back.data) == bytes(300)
    with pytest.raises(DecodeError, match="a round of 300 bytes, expected 200"):
        ProbeRound.from_wire(_wire(ProbeRound(bytes(300))), round_bytes=200)
    with pytest.raises(DecodeError, match="a round of str bytes"):
        ProbeRound.from_wire({"type": "round", "data": "x"}, round_bytes=1)


def test_the_token_stays_out_of_the_repr_and_is_compared_in_constant_time() -> None:
    hello = ProbeHello.from_wire(_hello(token="sécret"))
    assert "sécret" not in repr(hello) and hello.presents("sécret") and not hello.presents("secret")


@pytest.mark.parametrize("over, message", [
    ({"bytes": -1}, f"bytes must be 0-{MAX_PROBE_BYTES}"),
    ({"bytes": MAX_PROBE_BYTES + 1}, f"bytes must be 0-{MAX_PROBE_BYTES}"),
    ({"round_bytes": "10"}, f"round_bytes must be 0-{MAX_PROBE_BYTES}"),
    ({"rounds": 3}, "more than 0 exactly when round_bytes is"),
    ({"rounds": 1, "round_bytes": 10}, "rounds must be 0 or 2-1000"),
    ({"bytes": 0}, "nothing to measure: bytes and rounds are both 0"),
    ({"board_id": None}, "probe-hello: board_id None is not a string"),
    ({"v": None}, "probe-hello names no link probe version"),
    ({"type": "go"}, "link probe: expected a probe-hello frame, got 'go'"),
])
def test_a_malformed_hello_names_the_field(over: dict[str, Any], message: str) -> None:
    with pytest.raises(DecodeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ProbeHello.from_wire(_hello(**over))


def test_unknown_or_untyped_frames_are_refused() -> None:
    with pytest.raises(DecodeError, match="unknown frame type 'up'"):
        decode_probe_frame({"type": "up"})
    with pytest.raises(DecodeError, match="without a str type"):
        decode_probe_frame({"message": "x"})
    with pytest.raises(DecodeError, match="message 3 is not a string"):
        decode_probe_frame({"type": "error", "message": 3})


@pytest.mark.parametrize("version, upgrade", [(PROBE_VERSION + 1, "upgrade edge-coordinator"),
                                              (PROBE_VERSION - 1, "upgrade edge-agent on board b1")])
def test_a_hello_of_another_version_says_which_side_to_upgrade(version: int, upgrade: str) -> None:
    with pytest.raises(ProbeVersionError) as refused:
        ProbeHello.from_wire(_hello(v=version))
    assert str(refused.value) == f"board b1 speaks link probe protocol {version}, this coordinator {PROBE_VERSION}: {upgrade}"


@pytest.mark.parametrize("version, upgrade", [(PROBE_VERSION + 1, "upgrade edge-agent on this board"),
                                              (PROBE_VERSION - 1, "upgrade edge-coordinator")])
def test_a_go_of_another_version_says_which_side_to_upgrade(version: int, upgrade: str) -> None:
    with pytest.raises(ProbeVersionError) as refused:
        decode_probe_frame(_wire(Go(v=version)))
    assert str(refused.value) == f"the coordinator speaks link probe protocol {version}, this board {PROBE_VERSION}: {upgrade}"
    assert Go.from_wire({"type": "go"}) == Go()  # a go without v is version 2
