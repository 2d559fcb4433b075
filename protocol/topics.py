"""MQTT topic names. Every topic is built here, never from string literals elsewhere.

Layout under a configurable prefix (default ``edgefleet/v1``)::

    <prefix>/boards/<board_id>/status     JSON, QoS 1, retained; the offline value is the last will
    <prefix>/boards/<board_id>/caps       JSON, QoS 1, retained
    <prefix>/boards/<board_id>/telemetry  JSON, QoS 0
    <prefix>/boards/<board_id>/cmd        msgpack, signed, QoS 1
    <prefix>/boards/<board_id>/events     msgpack, QoS 1
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "edgefleet/v1"
KINDS = ("status", "caps", "telemetry", "cmd", "events")

# A board id is one topic level: no wildcards, no slashes, nothing a shell or ACL would trip on.
_BOARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def valid_board_id(board_id: str) -> bool:
    """True if ``board_id`` can stand as one MQTT topic level and a file name."""
    return bool(_BOARD_ID.match(board_id))


def valid_prefix(prefix: str) -> bool:
    """True if ``prefix`` is a usable topic prefix (no wildcards, no empty levels)."""
    if not prefix or prefix.startswith("/") or prefix.endswith("/"):
        return False
    return all(level and "+" not in level and "#" not in level for level in prefix.split("/"))


def board_topic(prefix: str, board_id: str, kind: str) -> str:
    """The topic of one kind of message of one board."""
    if kind not in KINDS:
        raise ValueError(f"unknown topic kind {kind!r}; expected one of {KINDS}")
    return f"{prefix}/boards/{board_id}/{kind}"


def status_topic(prefix: str, board_id: str) -> str:
    return board_topic(prefix, board_id, "status")


def caps_topic(prefix: str, board_id: str) -> str:
    return board_topic(prefix, board_id, "caps")


def telemetry_topic(prefix: str, board_id: str) -> str:
    return board_topic(prefix, board_id, "telemetry")


def cmd_topic(prefix: str, board_id: str) -> str:
    return board_topic(prefix, board_id, "cmd")


def events_topic(prefix: str, board_id: str) -> str:
    return board_topic(prefix, board_id, "events")


def fleet_filter(prefix: str, kind: str = "+") -> str:
    """Subscription filter for one kind (or every kind, ``+``) from every board."""
    return f"{prefix}/boards/+/{kind}"


@dataclass(frozen=True, slots=True)
class BoardTopic:
    """A parsed board topic."""

    board_id: str
    kind: str


def parse_board_topic(prefix: str, topic: str) -> BoardTopic | None:
    """Split ``<prefix>/boards/<id>/<kind>``; None if the topic is not one of ours.

    A level that is not a valid board id (:func:`valid_board_id`: markup, spaces, 200 characters)
    is not a board of ours either, so nothing downstream ever shows or stores it.
    """
    head = f"{prefix}/boards/"
    if not topic.startswith(head):
        return None
    rest = topic[len(head):].split("/")
    if len(rest) != 2 or rest[1] not in KINDS or not valid_board_id(rest[0]):
        return None
    return BoardTopic(board_id=rest[0], kind=rest[1])


__all__ = [
    "DEFAULT_PREFIX",
    "KINDS",
    "BoardTopic",
    "board_topic",
    "caps_topic",
    "cmd_topic",
    "events_topic",
    "fleet_filter",
    "parse_board_topic",
    "status_topic",
    "telemetry_topic",
    "valid_board_id",
    "valid_prefix",
]
