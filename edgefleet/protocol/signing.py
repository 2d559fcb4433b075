"""Signed control commands (coordinator to board) and signed job events (board to coordinator).

**Commands.** The coordinator signs every command it publishes on ``…/boards/<id>/cmd``; an agent
verifies it and rejects unsigned, forged, stale, future-dated and replayed commands, saying which.
Two envelopes (msgpack), told apart by ``v`` and ``alg``::

    {"v": 2, "alg": "ed25519",     "body": <bin>, "sig": <bin, 64 bytes>}
    {"v": 1, "alg": "hmac-sha256", "body": <bin>, "sig": <bin, 32 bytes>}   (legacy)

``body`` is the command map plus ``"ts"`` (unix seconds, float) and ``"nonce"`` (32 hex chars),
packed canonically: map keys sorted at every level, so the same command always packs the same.

- Version 2: ``sig = Ed25519(coordinator's private key, b"edgefleet-command-v2\\0" + body)``. Boards
  hold only public keys (several during a rotation), so a stolen board cannot command the others.
- Version 1 (legacy): ``sig = HMAC-SHA256(fleet key, b"edgefleet-command-v1\\0" + body)``. Every
  board holds the key that commands the fleet; still accepted, with a warning at start.

The prefixes keep a signature made for anything else from passing as a command. The verifier checks
the signature over the bytes as received, so canonical packing matters only for stable signatures.
An agent refuses the other kind of envelope than its key file is for, naming which side to change.

**Nonces.** A verifier remembers each accepted nonce until its command would be stale anyway. With
a :class:`NonceStore` (the agent's ``agent.nonce_file.NonceFile``) it also keeps them on disk,
written (atomically, fsync'd) before the command is acted on and read back at start, so a captured
command cannot be replayed to a restarted agent. The record also holds a *horizon*: the verifier's
record is complete for commands issued at or after it. A record that cannot be read moves the
horizon to the agent's start, so commands issued before the start are refused for one max-age
window (they might be replays) instead of trusted.

**Events.** A board with its own Ed25519 key (``security.board_key_file``) signs every job event::

    {…the JobEvent's fields…, "signature": {"v": 1, "alg": "ed25519", "sig": "<128 hex digits>"}}

``sig = Ed25519(board key, b"edgefleet-event-v1\\0" + canonical msgpack of the fields without
"signature")``: the coordinator checks it over the very values it then uses. A coordinator that does
not check ignores the field (unknown keys are ignored), so an older coordinator reads a newer
agent's events.

**The coordinator's keys as bytes.** The coordinator's code passes its key material around as
``fleet_key: bytes``. A legacy HMAC key is those bytes as they are; an Ed25519 key, or any key with
the boards' public keys for checking events, is :meth:`CoordinatorKeys.to_bytes` (a tagged msgpack
map), which :func:`sign_command` and the coordinator's board channel read back.

Ed25519 comes from ``cryptography``, imported only when a key is first used: an idle agent does not
carry it. Key files are read and made by ``edgefleet.transport.fleet_key``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import hmac
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import msgpack

from edgefleet.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

HMAC_VERSION, HMAC_ALGORITHM = 1, "hmac-sha256"
ED25519_VERSION, ED25519_ALGORITHM = 2, "ed25519"
ENVELOPES = {HMAC_VERSION: HMAC_ALGORITHM, ED25519_VERSION: ED25519_ALGORITHM}  # the versions this side reads
MIN_KEY_BYTES = 32
ED25519_KEY_BYTES = 32
ED25519_SIG_BYTES = 64
MAX_COMMAND_BYTES = 256 * 1024
MAX_PUBLIC_KEYS = 16
EVENT_SIGNATURE_FIELD = "signature"
EVENT_SIGNATURE_VERSION = 1
_CONTEXTS = {HMAC_VERSION: b"edgefleet-command-v1\0", ED25519_VERSION: b"edgefleet-command-v2\0"}
_EVENT_CONTEXT = b"edgefleet-event-v1\0"
_KEYS_TAG = b"edgefleet-coordinator-keys\0"
_ENVELOPE_KEYS = {"v", "alg", "body", "sig"}
_NONCE = re.compile(r"[0-9a-f]{32}")
_HEX_SIG = re.compile(r"[0-9a-f]{128}")
GENERATE_HINT = "generate one with: python -m edgefleet.transport.fleet_key --generate > fleet.key"
PUBLIC_HINT = "python -m edgefleet.transport.fleet_key --public fleet.key > fleet.pub"


class SignatureError(ProtocolError):
    """A command is unsigned, forged, stale, from the future or replayed; the message says which.

    ``tell_sender``: whether the board should answer the command's sender with the reason (the
    coordinator cannot fix what it does not hear: another fleet key, clocks apart). False for
    replays and a full nonce cache (a duplicate delivery must not fail the job it duplicates) and
    for what is not a command at all. ``hint``: what to change, for the refusal the sender hears.
    """

    def __init__(self, message: str, *, tell_sender: bool = False, hint: str = "") -> None:
        super().__init__(message)
        self.tell_sender = tell_sender
        self.hint = hint


# --- Ed25519 (cryptography, imported on first use) ------------------------------------------------


@functools.lru_cache(maxsize=16)
def _private_key(seed: bytes) -> Any:
    # cryptography: on first use, off the idle agent
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(seed)


@functools.lru_cache(maxsize=64)
def _public_key(public: bytes) -> Any:
    # cryptography: on first use, off the idle agent
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(public)


def _check_ed25519_key(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != ED25519_KEY_BYTES:
        raise ValueError(f"an Ed25519 {what} key is {ED25519_KEY_BYTES} bytes, got "
                         f"{len(key) if isinstance(key, bytes) else type(key).__name__}")


def generate_ed25519_seed() -> bytes:
    """A new Ed25519 private key (its 32-byte seed; any 32 random bytes are one)."""
    return secrets.token_bytes(ED25519_KEY_BYTES)


def ed25519_public_key(seed: bytes) -> bytes:
    """The 32-byte public key of the private key ``seed``."""
    # cryptography: on first use, off the idle agent
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    _check_ed25519_key(seed, "private")
    public: bytes = _private_key(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return public


def _ed25519_sign(seed: bytes, message: bytes) -> bytes:
    signature: bytes = _private_key(seed).sign(message)
    return signature


def _ed25519_verify(public_keys: Sequence[bytes], signature: bytes, message: bytes) -> bool:
    """True if any of ``public_keys`` made ``signature`` over ``message``."""
    from cryptography.exceptions import InvalidSignature  # cryptography: on first use, off the idle agent

    if len(signature) != ED25519_SIG_BYTES:
        return False
    for public in public_keys:
        try:
            _public_key(public).verify(signature, message)
            return True
        except (InvalidSignature, ValueError):
            continue
    return False


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    """Sign ``message`` with the Ed25519 private key ``seed`` (32 bytes)."""
    return _ed25519_sign(seed, message)


def ed25519_verify(public_keys: Sequence[bytes], signature: bytes, message: bytes) -> bool:
    """True if any of ``public_keys`` made ``signature`` over ``message``."""
    return _ed25519_verify(public_keys, signature, message)


def key_id(public: bytes) -> str:
    """A short name for a public key in messages: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(public).hexdigest()[:8]


