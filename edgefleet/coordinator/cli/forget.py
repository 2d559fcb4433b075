"""``edge-coordinator forget BOARD``: clear a retired board's retained topics.

A board's status and caps are retained, so a board that is gone for good stays in ``status``, in
Home Assistant and in every other MQTT consumer as "offline" forever. Publishing an empty retained
payload is how MQTT deletes a retained message; this does it for every retained topic under the
board, then reads them back, because a broker whose ACL forbids the write drops it without a word
(MQTT 3.1.1 acknowledges a denied publish like any other).

The board's Home Assistant discovery configs (``<discovery_prefix>/<component>/<node_id>/<object_id>/config``,
retained by an agent with ``telemetry.home_assistant``) are cleared the same way, or Home Assistant
keeps the board as a device whose every sensor is unavailable. They are looked for under any
one-level discovery prefix (``homeassistant``, the default, or another) and the board's node_id
(``protocol.topics.discovery_node_id``); only configs whose device is the board's own
(``discovery_device_id``) are cleared, never another integration's that happens to share the node_id.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field

from edgefleet.coordinator.cli.shared import load_config
from edgefleet.protocol.errors import BrokerError, ConfigError, EdgeTrainError
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.topics import (
    DISCOVERY_COMPONENTS,
    cmd_topic,
    discovery_device_id,
    discovery_node_id,
    status_topic,
    valid_board_id,
)
from edgefleet.transport.mqtt_link import MqttLink, coordinator_client_id
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # connecting, reading the retained messages back, and each acknowledgement
_LIVE_STATES = ("online", "busy")
# The read-back marker goes to the command topic of a board that cannot exist (ids start with a
# letter or digit), which the coordinator's ACL lets it write and read, as coordinator.control.monitor does.
_MARKER_BOARD = "_forget"


def add_forget_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    forget = sub.add_parser("forget", help="clear a retired board's retained topics (status, caps, Home Assistant discovery, ...)",
                            description="Clear every retained topic under a board (its status, caps and anything else kept "
                                        "there) and its Home Assistant discovery configs by publishing empty retained payloads, "
                                        "so status, Home Assistant and other MQTT consumers stop showing a board that is gone. "
                                        "The board's agent must be stopped: a running agent publishes them again.")
    forget.add_argument("board", metavar="BOARD", help="the board's id, as status shows it")
    forget.add_argument("-y", "--yes", action="store_true", help="clear without asking (needed when stdin is not a terminal)")
    forget.add_argument("--force", action="store_true", help="clear even though the board says it is online")


@dataclass
class _Collector:
    """Retained messages under one board, until the marker says the broker has sent them all."""

    marker: str = ""
    retained: dict[str, bytes] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def expect(self, marker: str) -> None:
        """Start a new read that ends when ``marker`` comes back."""
        self.marker, self.retained, self.done = marker, {}, threading.Event()

    def on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        if topic == self.marker:
            self.done.set()
        elif retained and payload:
            self.retained[topic] = payload


def board_filter(prefix: str, board_id: str) -> str:
    """Every topic under one board (``<prefix>/boards/<id>/#``), built from the protocol's status topic."""
    return status_topic(prefix, board_id).rsplit("/", 1)[0] + "/#"


def discovery_filters(board_id: str) -> list[str]:
    """Where the board's Home Assistant discovery configs can be: each component under any one-level discovery prefix."""
    node = discovery_node_id(board_id)
    return [f"+/{component}/{node}/+/config" for component in DISCOVERY_COMPONENTS]


def is_board_discovery_config(payload: bytes, board_id: str) -> bool:
    """True for a discovery config that announces an entity of the board's own Home Assistant device."""
    try:
        config = json.loads(payload)
    except ValueError:  # UnicodeDecodeError included
        return False
    device = config.get("device") if isinstance(config, dict) else None
    identifiers = device.get("identifiers") if isinstance(device, dict) else None
    return isinstance(identifiers, list) and discovery_device_id(discovery_node_id(board_id)) in identifiers


def read_retained(link: MqttLink, collector: _Collector, board_id: str, *, round_no: int) -> dict[str, bytes]:
    """The board's retained topics and payloads, as the broker holds them now: those under the board, and its
    Home Assistant discovery configs (:func:`discovery_filters`, :func:`is_board_discovery_config`).

    Raises:
        BrokerError: the broker did not return the marker within ``TIMEOUT_S``.
    """
    settings = link.settings
    collector.expect(cmd_topic(settings.topic_prefix, f"{_MARKER_BOARD}-{socket.gethostname()}-{os.getpid()}-{round_no}"))
    # The broker answers one connection's packets in order: the marker returns after every retained
    # message the subscription replays (each SUBSCRIBE replays them, the second one too).
    under_board = board_filter(settings.topic_prefix, board_id)
    for topic_filter in (under_board, *discovery_filters(board_id)):
        link.subscribe(topic_filter, qos=1)
    link.subscribe(collector.marker, qos=1)
    link.publish(collector.marker, b"", qos=1)
    if not collector.done.wait(TIMEOUT_S):
        raise BrokerError(f"the broker at {settings.address()} did not return our marker within {TIMEOUT_S:.0f} s "
                          f"(does its ACL let user {settings.username or '(none)'!r} write and read boards/+/cmd?)")
    head = under_board[:-1]
    return {topic: payload for topic, payload in collector.retained.items()
            if topic.startswith(head) or is_board_discovery_config(payload, board_id)}


def _is_online(payload: bytes) -> str:
    """The board's state if its retained status says it is running, else ''."""
    try:
        state = BoardStatus.from_json(payload).state
    except (EdgeTrainError, ValueError, TypeError):
        return ""
    return state if state in _LIVE_STATES else ""


def _confirm(board_id: str, topics: list[str]) -> bool:
    if not sys.stdin.isatty():
        raise ConfigError(f"forget {board_id} would clear {len(topics)} retained topics; add --yes to clear them without asking")
    print("\n".join(f"  {topic}" for topic in topics))
    answer = input(f"Clear these {len(topics)} retained topic(s) of board {board_id}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def clear_retained(link: MqttLink, topics: list[str]) -> None:
    """Publish an empty retained payload (MQTT's delete) on each topic and wait for the acknowledgements.

    Raises:
        BrokerError: a publish was not acknowledged within ``TIMEOUT_S``.
    """
    infos = [link.publish(topic, b"", qos=1, retain=True) for topic in topics]
    for topic, info in zip(topics, infos):
        try:
            info.wait_for_publish(TIMEOUT_S)
        except (ValueError, RuntimeError) as exc:
            raise BrokerError(f"clearing {topic} failed: {exc}") from None
        if not info.is_published():
            raise BrokerError(f"the broker did not acknowledge clearing {topic} within {TIMEOUT_S:.0f} s")


def forget_board(settings: BrokerSettings, board_id: str, *, force: bool, yes: bool) -> int:
    """Clear ``board_id``'s retained topics, printing what was cleared; returns the exit status.

    Raises:
        BrokerError: the broker cannot be reached, or it kept a topic (its ACL refused the write).
        ConfigError: the board is online without ``force``, or confirmation is needed and cannot be asked.
    """
    collector = _Collector()
    link = MqttLink(settings, client_id=coordinator_client_id("forget"),
                    on_message=collector.on_message)
    link.start()
    try:
        if not link.wait_connected(TIMEOUT_S):
            raise BrokerError(f"could not connect to the broker at {settings.address()} within {TIMEOUT_S:.0f} s "
                              "(see the warning above); check --broker, $EDGEFLEET_BROKER or the [broker] section")
        retained = read_retained(link, collector, board_id, round_no=1)
        prefix = board_filter(settings.topic_prefix, board_id)[:-1]
        if not retained:
            print(f"edge-coordinator: nothing to clear: no retained topics under {prefix} "
                  "(check the id: edge-coordinator status lists the boards)", file=sys.stderr)
            return 1
        state = _is_online(retained.get(status_topic(settings.topic_prefix, board_id), b""))
        if state and not force:
            raise ConfigError(f"board {board_id} is {state}: stop its agent first (a running agent publishes its topics "
                              "again), or add --force")
        topics = sorted(retained)
        if not yes and not _confirm(board_id, topics):
            print("nothing cleared")
            return 1
        clear_retained(link, topics)
        kept = sorted(read_retained(link, collector, board_id, round_no=2).keys() & set(topics))
        if kept:
            raise BrokerError(f"the broker kept {', '.join(kept)}: its ACL does not let user {settings.username or '(none)'!r} "
                              "write there (the Ansible broker role's ACL lets the coordinator clear status and caps, and "
                              "with mqtt_broker_home_assistant the discovery configs)")
    finally:
        link.close()
    own = [t.removeprefix(prefix) for t in topics if t.startswith(prefix)]
    discovery = [t for t in topics if not t.startswith(prefix)]
    print(f"cleared {len(topics)} retained topic(s) of board {board_id}: " + ", ".join(own)
          + (f"{'; ' if own else ''}{len(discovery)} Home Assistant discovery config(s) under "
             f"{', '.join(sorted({t.split('/', 1)[0] for t in discovery}))}/+/{discovery_node_id(board_id)}/"
             if discovery else ""))
    if state:
        print(f"edge-coordinator: board {board_id} said it was {state}; while its agent runs it publishes them again", file=sys.stderr)
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """``edge-coordinator forget``; returns the exit status."""
    if not valid_board_id(args.board):
        raise ConfigError(f"{args.board!r} is not a board id (letters, digits, '.', '_' and '-', starting with a letter or digit)")
    cfg = load_config(args)
    return forget_board(cfg.broker, args.board, force=args.force, yes=args.yes)
