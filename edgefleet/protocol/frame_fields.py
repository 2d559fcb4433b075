"""Checks every typed frame module shares: whole numbers, and a frame's ``type``.

Each protocol (the exchange, the link probe, the profile report) names itself in the messages, so
a refusal says which stream was broken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from edgefleet.protocol.errors import DecodeError


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (msgpack and JSON give both)."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def frame_kind(d: Any, protocol: str) -> str:
    """The ``type`` of a frame of ``protocol``. Raises DecodeError: not a map, or no str type."""
    if type(d) is not dict and not isinstance(d, Mapping):
        article = "an" if protocol[:1] in "aeiou" else "a"
        raise DecodeError(f"{article} {protocol} frame is a map, not {type(d).__name__}")
    kind = d.get("type")
    if type(kind) is not str:
        raise DecodeError(f"{protocol} frame without a str type (type = {kind!r:.40})")
    return kind


def expect_kind(d: Any, kind: str, protocol: str) -> None:
    """Raises DecodeError unless ``d`` is a ``kind`` frame of ``protocol``."""
    got = frame_kind(d, protocol)
    if got != kind:
        raise DecodeError(f"{protocol}: expected a {kind} frame, got {got!r:.40}")


__all__ = ["expect_kind", "frame_kind", "is_int"]
