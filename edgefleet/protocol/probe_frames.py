"""The link probe's wire contract: the frames a profile job and the coordinator's probe endpoint exchange.

TCP, ``protocol.framing`` frames around raw payload bytes; each frame a frozen dataclass with
``to_wire()`` and ``from_wire(d)`` (:func:`decode_probe_frame` dispatches on ``type``):

* board -> ``probe-hello`` {v, job_id, board_id, token, bytes, round_bytes, rounds} (:class:`ProbeHello`);
  the coordinator answers ``go`` {v} when the board's turn comes (one board at a time, :class:`Go`)
  or ``error`` {message} (:class:`ProbeRefusal`).
* If ``bytes`` > 0 (the board's first job): the board sends ``bytes`` raw bytes, the coordinator
  answers ``got``; the board sends ``down`` and receives ``bytes`` raw bytes.
* Then at most ``rounds`` times, as a training step moves a gradient: the board sends a ``round``
  frame whose ``data`` holds ``round_bytes`` bytes and the coordinator sends it straight back
  (:class:`ProbeRound`); the board ends them with ``end``.
* Then either ``done``, or (``bytes`` > 0 only) ``aggregate`` (every board uploads ``bytes``
  again at once, answered by ``got``) followed by ``done``.

:data:`PROBE_VERSION` is the one version of this contract; ``probe-hello`` and ``go`` carry it as
``v``, and a peer of another version is refused with :class:`ProbeVersionError`, whose message
says which side to upgrade. A ``go`` without ``v`` is version 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar

from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.exchange_frames import same_secret
from edgefleet.protocol.frame_fields import expect_kind, frame_kind, is_int
from edgefleet.protocol.jobs import MAX_PROBE_BYTES, MAX_PROBE_ROUNDS, probe_rounds_ok

PROBE_VERSION: Final = 2
MAX_ID = 256  # characters of a job id, board id or token
HELLO = "probe-hello"


_S = TypeVar("_S", bound="_Signal")


class ProbeVersionError(ProtocolError):
    """A peer speaks another version of the link probe; the message says which side to upgrade."""


def _kind(d: Any) -> str:
    return frame_kind(d, "link probe")


def _expect(d: Any, kind: str) -> None:
    expect_kind(d, kind, "link probe")


def _text(d: Mapping[str, Any], key: str, *, limit: int = MAX_ID) -> str:
    value = d.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise DecodeError(f"{HELLO}: {key} {value!r:.40} is not a string of at most {limit} characters")
    return value


def _bytes_field(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    if not is_int(value) or not 0 <= value <= MAX_PROBE_BYTES:
        raise DecodeError(f"{key} must be 0-{MAX_PROBE_BYTES}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeHello:
    """A profile job asks for its turn: ``nbytes`` up and down in bulk, then ``rounds`` frames of ``round_bytes``."""

    job_id: str
    board_id: str
    token: str = dataclasses.field(repr=False)
    nbytes: int
    round_bytes: int
    rounds: int
    v: int = PROBE_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"type": HELLO, "v": self.v, "job_id": self.job_id, "board_id": self.board_id, "token": self.token,
                "bytes": self.nbytes, "round_bytes": self.round_bytes, "rounds": self.rounds}

    @classmethod
    def from_wire(cls, d: Any) -> ProbeHello:
        """Raises:
            ProbeVersionError: the board speaks another version (the message says which side to upgrade).
            DecodeError: not a probe-hello, a field of the wrong type, or nothing (or too much) to measure.
        """
        _expect(d, HELLO)
        v = d.get("v")
        if not is_int(v):
            raise DecodeError(f"{HELLO} names no link probe version (v = {v!r:.20})")
        if v != PROBE_VERSION:
            board_id = d.get("board_id")
            who = f"board {board_id[:MAX_ID]}" if isinstance(board_id, str) and board_id else "a board"
            upgrade = "edge-coordinator" if v > PROBE_VERSION else f"edge-agent on {who}"
            raise ProbeVersionError(f"{who} speaks link probe protocol {v}, this coordinator {PROBE_VERSION}: upgrade {upgrade}")
        nbytes, round_bytes, rounds = _bytes_field(d, "bytes"), _bytes_field(d, "round_bytes"), d.get("rounds")
        if not is_int(rounds) or not probe_rounds_ok(rounds) or (rounds > 0) != (round_bytes > 0):
            raise DecodeError(f"rounds must be 0 or 2-{MAX_PROBE_ROUNDS} (the first is not timed), and more than 0 exactly "
                              "when round_bytes is")
        if not nbytes and not rounds:
            raise DecodeError("nothing to measure: bytes and rounds are both 0")
        return cls(job_id=_text(d, "job_id"), board_id=_text(d, "board_id"), token=_text(d, "token"), nbytes=nbytes,
                   round_bytes=round_bytes, rounds=rounds, v=v)

    def presents(self, token: str) -> bool:
        """Whether the hello presents ``token`` (compared in constant time)."""
        return same_secret(self.token, token)


@dataclass(frozen=True, slots=True)
class _Signal:
    """A frame with no fields but its type."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE}

    @classmethod
    def from_wire(cls: type[_S], d: Any) -> _S:
        _expect(d, cls.TYPE)
        return cls()


