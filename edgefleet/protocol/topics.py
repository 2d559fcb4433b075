"""MQTT topic names. Every topic is built here, never from string literals elsewhere.

Layout under a configurable prefix (default ``edgefleet/v1``)::

    <prefix>/boards/<board_id>/status     JSON, QoS 1, retained; the offline value is the last will
    <prefix>/boards/<board_id>/caps       JSON, QoS 1, retained
    <prefix>/boards/<board_id>/telemetry  JSON, QoS 0
    <prefix>/boards/<board_id>/cmd        msgpack, signed, QoS 1
    <prefix>/boards/<board_id>/events     msgpack, QoS 1 (signed when the board has a key): authoritative
    <prefix>/boards/<board_id>/events/json  JSON copy of the events, unsigned, progress rate-limited, QoS 1

``events/json`` is one level deeper than the kinds, so ``<prefix>/boards/+/events`` subscribers and
:func:`parse_board_topic` never see it. Home Assistant's discovery topics live under their own prefix::

    <discovery_prefix>/<component>/<node_id>/<object_id>/config   JSON, QoS 1, retained
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

DEFAULT_PREFIX = "edgefleet/v1"
KINDS = ("status", "caps", "telemetry", "cmd", "events")

# A board id is one topic level: no wildcards, no slashes, nothing a shell or ACL would trip on.
_BOARD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # whole string (fullmatch): "$" would take "pi-1\n"


def valid_board_id(board_id: str) -> bool:
    """True if ``board_id`` can stand as one MQTT topic level and a file name."""
    return bool(_BOARD_ID.fullmatch(board_id))


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


def events_json_topic(prefix: str, board_id: str) -> str:
    """Where a board publishes a JSON copy of its job events, for JSON tools (the msgpack ``events`` is authoritative)."""
    return f"{events_topic(prefix, board_id)}/json"


# Home Assistant accepts only these characters in a discovery topic's node_id and object_id.
_DISCOVERY_ID = re.compile(r"[A-Za-z0-9_-]+")
DISCOVERY_COMPONENTS = ("sensor", "binary_sensor")


def valid_discovery_id(text: str) -> bool:
    """True if ``text`` can be a Home Assistant discovery node_id or object_id ([a-zA-Z0-9_-]+)."""
    return bool(_DISCOVERY_ID.fullmatch(text))


def discovery_node_id(board_id: str) -> str:
    """A board's Home Assistant discovery node_id: its id, or (ids with a '.') the id made valid plus a short
    hash, so two boards never share one. The agent announces under it and ``forget`` clears it."""
    if valid_discovery_id(board_id):
        return board_id
    digest = hashlib.sha256(board_id.encode()).hexdigest()[:6]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', board_id)}_{digest}"


def discovery_device_id(node_id: str) -> str:
    """The identifier of a board's Home Assistant device (``device.identifiers`` in each of its discovery configs)."""
    return f"edgefleet_{node_id}"


def discovery_topic(discovery_prefix: str, component: str, node_id: str, object_id: str) -> str:
    """``<discovery_prefix>/<component>/<node_id>/<object_id>/config``, Home Assistant's MQTT discovery topic.

    Raises:
        ValueError: an unknown component, or an id Home Assistant would not accept.
    """
    if component not in DISCOVERY_COMPONENTS:
        raise ValueError(f"unknown discovery component {component!r}; expected one of {DISCOVERY_COMPONENTS}")
    for what, text in (("node_id", node_id), ("object_id", object_id)):
        if not valid_discovery_id(text):
            raise ValueError(f"discovery {what} {text!r} may hold only letters, digits, '_' and '-'")
    return f"{discovery_prefix}/{component}/{node_id}/{object_id}/config"


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
    "DISCOVERY_COMPONENTS",
    "KINDS",
    "BoardTopic",
    "board_topic",
    "caps_topic",
    "cmd_topic",
    "discovery_device_id",
    "discovery_node_id",
    "discovery_topic",
    "events_json_topic",
    "events_topic",
    "fleet_filter",
    "parse_board_topic",
    "status_topic",
    "telemetry_topic",
    "valid_board_id",
    "valid_discovery_id",
    "valid_prefix",
]