# --- the coordinator's keys -----------------------------------------------------------------------


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the fleet key must be at least {MIN_KEY_BYTES} bytes; {GENERATE_HINT}")


@dataclass(frozen=True, eq=False)
class CoordinatorKeys:
    """What the coordinator signs commands with, and the boards' public keys it checks events with.

    Args:
        algorithm: :data:`ED25519_ALGORITHM` (``secret`` is the private key's 32-byte seed) or
            :data:`HMAC_ALGORITHM` (``secret`` is the legacy shared fleet key).
        secret: See ``algorithm``.
        board_keys: Each board's public key(s) by board id; None: events are not checked.
        board_keys_source: Where ``board_keys`` came from (the ``--board-keys`` directory), for messages.
    """

    algorithm: str
    secret: bytes = field(repr=False)
    board_keys: Mapping[str, tuple[bytes, ...]] | None = None
    board_keys_source: str = ""

    def __post_init__(self) -> None:
        if self.algorithm == ED25519_ALGORITHM:
            _check_ed25519_key(self.secret, "private")
        elif self.algorithm == HMAC_ALGORITHM:
            _check_key(self.secret)
        else:
            raise ValueError(f"unknown signing algorithm {self.algorithm!r}")
        for board, keys in (self.board_keys or {}).items():
            if not keys:
                raise ValueError(f"board {board!r} has no public key")
            for public in keys:
                _check_ed25519_key(public, "public")

    def to_bytes(self) -> bytes:
        """The form the coordinator passes around as ``fleet_key`` (a legacy key alone: the key itself)."""
        if self.algorithm == HMAC_ALGORITHM and self.board_keys is None:
            return self.secret
        data = {"v": 1, "alg": self.algorithm, "secret": self.secret, "board_keys_source": self.board_keys_source,
                "board_keys": None if self.board_keys is None else {b: list(k) for b, k in self.board_keys.items()}}
        packed: bytes = msgpack.packb(data, use_bin_type=True)
        return _KEYS_TAG + packed

    @classmethod
    def from_bytes(cls, key: bytes) -> CoordinatorKeys:
        """Read :meth:`to_bytes` back; any other bytes are a legacy HMAC key. Raises ValueError."""
        if not isinstance(key, bytes):
            raise ValueError(f"the fleet key must be bytes, got {type(key).__name__}")
        if not key.startswith(_KEYS_TAG):
            return cls(HMAC_ALGORITHM, key)
        try:
            data = msgpack.unpackb(key[len(_KEYS_TAG):])
            keys = data["board_keys"]
            return cls(data["alg"], data["secret"], None if keys is None else {b: tuple(k) for b, k in keys.items()},
                       data["board_keys_source"])
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
            raise ValueError(f"the coordinator's keys are damaged ({exc})") from None

    def with_board_keys(self, board_keys: Mapping[str, tuple[bytes, ...]], source: str) -> CoordinatorKeys:
        return CoordinatorKeys(self.algorithm, self.secret, dict(board_keys), source)

    @property
    def public_key(self) -> bytes | None:
        """The Ed25519 public key boards verify this coordinator's commands with (None for a legacy key)."""
        return ed25519_public_key(self.secret) if self.algorithm == ED25519_ALGORITHM else None


