"""Signed control commands: HMAC-SHA256 with the fleet key, a timestamp and a nonce.

The coordinator signs every command it publishes on ``…/boards/<id>/cmd``; an agent verifies it
and rejects unsigned, forged, stale, future-dated and replayed commands, saying which.

Wire format (msgpack)::

    {"v": 1, "alg": "hmac-sha256", "body": <bin>, "sig": <bin, 32 bytes>}

``body`` is the command map plus ``"ts"`` (unix seconds, float) and ``"nonce"`` (32 hex chars),
packed canonically: map keys sorted at every level, so the same command always packs the same.
``sig = HMAC-SHA256(key, b"edgefleet-command-v1\\0" + body)``; the prefix keeps a signature made
with the fleet key for anything else from passing as a command. The verifier checks the MAC over
the bytes as received, so canonical packing matters only for stable, reproducible signatures.

Generate a key with ``python -m protocol.signing --generate > fleet.key``.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import hmac
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import msgpack

from protocol.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
MAX_COMMAND_BYTES = 256 * 1024
_MAC_CONTEXT = b"edgefleet-command-v1\0"
_ENVELOPE_KEYS = {"v", "alg", "body", "sig"}
_NONCE = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(rb"[0-9a-fA-F]+")
_GENERATE_HINT = "generate one with: python -m protocol.signing --generate > fleet.key"


class SignatureError(ProtocolError):
    """A command is unsigned, forged, stale, from the future or replayed; the message says which."""


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the fleet key must be at least {MIN_KEY_BYTES} bytes; {_GENERATE_HINT}")


def _canonical(obj: Any) -> Any:
    """Copy ``obj`` with every dict's keys sorted, so msgpack packs it the same way every time."""
    if isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            raise TypeError(f"command keys must be str, got {sorted(map(repr, obj))}")
        return {key: _canonical(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(item) for item in obj]
    return obj


def _is_finite_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, _MAC_CONTEXT + body, hashlib.sha256).digest()


def sign_command(command: dict[str, Any], *, key: bytes, now: float | None = None) -> bytes:
    """Sign ``command`` for publishing; adds ``ts`` and a fresh ``nonce``.

    Args:
        command: msgpack-able values under str keys; must not use the keys ``ts`` and ``nonce``.
        key: the fleet key (at least 32 bytes), e.g. from :func:`load_fleet_key`.
        now: unix seconds to stamp; defaults to ``time.time()``.

    Returns:
        The msgpack envelope to publish.

    Raises:
        ValueError: a short key, or ``command`` already holds ``ts`` or ``nonce``.
        TypeError: a non-str key or a value msgpack cannot pack.
    """
    _check_key(key)
    clash = {"ts", "nonce"} & set(command)
    if clash:
        raise ValueError(f"command keys {sorted(clash)} are reserved for the signature")
    body = {**command, "ts": float(time.time() if now is None else now), "nonce": secrets.token_hex(16)}
    packed: bytes = msgpack.packb(_canonical(body), use_bin_type=True)
    envelope = {"v": ENVELOPE_VERSION, "alg": ALGORITHM, "body": packed, "sig": _mac(key, packed)}
    signed: bytes = msgpack.packb(envelope, use_bin_type=True)
    return signed


