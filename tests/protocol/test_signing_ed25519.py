"""Ed25519 commands, the key files that say what they hold, the nonce record on disk, and signed job events.

Every test here fails on the HMAC-only code: it has no Ed25519 envelope, no key file lines, no nonce
record and no event signatures.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgefleet.agent.nonce_file import NonceFile
from edgefleet.protocol.errors import ConfigError, DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.signing import (
    CommandKeys,
    CommandVerifier,
    CoordinatorKeys,
    EventSigner,
    SignatureError,
    check_event_signature,
    ed25519_public_key,
    sign_command,
    unverified_address,
)
from edgefleet.transport import fleet_key
from edgefleet.transport.fleet_key import (
    add_board_keys,
    load_board_key,
    load_board_keys,
    load_command_keys,
    load_fleet_key,
    private_key_text,
    public_key_text,
    read_key_file,
)

SEED = bytes(range(32))
OTHER_SEED = bytes(range(1, 33))
PUBLIC = ed25519_public_key(SEED)
T0 = 1_700_000_000.0
COMMAND = {"kind": "train", "job_id": "job-1", "board_id": "pi-1", "batch": {"pi-1": 16}}


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _coordinator(seed: bytes = SEED) -> bytes:
    return CoordinatorKeys("ed25519", seed).to_bytes()


def _board(clock: FakeClock | None = None, *publics: bytes, **kwargs: Any) -> CommandVerifier:
    return CommandVerifier(CommandKeys(public_keys=publics or (PUBLIC,), source="fleet.pub"), clock=clock or FakeClock(),
                           **kwargs)


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# --- the envelope --------------------------------------------------------------------------------


def test_an_ed25519_command_has_the_version_2_envelope_and_verifies() -> None:
    payload = sign_command(COMMAND, key=_coordinator(), now=T0)
    envelope = msgpack.unpackb(payload)
    assert set(envelope) == {"v", "alg", "body", "sig"}
    assert envelope["v"] == 2 and envelope["alg"] == "ed25519" and len(envelope["sig"]) == 64
    body = _board(FakeClock(T0 + 1)).verify(payload)
    assert {k: v for k, v in body.items() if k not in ("ts", "nonce")} == COMMAND
    assert unverified_address(payload) == ("job-1", "pi-1")


def test_any_of_several_public_keys_verifies_during_a_rotation() -> None:
    verifier = _board(FakeClock(T0), ed25519_public_key(OTHER_SEED), PUBLIC)
    assert verifier.verify(sign_command(COMMAND, key=_coordinator(SEED), now=T0))["job_id"] == "job-1"
    assert verifier.verify(sign_command(COMMAND, key=_coordinator(OTHER_SEED), now=T0))["job_id"] == "job-1"


def test_a_board_s_key_cannot_command_another_board() -> None:
    # What a stolen board holds: the coordinator's public key and its own private key. Neither signs.
    with pytest.raises(SignatureError, match="^bad signature: not signed by the coordinator key") as refused:
        _board().verify(sign_command(COMMAND, key=_coordinator(OTHER_SEED), now=T0))
    assert refused.value.tell_sender and "--public" in refused.value.hint


@given(st.data())
def test_flipping_any_bit_of_an_ed25519_command_is_refused(data: st.DataObject) -> None:
    payload = bytearray(sign_command(COMMAND, key=_coordinator(), now=T0))
    bit = data.draw(st.integers(0, len(payload) * 8 - 1))
    payload[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(SignatureError):
        _board().verify(bytes(payload))


def test_a_legacy_command_to_an_ed25519_board_and_the_reverse_name_the_side_to_change() -> None:
    with pytest.raises(SignatureError, match="^key mismatch: the command is signed with a shared HMAC") as refused:
        _board().verify(sign_command(COMMAND, key=b"k" * 32, now=T0))
    assert refused.value.tell_sender and "--fleet-key" in refused.value.hint
    legacy = CommandVerifier(b"k" * 32, clock=FakeClock())
    with pytest.raises(SignatureError, match="^key mismatch: the command is signed with an Ed25519 key") as refused:
        legacy.verify(sign_command(COMMAND, key=_coordinator(), now=T0))
    assert refused.value.tell_sender and "--public" in refused.value.hint
    # The legacy pair still works, and says what the old code said.
    assert legacy.verify(sign_command(COMMAND, key=b"k" * 32, now=T0))["job_id"] == "job-1"


def test_a_newer_envelope_asks_to_upgrade_the_board_and_is_told_to_the_sender() -> None:
    envelope = msgpack.unpackb(sign_command(COMMAND, key=_coordinator(), now=T0))
    with pytest.raises(SignatureError, match="envelope version 3.*upgrade edgefleet on this board") as refused:
        _board().verify(msgpack.packb({**envelope, "v": 3}))
    assert refused.value.tell_sender
    with pytest.raises(SignatureError, match="envelope version 2 with algorithm 'hmac-sha256'"):
        _board().verify(msgpack.packb({**envelope, "alg": "hmac-sha256"}))


def test_coordinator_keys_round_trip_and_never_show_the_secret() -> None:
    keys = CoordinatorKeys("ed25519", SEED).with_board_keys({"pi-1": (PUBLIC,)}, "keys/")
    back = CoordinatorKeys.from_bytes(keys.to_bytes())
    assert (back.algorithm, back.secret, dict(back.board_keys or {}), back.board_keys_source) == \
        ("ed25519", SEED, {"pi-1": (PUBLIC,)}, "keys/")
    assert SEED.hex() not in repr(back) and repr(SEED) not in repr(back)
    assert CoordinatorKeys.from_bytes(b"k" * 32).algorithm == "hmac-sha256"
    assert CoordinatorKeys("hmac-sha256", b"k" * 32).to_bytes() == b"k" * 32  # a legacy key alone stays itself


# --- the nonce record ----------------------------------------------------------------------------


def test_a_restarted_verifier_refuses_a_command_accepted_before_the_restart(tmp_path: Path) -> None:
    record = tmp_path / "nonces.json"
    payload = sign_command(COMMAND, key=_coordinator(), now=T0)
    _board(FakeClock(T0 + 1), nonce_file=NonceFile(record)).verify(payload)
    # Written before verify() returned, i.e. before the command is acted on.
    saved = json.loads(record.read_text())
    assert saved["version"] == 1 and [n for _, n in saved["nonces"]] == [msgpack.unpackb(msgpack.unpackb(payload)["body"])["nonce"]]
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and not (tmp_path / ".nonces.json.tmp").exists()
    with pytest.raises(SignatureError, match="^replayed nonce"):
        _board(FakeClock(T0 + 5), nonce_file=NonceFile(record)).verify(payload)


def test_nonces_past_the_window_are_dropped_from_the_record(tmp_path: Path) -> None:
    record = tmp_path / "nonces.json"
    clock = FakeClock(T0)
    verifier = _board(clock, nonce_file=NonceFile(record))
    verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0))
    clock.now = T0 + 40
    verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0 + 40))
    saved = json.loads(record.read_text())
    assert len(saved["nonces"]) == 1 and saved["horizon"] == T0  # complete from the forgotten one's ts on


def test_a_widened_window_after_a_restart_does_not_reopen_forgotten_commands(tmp_path: Path) -> None:
    record = tmp_path / "nonces.json"
    clock = FakeClock(T0)
    old = sign_command(COMMAND, key=_coordinator(), now=T0)
    verifier = _board(clock, nonce_file=NonceFile(record))
    verifier.verify(old)
    clock.now = T0 + 40
    verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0 + 40))  # forgets the first one
    widened = _board(FakeClock(T0 + 41), max_age_s=300, nonce_file=NonceFile(record))
    with pytest.raises(SignatureError, match="^possibly replayed"):
        widened.verify(old)


@pytest.mark.parametrize("content", [b"garbage", b'{"version": 9}', b'{"version": 1, "horizon": null, "nonces": [[1, "xyz"]]}',
                                     b"\xff\xfe"])
def test_an_unusable_record_refuses_commands_older_than_the_start_for_one_window(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    record = tmp_path / "nonces.json"
    record.write_bytes(content)
    clock = FakeClock(T0)
    with caplog.at_level(logging.WARNING, logger="edgefleet.protocol.signing"):
        verifier = _board(clock, nonce_file=NonceFile(record))
    assert f"the command nonce record {record} cannot be used" in caplog.text and "refused for the next 30 s" in caplog.text
    clock.now = T0 + 2
    with pytest.raises(SignatureError, match="^possibly replayed: issued 3.0 s ago, before this agent restarted") as refused:
        verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0 - 1))  # a capture from before the start
    assert refused.value.tell_sender
    assert verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0 + 1))["job_id"] == "job-1"
    assert json.loads(record.read_text())["horizon"] == T0  # rewritten; the next start keeps the horizon


def test_a_command_that_cannot_be_recorded_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with caplog.at_level(logging.ERROR, logger="edgefleet.protocol.signing"):
        verifier = _board(FakeClock(T0), nonce_file=NonceFile(blocker / "nonces.json"))
    assert "every command will be refused" in caplog.text and "Not a directory" in caplog.text
    with pytest.raises(SignatureError, match="^nonce record: cannot write .*Make the agent's state_dir writable") as refused:
        verifier.verify(sign_command(COMMAND, key=_coordinator(), now=T0 + 1))
    assert refused.value.tell_sender


# --- key files -----------------------------------------------------------------------------------


def test_generate_public_and_load_on_both_sides(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "edgefleet.transport.fleet_key"]
    private = _write(tmp_path / "fleet.key", subprocess.run([*run, "--generate"], capture_output=True, text=True,
                                                             check=True).stdout)
    assert read_key_file(private).kind == "ed25519-private" and "ed25519-private " in private.read_text()
    public = tmp_path / "fleet.pub"
    public.write_text(subprocess.run([*run, "--public", str(private)], capture_output=True, text=True, check=True).stdout)
    assert public.read_text().startswith("ed25519-public ") and len(public.read_text().split()) == 2
    command = sign_command(COMMAND, key=load_fleet_key(private))
    assert CommandVerifier(load_command_keys(public)).verify(command)["job_id"] == "job-1"


def test_output_creates_a_private_file_and_never_overwrites(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "edgefleet.transport.fleet_key", "--generate", "--output", str(tmp_path / "board.key")]
    subprocess.run(run, check=True)
    first = (tmp_path / "board.key").read_text()
    assert stat.S_IMODE((tmp_path / "board.key").stat().st_mode) == 0o600
    again = subprocess.run(run, capture_output=True, text=True)
    assert again.returncode == 1 and "exists" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "board.key").read_text() == first


def test_public_of_a_legacy_key_says_it_has_none(tmp_path: Path) -> None:
    legacy = _write(tmp_path / "legacy.key", "ab" * 32 + "\n")
    result = subprocess.run([sys.executable, "-m", "edgefleet.transport.fleet_key", "--public", str(legacy)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "has no public key" in result.stderr and "Traceback" not in result.stderr


def test_key_lines_take_comments_and_several_public_keys(tmp_path: Path) -> None:
    text = (f"# the coordinator's keys\ned25519-public {PUBLIC.hex()}   # current\n\n"
            f"ed25519-public {ed25519_public_key(OTHER_SEED).hex().upper()}\n")
    keys = load_command_keys(_write(tmp_path / "fleet.pub", text, 0o644))
    assert keys.public_keys == (PUBLIC, ed25519_public_key(OTHER_SEED)) and not keys.legacy


@pytest.mark.parametrize("text, fragment", [
    (f"ed25519-private {SEED.hex()}\ned25519-public {PUBLIC.hex()}\n", "holds both"),
    (f"ed25519-private {SEED.hex()}\ned25519-private {OTHER_SEED.hex()}\n", "2 ed25519-private lines"),
    (f"ed25519-public {PUBLIC.hex()[:-2]}\n", "line 1: expected"),
    (f"# ok\ned25519-secret {SEED.hex()}\n", "line 2: expected"),
    (f"ed25519-public {PUBLIC.hex()} extra\n", "line 1: expected"),
])
def test_malformed_key_lines_name_the_file_and_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = _write(tmp_path / "x.key", text)
    with pytest.raises(ConfigError) as info:
        read_key_file(path)
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_each_side_refuses_the_file_meant_for_the_other_or_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    private = _write(tmp_path / "fleet.key", private_key_text(SEED))
    public = _write(tmp_path / "fleet.pub", public_key_text(private), 0o644)
    with pytest.raises(ConfigError, match="holds public keys only.*private key file"):
        load_fleet_key(public)
    with caplog.at_level(logging.WARNING, logger="edgefleet.transport.fleet_key"):
        keys = load_command_keys(private)  # a board given the coordinator's private key: works, with a warning
    assert keys.public_keys == (PUBLIC,)
    assert "holds a private key" in caplog.text and "A board should hold only the public key" in caplog.text
    with pytest.raises(ConfigError, match="board_key_file .*holds public keys only"):
        load_board_key(public)
    assert load_board_key(private).public_key == PUBLIC


def test_a_legacy_key_warns_once_per_side_and_says_how_to_switch(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_key, "_warned", set())
    legacy = _write(tmp_path / "fleet.key", "ab" * 32 + "\n")
    with caplog.at_level(logging.WARNING, logger="edgefleet.transport.fleet_key"):
        for _ in range(3):
            assert load_fleet_key(legacy) == b"\xab" * 32
            assert load_command_keys(legacy).hmac_key == b"\xab" * 32
    coordinator = [r for r in caplog.records if "is a shared HMAC secret (legacy)" in r.message]
    board = [r for r in caplog.records if "is a shared HMAC fleet key (legacy)" in r.message]
    assert len(coordinator) == 1 and len(board) == 1
    for record in coordinator + board:
        assert "can command" in record.message and "--generate > fleet.key" in record.message and "--public fleet.key" in record.message


def test_board_keys_directory(tmp_path: Path) -> None:
    keys = tmp_path / "board-keys"
    keys.mkdir()
    board_key = _write(tmp_path / "pi-1.key", private_key_text(OTHER_SEED))
    (keys / "pi-1.pub").write_text(public_key_text(board_key))
    (keys / "notes.txt").write_text("ignored")
    assert load_board_keys(keys) == {"pi-1": (ed25519_public_key(OTHER_SEED),)}
    merged = CoordinatorKeys.from_bytes(add_board_keys(load_fleet_key(_write(tmp_path / "c.key", private_key_text(SEED))), keys))
    assert merged.algorithm == "ed25519" and dict(merged.board_keys or {}) == {"pi-1": (ed25519_public_key(OTHER_SEED),)}
    legacy_merged = CoordinatorKeys.from_bytes(add_board_keys(b"k" * 32, keys))  # events checked with a legacy command key too
    assert legacy_merged.algorithm == "hmac-sha256" and legacy_merged.board_keys is not None
    (keys / "bad id!.pub").write_text(public_key_text(board_key))
    with pytest.raises(ConfigError, match="not named <board_id>.pub"):
        load_board_keys(keys)
    with pytest.raises(ConfigError, match="No such file"):
        load_board_keys(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no <board_id>.pub file"):
        load_board_keys(empty)


# --- signed events -------------------------------------------------------------------------------


def _event(**over: Any) -> JobEvent:
    fields: dict[str, Any] = dict(job_id="job-1", board_id="pi-1", phase="progress", step=3, loss=0.25, ts=T0,
                                  data={"b": [1, 2.5, None], "a": {"z": True, "y": "s"}})
    return JobEvent(**{**fields, **over})


def test_a_signed_event_checks_and_an_older_reader_still_reads_it() -> None:
    payload = _event().to_msgpack(EventSigner(SEED))
    signature = msgpack.unpackb(payload)["signature"]
    assert signature["v"] == 1 and signature["alg"] == "ed25519" and len(signature["sig"]) == 128
    assert JobEvent.from_msgpack(payload, check=lambda f: check_event_signature(f, (PUBLIC,))) == _event()
    assert JobEvent.from_msgpack(payload) == _event()  # without a check (an older coordinator): unknown key ignored


@pytest.mark.parametrize("forge, fragment", [
    (lambda m: {k: v for k, v in m.items() if k != "signature"}, "unsigned event"),
    (lambda m: {**m, "phase": "failed"}, "bad event signature"),
    (lambda m: {**m, "data": {**m["data"], "a": {"z": False, "y": "s"}}}, "bad event signature"),
    (lambda m: {**m, "signature": {**m["signature"], "sig": "00" * 64}}, "bad event signature"),
    (lambda m: {**m, "signature": {**m["signature"], "v": 2}}, "event signature version 2"),
    (lambda m: {**m, "signature": "junk"}, "bad event signature"),
])
def test_a_forged_or_altered_event_is_refused(forge: Any, fragment: str) -> None:
    forged = msgpack.packb(forge(msgpack.unpackb(_event().to_msgpack(EventSigner(SEED)))))
    with pytest.raises(SignatureError, match=fragment):
        JobEvent.from_msgpack(forged, check=lambda f: check_event_signature(f, (PUBLIC,)))


def test_an_event_signed_by_another_board_is_refused() -> None:
    payload = _event().to_msgpack(EventSigner(OTHER_SEED))
    with pytest.raises(SignatureError, match="bad event signature"):
        JobEvent.from_msgpack(payload, check=lambda f: check_event_signature(f, (PUBLIC,)))


@given(st.binary(max_size=300))
def test_junk_on_an_events_topic_raises_only_decode_or_signature_errors(payload: bytes) -> None:
    with pytest.raises((DecodeError, SignatureError)):
        JobEvent.from_msgpack(payload, check=lambda f: check_event_signature(f, (PUBLIC,)))


def test_cryptography_is_not_imported_until_a_key_is_used(tmp_path: Path) -> None:
    # The idle agent loads its keys at start but imports cryptography only for the first command or event.
    private = _write(tmp_path / "board.key", private_key_text(SEED))
    public = _write(tmp_path / "fleet.pub", f"ed25519-public {PUBLIC.hex()}\n", 0o644)
    code = ("import sys; from edgefleet.transport.fleet_key import load_board_key, load_command_keys; "
            "from edgefleet.protocol.signing import CommandVerifier; "
            f"CommandVerifier(load_command_keys({str(public)!r})); load_board_key({str(private)!r}); "
            "print('cryptography' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ).stdout
    assert out.strip() == "False"