@functools.lru_cache(maxsize=8)
def _coordinator_keys(key: bytes) -> CoordinatorKeys:
    return CoordinatorKeys.from_bytes(key)


def _canonical(obj: Any) -> Any:
    """Copy ``obj`` with every dict's keys sorted, so msgpack packs it the same way every time."""
    if isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            raise TypeError(f"command keys must be str, got {sorted(map(repr, obj))}")
        return {key: _canonical(obj[key]) for key in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(item) for item in obj]
    return obj


def is_finite_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, _CONTEXTS[HMAC_VERSION] + body, hashlib.sha256).digest()


def sign_command(command: dict[str, Any], *, key: bytes | CoordinatorKeys, now: float | None = None) -> bytes:
    """Sign ``command`` for publishing; adds ``ts`` and a fresh ``nonce``.

    Args:
        command: msgpack-able values under str keys; must not use the keys ``ts`` and ``nonce``.
        key: the coordinator's keys: :class:`CoordinatorKeys`, their :meth:`~CoordinatorKeys.to_bytes`
            (what ``load_fleet_key`` returns for an Ed25519 key file), or a legacy fleet key (at least
            32 bytes), which signs a version-1 (HMAC) envelope.
        now: unix seconds to stamp; defaults to ``time.time()``.

    Returns:
        The msgpack envelope to publish.

    Raises:
        ValueError: a short key, or ``command`` already holds ``ts`` or ``nonce``.
        TypeError: a non-str key or a value msgpack cannot pack.
    """
    keys = key if isinstance(key, CoordinatorKeys) else _coordinator_keys(key) if isinstance(key, bytes) else None
    if keys is None:
        raise ValueError(f"the fleet key must be bytes, got {type(key).__name__}")
    clash = {"ts", "nonce"} & set(command)
    if clash:
        raise ValueError(f"command keys {sorted(clash)} are reserved for the signature")
    body = {**command, "ts": float(time.time() if now is None else now), "nonce": secrets.token_hex(16)}
    packed: bytes = msgpack.packb(_canonical(body), use_bin_type=True)
    if keys.algorithm == ED25519_ALGORITHM:
        envelope = {"v": ED25519_VERSION, "alg": ED25519_ALGORITHM, "body": packed,
                    "sig": _ed25519_sign(keys.secret, _CONTEXTS[ED25519_VERSION] + packed)}
    else:
        envelope = {"v": HMAC_VERSION, "alg": HMAC_ALGORITHM, "body": packed, "sig": _mac(keys.secret, packed)}
    signed: bytes = msgpack.packb(envelope, use_bin_type=True)
    return signed