@dataclass(frozen=True, slots=True)
class Go:
    """The board's turn: it may start moving bytes."""

    TYPE: ClassVar[str] = "go"
    v: int = PROBE_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "v": self.v}

    @classmethod
    def from_wire(cls, d: Any) -> Go:
        """Raises ProbeVersionError: the coordinator speaks another version; DecodeError: not a go."""
        _expect(d, cls.TYPE)
        v = d.get("v", PROBE_VERSION)
        if not is_int(v):
            raise DecodeError(f"go names no link probe version (v = {v!r:.20})")
        if v != PROBE_VERSION:
            upgrade = "edge-agent on this board" if v > PROBE_VERSION else "edge-coordinator"
            raise ProbeVersionError(f"the coordinator speaks link probe protocol {v}, this board {PROBE_VERSION}: "
                                    f"upgrade {upgrade}")
        return cls(v)


@dataclass(frozen=True, slots=True)
class Got(_Signal):
    """The coordinator has the bytes the board uploaded."""

    TYPE: ClassVar[str] = "got"


@dataclass(frozen=True, slots=True)
class Down(_Signal):
    """The board is ready to receive the download."""

    TYPE: ClassVar[str] = "down"


@dataclass(frozen=True, slots=True)
class End(_Signal):
    """The board has timed enough rounds."""

    TYPE: ClassVar[str] = "end"


@dataclass(frozen=True, slots=True)
class Aggregate(_Signal):
    """Every waiting board uploads at once now: the coordinator's own link."""

    TYPE: ClassVar[str] = "aggregate"


@dataclass(frozen=True, slots=True)
class Done(_Signal):
    """The probe is over."""

    TYPE: ClassVar[str] = "done"


@dataclass(frozen=True, slots=True)
class ProbeRefusal:
    """The coordinator refuses the probe, and says why."""

    message: str
    TYPE: ClassVar[str] = "error"

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "message": self.message}

    @classmethod
    def from_wire(cls, d: Any) -> ProbeRefusal:
        _expect(d, cls.TYPE)
        message = d.get("message")
        if not isinstance(message, str):
            raise DecodeError(f"link probe error frame: message {message!r:.40} is not a string")
        return cls(message)


@dataclass(frozen=True, slots=True)
class ProbeRound:
    """A gradient-sized frame, up and straight back: ``data`` is its payload (sent as it is, never copied here)."""

    data: bytes | memoryview
    TYPE: ClassVar[str] = "round"

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "data": self.data}

    @classmethod
    def from_wire(cls, d: Any, *, round_bytes: int) -> ProbeRound:
        """Raises DecodeError: not a round of exactly ``round_bytes`` bytes."""
        _expect(d, cls.TYPE)
        data = d.get("data")
        if not isinstance(data, (bytes, memoryview)) or len(data) != round_bytes:
            size = len(data) if isinstance(data, (bytes, memoryview)) else type(data).__name__
            raise DecodeError(f"link probe: a round of {size} bytes, expected {round_bytes}")
        return cls(data)


ProbeFrame = ProbeHello | Go | Got | Down | End | Aggregate | Done | ProbeRefusal | ProbeRound
_SIGNALS: dict[str, type[Got | Down | End | Aggregate | Done]] = {cls.TYPE: cls for cls in (Got, Down, End, Aggregate, Done)}


def decode_probe_frame(d: Any, *, round_bytes: int = 0) -> ProbeFrame:
    """Any link probe frame, by its type (a ``round`` must hold ``round_bytes`` bytes).

    Raises:
        ProbeVersionError: a probe-hello or go of another version.
        DecodeError: an unknown type or a malformed frame.
    """
    kind = _kind(d)
    if kind == HELLO:
        return ProbeHello.from_wire(d)
    if kind == Go.TYPE:
        return Go.from_wire(d)
    if kind == ProbeRound.TYPE:
        return ProbeRound.from_wire(d, round_bytes=round_bytes)
    if kind == ProbeRefusal.TYPE:
        return ProbeRefusal.from_wire(d)
    signal = _SIGNALS.get(kind)
    if signal is None:
        raise DecodeError(f"link probe: unknown frame type {kind!r:.40}")
    return signal.from_wire(d)


def frame_name(frame: ProbeFrame) -> str:
    """The type a frame has on the wire (for messages)."""
    return HELLO if isinstance(frame, ProbeHello) else frame.TYPE


__all__ = [
    "PROBE_VERSION",
    "Aggregate",
    "Done",
    "Down",
    "End",
    "Go",
    "Got",
    "ProbeFrame",
    "ProbeHello",
    "ProbeRefusal",
    "ProbeRound",
    "ProbeVersionError",
    "decode_probe_frame",
    "frame_name",
]
