from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.signing import CommandVerifier, SignatureError, sign_command
from edgefleet.transport.fleet_key import load_fleet_key

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
T0 = 1_700_000_000.0
COMMAND = {"type": "train", "job": "mnist-3", "boards": ["pi-1", "orin-2"], "batch": {"pi-1": 16, "orin-2": 48}}


class FakeClock:
    """Unix time that moves only when the test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _verifier(clock: FakeClock | None = None, **kwargs: Any) -> CommandVerifier:
    return CommandVerifier(KEY, clock=clock or FakeClock(), **kwargs)


def _rebuild(payload: bytes, **over: Any) -> bytes:
    envelope = msgpack.unpackb(payload)
    return msgpack.packb({**envelope, **over})


def test_a_valid_command_verifies_and_returns_its_body() -> None:
    body = _verifier(FakeClock(T0 + 2)).verify(sign_command(COMMAND, key=KEY, now=T0))
    assert {k: v for k, v in body.items() if k not in ("ts", "nonce")} == COMMAND
    assert body["ts"] == T0
    assert len(body["nonce"]) == 32 and int(body["nonce"], 16) >= 0


def test_envelope_has_the_documented_shape_and_a_canonical_body() -> None:
    reordered = {"boards": COMMAND["boards"], "batch": {"orin-2": 48, "pi-1": 16}, "job": "mnist-3", "type": "train"}
    envelopes = [msgpack.unpackb(sign_command(c, key=KEY, now=T0)) for c in (COMMAND, reordered)]
    for envelope in envelopes:
        assert set(envelope) == {"v", "alg", "body", "sig"}
        assert envelope["v"] == 1 and envelope["alg"] == "hmac-sha256" and len(envelope["sig"]) == 32
        body = msgpack.unpackb(envelope["body"])
        assert list(body) == sorted(body) and list(body["batch"]) == ["orin-2", "pi-1"]
    strip_nonce = [msgpack.unpackb(e["body"]) | {"nonce": ""} for e in envelopes]
    assert msgpack.packb(strip_nonce[0]) == msgpack.packb(strip_nonce[1])


@given(st.data())
def test_flipping_any_bit_is_refused(data: st.DataObject) -> None:
    payload = bytearray(sign_command(COMMAND, key=KEY, now=T0))
    bit = data.draw(st.integers(0, len(payload) * 8 - 1))
    payload[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(SignatureError):
        _verifier().verify(bytes(payload))


@pytest.mark.parametrize("part", ["body", "sig"])
def test_a_forged_body_or_signature_is_a_bad_signature(part: str) -> None:
    payload = sign_command(COMMAND, key=KEY, now=T0)
    original = bytearray(msgpack.unpackb(payload)[part])
    original[-1] ^= 0x01
    with pytest.raises(SignatureError, match="^bad signature"):
        _verifier().verify(_rebuild(payload, **{part: bytes(original)}))


def test_a_command_signed_with_another_key_is_a_bad_signature() -> None:
    with pytest.raises(SignatureError, match="^bad signature"):
        _verifier().verify(sign_command(COMMAND, key=OTHER_KEY, now=T0))


@pytest.mark.parametrize("payload, fragment", [
    (msgpack.packb(COMMAND), "expected keys ['alg', 'body', 'sig', 'v']"),
    (msgpack.packb([1, 2]), "got list"),
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),
    (b"\x80\x00", "not msgpack"),
    (b"\x00" * (300 * 1024), "over 262144"),
])
def test_unsigned_or_garbage_payloads_are_not_signed_commands(payload: bytes, fragment: str) -> None:
    with pytest.raises(SignatureError, match="^not a signed command") as excinfo:
        _verifier().verify(payload)
    assert fragment in str(excinfo.value)


@pytest.mark.parametrize("over, fragment", [
    ({"v": 2}, "envelope version 2"),
    ({"alg": "none"}, "algorithm 'none'"),
    ({"sig": "abc"}, "must be bin"),
])
def test_a_tampered_envelope_is_not_a_signed_command(over: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SignatureError, match="^not a signed command") as excinfo:
        _verifier().verify(_rebuild(sign_command(COMMAND, key=KEY, now=T0), **over))
    assert fragment in str(excinfo.value)


@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_verify_and_raise_only_signature_error(payload: bytes) -> None:
    with pytest.raises(SignatureError, match="^not a signed command|^bad signature"):
        _verifier().verify(payload)


def test_a_stale_command_names_its_age_the_limit_and_the_fix() -> None:
    with pytest.raises(SignatureError) as excinfo:
        _verifier(FakeClock(T0 + 31)).verify(sign_command(COMMAND, key=KEY, now=T0))
    assert str(excinfo.value) == "stale: issued 31.0 s ago (limit 30 s); check the clocks (NTP)"


def test_a_command_from_the_future_is_refused() -> None:
    with pytest.raises(SignatureError, match=r"^from the future: issued 45.0 s ahead .*limit 30 s.*NTP"):
        _verifier(FakeClock(T0 - 45)).verify(sign_command(COMMAND, key=KEY, now=T0))


@pytest.mark.parametrize("skew_s", [-30.0, 0.0, 30.0])
def test_commands_within_the_window_are_accepted(skew_s: float) -> None:
    assert _verifier(FakeClock(T0 + skew_s)).verify(sign_command(COMMAND, key=KEY, now=T0))["ts"] == T0


def test_a_replayed_command_is_refused_once_accepted() -> None:
    verifier = _verifier(FakeClock(T0 + 1))
    payload = sign_command(COMMAND, key=KEY, now=T0)
    verifier.verify(payload)
    with pytest.raises(SignatureError, match="^replayed nonce [0-9a-f]{32}"):
        verifier.verify(payload)


def test_a_forged_command_does_not_burn_its_nonce() -> None:
    verifier = _verifier()
    payload = sign_command(COMMAND, key=KEY, now=T0)
    with pytest.raises(SignatureError, match="^bad signature"):
        verifier.verify(_rebuild(payload, sig=bytes(32)))  # same body, same nonce, forged signature
    assert verifier.verify(payload)["type"] == "train"


def test_nonces_are_forgotten_once_their_commands_would_be_stale() -> None:
    clock = FakeClock()
    verifier = _verifier(clock, nonce_capacity=3)
    old = [sign_command(COMMAND, key=KEY, now=T0) for _ in range(3)]
    for payload in old:
        verifier.verify(payload)
    with pytest.raises(SignatureError, match="^nonce cache full: 3 commands within 30 s"):
        verifier.verify(sign_command(COMMAND, key=KEY, now=T0))

    clock.now = T0 + 30.5
    assert verifier.verify(sign_command(COMMAND, key=KEY, now=clock.now))["type"] == "train"
    with pytest.raises(SignatureError, match="^stale"):
        verifier.verify(old[0])


def test_a_signed_body_with_a_non_finite_ts_is_refused() -> None:
    payload = sign_command(COMMAND, key=KEY, now=float("nan"))
    with pytest.raises(SignatureError, match="finite numeric ts"):
        _verifier().verify(payload)


def test_signing_refuses_reserved_keys_and_short_keys() -> None:
    with pytest.raises(ValueError, match=r"\['nonce', 'ts'\] are reserved"):
        sign_command({"type": "x", "ts": 1, "nonce": "n"}, key=KEY)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        sign_command(COMMAND, key=b"short")
    with pytest.raises(ValueError, match="at least 32 bytes"):
        CommandVerifier(b"\x00" * 31)


# --- key files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, expected", [
    (KEY.hex().encode() + b"\n", KEY),
    (b"  " + KEY.hex().upper().encode() + b"\r\n", KEY),
    (b"\x00\xff" * 20, b"\x00\xff" * 20),
    (b"raw key material of 33 bytes!!!\n", b"raw key material of 33 bytes!!!\n"),
])
def test_key_files_hold_hex_or_raw_bytes(tmp_path: Path, content: bytes, expected: bytes) -> None:
    path = tmp_path / "fleet.key"
    path.write_bytes(content)
    path.chmod(0o600)
    assert load_fleet_key(path) == expected


@pytest.mark.parametrize("content, fragment", [
    (b"ab" * 31, "31 bytes, need at least 32"),
    (b"a" * 65, "odd number"),
    (b"too short\n", "10 bytes, need at least 32"),
    (b"", "0 bytes"),
])
def test_bad_key_files_name_the_path_and_the_fix(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "fleet.key"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as excinfo:
        load_fleet_key(path)
    message = str(excinfo.value)
    assert str(path) in message and fragment in message
    assert "python -m edgefleet.transport.fleet_key --generate > fleet.key" in message


def test_a_missing_key_file_names_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fleet.key: No such file.*--generate"):
        load_fleet_key(tmp_path / "fleet.key")


def test_a_world_readable_key_is_loaded_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "fleet.key"
    path.write_text(KEY.hex())
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="edgefleet.transport.fleet_key"):
        assert load_fleet_key(path) == KEY
    assert f"chmod 600 {path}" in caplog.text


def test_generated_key_loads_and_signs(tmp_path: Path) -> None:
    # The legacy kind; the default, an Ed25519 key file, is tests/protocol/test_signing_ed25519.py's.
    out = subprocess.run([sys.executable, "-m", "edgefleet.transport.fleet_key", "--generate", "--legacy-hmac"],
                         capture_output=True, text=True, check=True, cwd=os.getcwd()).stdout
    assert len(out.strip()) == 64
    path = tmp_path / "fleet.key"
    path.write_text(out)
    key = load_fleet_key(path)
    assert len(key) == 32
    assert CommandVerifier(key, clock=FakeClock()).verify(sign_command(COMMAND, key=key, now=T0))["job"] == "mnist-3"


def test_the_module_without_arguments_says_what_to_do() -> None:
    result = subprocess.run([sys.executable, "-m", "edgefleet.transport.fleet_key"], capture_output=True, text=True)
    assert result.returncode == 2 and "--generate" in result.stderr


def test_a_refusal_says_whether_the_sender_should_hear_it_and_where_it_would_go() -> None:
    from edgefleet.protocol.signing import unverified_address

    key, other = b"k" * 32, b"o" * 32
    verifier = CommandVerifier(key, max_age_s=30.0)
    command = {"job_id": "job-1", "board_id": "pi-1", "type": "train"}
    signed = sign_command(command, key=key)
    verifier.verify(signed)
    told = {}
    for name, payload in (("replayed", signed), ("forged", sign_command(command, key=other)),
                          ("stale", sign_command(command, key=key, now=time.time() - 3600)),
                          ("garbage", b"\x93\x01\x02\x03")):
        with pytest.raises(SignatureError) as refused:
            verifier.verify(payload)
        told[name] = refused.value.tell_sender
    assert told == {"replayed": False, "forged": True, "stale": True, "garbage": False}
    # The ids a command claims, read without trusting it (only to address a refusal); None for junk.
    assert unverified_address(sign_command(command, key=other)) == ("job-1", "pi-1")
    assert unverified_address(b"\x93\x01\x02\x03") is None
    assert unverified_address(sign_command({"job_id": 7, "board_id": "pi-1"}, key=key)) is None