# --- reading a command ---------------------------------------------------------------------------


def _unpack(payload: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(payload, max_bin_len=MAX_COMMAND_BYTES, max_str_len=MAX_COMMAND_BYTES)
    except (ValueError, msgpack.UnpackException) as exc:  # FormatError, ExtraData, StackError, strict keys
        raise SignatureError(f"not a signed command: {what} is not msgpack ({exc})") from None


def _envelope_map(payload: bytes) -> dict[str, Any]:
    if len(payload) > MAX_COMMAND_BYTES:
        raise SignatureError(f"not a signed command: {len(payload)} bytes, over {MAX_COMMAND_BYTES}")
    envelope = _unpack(payload, "payload")
    if not isinstance(envelope, dict) or set(envelope) != _ENVELOPE_KEYS:
        found = sorted(map(str, envelope)) if isinstance(envelope, dict) else type(envelope).__name__
        raise SignatureError(f"not a signed command: expected keys {sorted(_ENVELOPE_KEYS)}, got {found}; "
                             "is the coordinator signing commands?")
    return envelope


def _open_envelope(payload: bytes) -> tuple[int, bytes, bytes]:
    """``(version, body, sig)`` of a well-formed envelope of a version this side reads."""
    envelope = _envelope_map(payload)
    version, alg = envelope["v"], envelope["alg"]
    readable = " and ".join(f"{v} ({a})" for v, a in ENVELOPES.items())
    if not isinstance(version, int) or isinstance(version, bool) or version not in ENVELOPES:
        if isinstance(version, int) and not isinstance(version, bool) and version > max(ENVELOPES):
            raise SignatureError(f"not a signed command: envelope version {version}, this agent reads {readable}; the "
                                 "coordinator is newer: upgrade edgefleet on this board", tell_sender=True)
        raise SignatureError(f"not a signed command: envelope version {version!r}, this agent reads {readable}; "
                             "upgrade the older side")
    if alg != ENVELOPES[version]:
        raise SignatureError(f"not a signed command: envelope version {version} with algorithm {alg!r}, expected "
                             f"{ENVELOPES[version]!r} (this agent reads {readable})")
    body, sig = envelope["body"], envelope["sig"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        raise SignatureError("not a signed command: body and sig must be bin")
    return version, body, sig


def unverified_address(payload: bytes) -> tuple[str, str] | None:
    """The ``(job_id, board_id)`` a signed command claims, read WITHOUT checking its signature.

    Only to address a refusal to the job that may be waiting for it; never to act on the command.
    None if the payload is not an envelope (of any version) around a map with two short str ids.
    """
    try:
        body = _envelope_map(payload)["body"]
        command = _unpack(body, "signed body") if isinstance(body, bytes) else None
    except SignatureError:
        return None
    if not isinstance(command, dict):
        return None
    job_id, board_id = command.get("job_id"), command.get("board_id")
    if not (isinstance(job_id, str) and isinstance(board_id, str) and 0 < len(job_id) <= 128 and 0 < len(board_id) <= 128):
        return None
    return job_id, board_id


@dataclass(frozen=True)
class CommandKeys:
    """What a board verifies commands with: Ed25519 public keys, or a legacy shared HMAC key.

    Args:
        public_keys: The coordinator's public key(s); more than one while a key is being rotated.
        hmac_key: The legacy fleet key (at least 32 bytes), instead of ``public_keys``.
        source: Where they came from (the key file), for messages.
    """

    public_keys: tuple[bytes, ...] = ()
    hmac_key: bytes | None = field(default=None, repr=False)
    source: str = "the fleet key"

    def __post_init__(self) -> None:
        if (self.hmac_key is None) == (not self.public_keys):
            raise ValueError("give Ed25519 public keys or a legacy HMAC key, exactly one of them")
        if self.hmac_key is not None:
            _check_key(self.hmac_key)
        if len(self.public_keys) > MAX_PUBLIC_KEYS:
            raise ValueError(f"{len(self.public_keys)} public keys; at most {MAX_PUBLIC_KEYS}")
        for public in self.public_keys:
            _check_ed25519_key(public, "public")

    @property
    def legacy(self) -> bool:
        return self.hmac_key is not None


# --- where a verifier keeps its nonces ----------------------------------------------------------


class NonceStore(Protocol):
    """Where a :class:`CommandVerifier` keeps the nonces it accepted across restarts (the agent's
    ``agent.nonce_file.NonceFile``: this package does no I/O)."""

    @property
    def path(self) -> Path:
        """Where the record is, for the messages."""

    def load(self) -> tuple[float | None, list[tuple[float, str]]]:
        """``(horizon, [(ts, nonce), …])``.

        Raises:
            FileNotFoundError: no record yet.
            OSError: it cannot be read.
            ValueError: it is not a record (the message says what is wrong).
        """

    def save(self, horizon: float | None, entries: Sequence[tuple[float, str]]) -> None:
        """Replace the record, durably. Raises OSError (a full disk, a read-only directory)."""


def is_nonce(value: Any) -> TypeGuard[str]:
    """A command's nonce: 32 lowercase hex digits."""
    return isinstance(value, str) and _NONCE.fullmatch(value) is not None


# --- the verifier --------------------------------------------------------------------------------


class CommandVerifier:
    """Checks signed commands; one per agent, safe to call from the MQTT thread.

    A nonce is remembered until its command would be stale anyway (``ts`` older than
    ``max_age_s``), so memory is bounded by the command rate over that window; past
    ``nonce_capacity`` fresh nonces new commands are refused rather than risking a replay.

    Args:
        key: what commands are verified with: :class:`CommandKeys`, or a legacy fleet key (bytes).
        max_age_s: how old a command may be, and how far ahead of ``clock`` its ``ts`` may be.
        clock: unix seconds now; inject a fake one in tests.
        nonce_capacity: most nonces remembered at once.
        nonce_file: where accepted nonces are kept across restarts (None: in memory only). Read
            here; a record that cannot be read is reported and replaced, and commands issued
            before now are then refused for one ``max_age_s`` window.
    """

    def __init__(self, key: bytes | CommandKeys, *, max_age_s: float = 30.0, clock: Callable[[], float] = time.time,
                 nonce_capacity: int = 10000, nonce_file: NonceStore | None = None) -> None:
        self._keys = key if isinstance(key, CommandKeys) else CommandKeys(hmac_key=key)
        self._max_age_s = max_age_s
        self._clock = clock
        self._capacity = nonce_capacity
        self._seen: dict[str, float] = {}           # nonce -> ts
        self._by_age: list[tuple[float, str]] = []  # heap of (ts, nonce), oldest first
        self._lock = threading.Lock()
        self._file = nonce_file
        # Commands issued before the horizon are refused: whether they were accepted is not known.
        self._horizon: float | None = None
        self._horizon_reason = ""
        if nonce_file is not None:
            self._load(nonce_file)

    def _load(self, nonce_file: NonceStore) -> None:
        started = self._clock()
        try:
            horizon, entries = nonce_file.load()
        except FileNotFoundError:
            log.info("no command nonce record at %s yet (a first start); it is written before any command is acted on",
                     nonce_file.path)
            horizon, entries = None, []
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("the command nonce record %s cannot be used (%s): commands issued before this start are refused "
                        "for the next %g s, in case they are replays; the record is written anew", nonce_file.path,
                        reason, self._max_age_s)
            horizon, entries = started, []
            self._horizon_reason = f"this agent restarted without a usable nonce record ({nonce_file.path}: {reason})"
        # Entries that are stale by now, and the oldest beyond the capacity, are forgotten as verify() forgets them.
        entries.sort()
        first = max(bisect.bisect_left(entries, (started - self._max_age_s, "")), len(entries) - self._capacity)
        kept = entries[first:]
        for ts, nonce in kept:
            self._seen[nonce] = ts
        self._by_age = list(kept)  # sorted: a valid heap
        self._horizon = horizon
        if first > 0:
            self._horizon = max(entries[first - 1][0], -math.inf if horizon is None else horizon)
        try:
            nonce_file.save(self._horizon, sorted(self._by_age))
        except OSError as exc:
            log.error("cannot write the command nonce record %s (%s): every command will be refused until the agent "
                      "can write there (state_dir; free space, permissions)", nonce_file.path, exc.strerror or exc)

    def verify(self, payload: bytes) -> dict[str, Any]:
        """Check ``payload`` and return the command body, ``ts`` and ``nonce`` included.

        Raises:
            SignatureError: "not a signed command", "key mismatch", "bad signature", "stale",
                "from the future", "possibly replayed", "replayed nonce", "nonce cache full" or
                "nonce record", with the numbers.
        """
        version, body, sig = _open_envelope(payload)
        self._check_signature(version, body, sig)
        command = _unpack(body, "signed body")
        if not isinstance(command, dict):
            raise SignatureError(f"signed body is a {type(command).__name__}, not a map")
        raw_ts, nonce = command.get("ts"), command.get("nonce")
        if not is_finite_number(raw_ts) or not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
            raise SignatureError("signed body lacks a finite numeric ts and a 32-hex-char nonce")
        ts = float(raw_ts)
        with self._lock:
            now = self._clock()
            age = now - ts
            if age > self._max_age_s:
                raise SignatureError(f"stale: issued {age:.1f} s ago (limit {self._max_age_s:g} s); "
                                     "check the clocks (NTP)", tell_sender=True)
            if -age > self._max_age_s:
                raise SignatureError(f"from the future: issued {-age:.1f} s ahead of this board's clock "
                                     f"(limit {self._max_age_s:g} s); check the clocks (NTP)", tell_sender=True)
            self._forget_older_than(now - self._max_age_s)
            if nonce in self._seen:
                raise SignatureError(f"replayed nonce {nonce}: this command was already accepted")
            if self._horizon is not None and ts <= self._horizon:
                why = self._horizon_reason or "the start of this board's nonce record"
                raise SignatureError(f"possibly replayed: issued {age:.1f} s ago, before {why}; this board cannot tell "
                                     "whether it already accepted it, so it refuses it (send it again)", tell_sender=True)
            if len(self._seen) >= self._capacity:
                raise SignatureError(f"nonce cache full: {len(self._seen)} commands within {self._max_age_s:g} s; "
                                     "raise nonce_capacity or send fewer commands")
            self._seen[nonce] = ts
            heapq.heappush(self._by_age, (ts, nonce))
            if self._file is not None:
                self._persist(self._file)
        return command

    def _persist(self, nonce_file: NonceStore) -> None:
        """Write the record before the command is acted on; a command that cannot be recorded is refused."""
        try:
            nonce_file.save(self._horizon, sorted(self._by_age))
        except OSError as exc:
            raise SignatureError(f"nonce record: cannot write {nonce_file.path} ({exc.strerror or exc}), so this board "
                                 "could not refuse a replay of the command after a restart; it refuses the command. "
                                 "Make the agent's state_dir writable and give it some free space", tell_sender=True) from None

    def _check_signature(self, version: int, body: bytes, sig: bytes) -> None:
        keys = self._keys
        if version == HMAC_VERSION:
            if keys.hmac_key is None:
                raise SignatureError(
                    f"key mismatch: the command is signed with a shared HMAC fleet key (legacy), but this board accepts "
                    f"only the coordinator's Ed25519 key ({keys.source} holds ed25519-public lines)", tell_sender=True,
                    hint="give the coordinator the Ed25519 private key these public keys were made from (--fleet-key)")
            if not hmac.compare_digest(sig, _mac(keys.hmac_key, body)):
                raise SignatureError("bad signature: not signed with this fleet's key, or altered in transit",
                                     tell_sender=True, hint="its fleet key differs from the coordinator's: use the same key "
                                                            "on both (--fleet-key, security.fleet_key_file)")
            return
        if not keys.public_keys:
            raise SignatureError(
                f"key mismatch: the command is signed with an Ed25519 key, but this board holds a shared HMAC fleet key "
                f"(legacy, {keys.source})", tell_sender=True,
                hint=f"install the coordinator's public key as the board's security.fleet_key_file ({PUBLIC_HINT})")
        if not _ed25519_verify(keys.public_keys, sig, _CONTEXTS[ED25519_VERSION] + body):
            ids = ", ".join(key_id(k) for k in keys.public_keys)
            raise SignatureError(f"bad signature: not signed by the coordinator key this board trusts (key id {ids} in "
                                 f"{keys.source}), or altered in transit", tell_sender=True,
                                 hint=f"its security.fleet_key_file does not hold the public key of the coordinator's "
                                      f"--fleet-key: install it there ({PUBLIC_HINT})")

    def _forget_older_than(self, cutoff: float) -> None:
        while self._by_age and self._by_age[0][0] < cutoff:
            ts, nonce = heapq.heappop(self._by_age)
            del self._seen[nonce]
            # The record is now complete only from here on: kept on disk, it still holds if the
            # window is widened (a larger max_command_age_s) before the next start.
            self._horizon = ts if self._horizon is None else max(self._horizon, ts)


# --- signed job events ---------------------------------------------------------------------------


def _event_message(fields: Mapping[str, Any]) -> bytes:
    unsigned = {k: v for k, v in fields.items() if k != EVENT_SIGNATURE_FIELD}
    try:
        packed: bytes = msgpack.packb(_canonical(unsigned), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SignatureError(f"event cannot be packed for its signature ({exc})") from None
    return _EVENT_CONTEXT + packed


class EventSigner:
    """Signs a board's job events with the board's own Ed25519 key (``security.board_key_file``).

    Called with an event's fields (a map), returns them with the ``signature`` field added.
    """

    def __init__(self, seed: bytes) -> None:
        _check_ed25519_key(seed, "private")
        self._seed = seed

    @property
    def public_key(self) -> bytes:
        return ed25519_public_key(self._seed)

    @property
    def seed(self) -> bytes:
        """The private key itself (for the exchange's hello proof, ``protocol.exchange_auth``)."""
        return self._seed

    def __call__(self, fields: dict[str, Any]) -> dict[str, Any]:
        signature = _ed25519_sign(self._seed, _event_message(fields))
        return {**fields, EVENT_SIGNATURE_FIELD: {"v": EVENT_SIGNATURE_VERSION, "alg": ED25519_ALGORITHM,
                                                  "sig": signature.hex()}}


def check_event_signature(fields: Any, public_keys: Sequence[bytes]) -> None:
    """Check a decoded event's ``signature`` against the board's public key(s).

    Raises:
        SignatureError: "unsigned event", "event signature version/algorithm" or "bad event signature".
    """
    if not isinstance(fields, dict):
        raise SignatureError(f"not an event: a {type(fields).__name__}")
    signature = fields.get(EVENT_SIGNATURE_FIELD)
    if signature is None:
        raise SignatureError("unsigned event")
    if not isinstance(signature, dict) or set(signature) != {"v", "alg", "sig"}:
        raise SignatureError("bad event signature: expected a map with keys alg, sig and v")
    if signature["v"] != EVENT_SIGNATURE_VERSION or signature["alg"] != ED25519_ALGORITHM:
        raise SignatureError(f"event signature version {signature['v']!r} with algorithm {signature['alg']!r}: this "
                             f"coordinator reads version {EVENT_SIGNATURE_VERSION} ({ED25519_ALGORITHM}); upgrade the older side")
    sig = signature["sig"]
    if not isinstance(sig, str) or not _HEX_SIG.fullmatch(sig):
        raise SignatureError("bad event signature: sig is not 128 hex digits")
    if not _ed25519_verify(public_keys, bytes.fromhex(sig), _event_message(fields)):
        raise SignatureError("bad event signature: not made with the board's key, or altered in transit")


__all__ = ["ED25519_ALGORITHM", "ED25519_VERSION", "ENVELOPES", "EVENT_SIGNATURE_FIELD",
           "GENERATE_HINT", "HMAC_ALGORITHM", "HMAC_VERSION", "MIN_KEY_BYTES", "PUBLIC_HINT", "CommandKeys", "CommandVerifier",
           "CoordinatorKeys", "EventSigner", "NonceStore", "SignatureError", "check_event_signature", "ed25519_public_key", "ed25519_sign",
           "ed25519_verify", "generate_ed25519_seed", "is_finite_number", "is_nonce", "key_id", "sign_command", "unverified_address"]