def _unpack(payload: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(payload, max_bin_len=MAX_COMMAND_BYTES, max_str_len=MAX_COMMAND_BYTES)
    except (ValueError, msgpack.UnpackException) as exc:  # FormatError, ExtraData, StackError, strict keys
        raise SignatureError(f"not a signed command: {what} is not msgpack ({exc})") from None


def _open_envelope(payload: bytes) -> tuple[bytes, bytes]:
    if len(payload) > MAX_COMMAND_BYTES:
        raise SignatureError(f"not a signed command: {len(payload)} bytes, over {MAX_COMMAND_BYTES}")
    envelope = _unpack(payload, "payload")
    if not isinstance(envelope, dict) or set(envelope) != _ENVELOPE_KEYS:
        found = sorted(map(str, envelope)) if isinstance(envelope, dict) else type(envelope).__name__
        raise SignatureError(f"not a signed command: expected keys {sorted(_ENVELOPE_KEYS)}, got {found}; "
                             "is the coordinator signing commands?")
    if envelope["v"] != ENVELOPE_VERSION:
        raise SignatureError(f"not a signed command: envelope version {envelope['v']!r}, this agent "
                             f"reads {ENVELOPE_VERSION}; upgrade the older side")
    if envelope["alg"] != ALGORITHM:
        raise SignatureError(f"not a signed command: algorithm {envelope['alg']!r}, expected {ALGORITHM!r}")
    body, sig = envelope["body"], envelope["sig"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        raise SignatureError("not a signed command: body and sig must be bin")
    return body, sig


class CommandVerifier:
    """Checks signed commands; one per agent, safe to call from the MQTT thread.

    A nonce is remembered until its command would be stale anyway (``ts`` older than
    ``max_age_s``), so memory is bounded by the command rate over that window; past
    ``nonce_capacity`` fresh nonces new commands are refused rather than risking a replay.

    Args:
        key: the fleet key (at least 32 bytes).
        max_age_s: how old a command may be, and how far ahead of ``clock`` its ``ts`` may be.
        clock: unix seconds now; inject a fake one in tests.
        nonce_capacity: most nonces remembered at once.
    """

    def __init__(self, key: bytes, *, max_age_s: float = 30.0, clock: Callable[[], float] = time.time,
                 nonce_capacity: int = 10000) -> None:
        _check_key(key)
        self._key = key
        self._max_age_s = max_age_s
        self._clock = clock
        self._capacity = nonce_capacity
        self._seen: dict[str, float] = {}           # nonce -> ts
        self._by_age: list[tuple[float, str]] = []  # heap of (ts, nonce), oldest first
        self._lock = threading.Lock()

    def verify(self, payload: bytes) -> dict[str, Any]:
        """Check ``payload`` and return the command body, ``ts`` and ``nonce`` included.

        Raises:
            SignatureError: "not a signed command", "bad signature", "stale", "from the
                future", "replayed nonce" or "nonce cache full", with the numbers.
        """
        body, sig = _open_envelope(payload)
        if not hmac.compare_digest(sig, _mac(self._key, body)):
            raise SignatureError("bad signature: not signed with this fleet's key, or altered in transit")
        command = _unpack(body, "signed body")
        if not isinstance(command, dict):
            raise SignatureError(f"signed body is a {type(command).__name__}, not a map")
        raw_ts, nonce = command.get("ts"), command.get("nonce")
        if not _is_finite_number(raw_ts) or not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
            raise SignatureError("signed body lacks a finite numeric ts and a 32-hex-char nonce")
        ts = float(raw_ts)
        with self._lock:
            now = self._clock()
            age = now - ts
            if age > self._max_age_s:
                raise SignatureError(f"stale: issued {age:.1f} s ago (limit {self._max_age_s:g} s); "
                                     "check the clocks (NTP)")
            if -age > self._max_age_s:
                raise SignatureError(f"from the future: issued {-age:.1f} s ahead of this board's clock "
                                     f"(limit {self._max_age_s:g} s); check the clocks (NTP)")
            self._forget_older_than(now - self._max_age_s)
            if nonce in self._seen:
                raise SignatureError(f"replayed nonce {nonce}: this command was already accepted")
            if len(self._seen) >= self._capacity:
                raise SignatureError(f"nonce cache full: {len(self._seen)} commands within {self._max_age_s:g} s; "
                                     "raise nonce_capacity or send fewer commands")
            self._seen[nonce] = ts
            heapq.heappush(self._by_age, (ts, nonce))
        return command

    def _forget_older_than(self, cutoff: float) -> None:
        while self._by_age and self._by_age[0][0] < cutoff:
            _, nonce = heapq.heappop(self._by_age)
            del self._seen[nonce]


def load_fleet_key(path: str | os.PathLike[str]) -> bytes:
    """Read the fleet key: 64+ hex digits (whitespace around them ignored) or 32+ raw bytes.

    A raw key is used byte for byte: stripping would change it for implementations that do not.

    Raises:
        ConfigError: the file is missing or unreadable, or the key is too short or odd hex.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        world_readable = path.stat().st_mode & 0o004
    except OSError as exc:
        raise ConfigError(f"fleet key {path}: {exc.strerror}; {_GENERATE_HINT}") from None
    if world_readable:
        log.warning("fleet key %s is readable by every user; run: chmod 600 %s", path, path)
    text = data.strip()
    if _HEX.fullmatch(text):
        if len(text) % 2:
            raise ConfigError(f"fleet key {path}: {len(text)} hex digits, an odd number; {_GENERATE_HINT}")
        key = bytes.fromhex(text.decode("ascii"))
    else:
        key = data
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"fleet key {path}: {len(key)} bytes, need at least {MIN_KEY_BYTES}; {_GENERATE_HINT}")
    return key


def generate_key_hex() -> str:
    """A new fleet key: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(MIN_KEY_BYTES)


def main(argv: list[str] | None = None) -> int:
    """``python -m protocol.signing --generate``: print a new 64-hex-digit fleet key."""
    parser = argparse.ArgumentParser(prog="python -m protocol.signing",
                                     description="Fleet keys for signed control commands.")
    parser.add_argument("--generate", action="store_true", help="print a new fleet key (hex) on stdout")
    args = parser.parse_args(argv)
    if not args.generate:
        parser.error("nothing to do; pass --generate (e.g. python -m protocol.signing --generate > fleet.key)")
    print(generate_key_hex())
    return 0


__all__ = ["ALGORITHM", "ENVELOPE_VERSION", "CommandVerifier", "SignatureError", "generate_key_hex",
           "load_fleet_key", "sign_command"]

if __name__ == "__main__":
    raise SystemExit(main())
