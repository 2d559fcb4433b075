"""Connects a FleetView to the broker: subscribe to every board's status, caps and telemetry."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from edgefleet.coordinator.control.fleet import DEFAULT_MAX_BOARDS, FleetView
from edgefleet.protocol.errors import BrokerError
from edgefleet.protocol.topics import cmd_topic, fleet_filter
from edgefleet.transport.mqtt_link import MqttLink, coordinator_client_id
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

MONITOR_KEEPALIVE_S = 60
# The replay marker goes to the command topic of a board that cannot exist (ids start with a letter
# or digit), which the coordinator's ACL lets it write and read and no agent listens on.
_MARKER_BOARD = "_replayed"
REPLAY_TIMEOUT_S = 5.0  # the marker normally returns in milliseconds; a busy machine may take seconds


@contextmanager
def monitor_fleet(settings: BrokerSettings, *, connect_timeout_s: float = 5.0, max_boards: int = DEFAULT_MAX_BOARDS,
                  preferred: Iterable[str] = ()) -> Iterator[FleetView]:
    """Yield a FleetView that the broker keeps up to date until the block ends.

    Every message is decoded under the protocol's size, depth and range limits; one that fails them
    marks its board as sending bad data, and one that makes the fold raise is dropped by the link
    with a warning, so no board can stop the view. At most ``max_boards`` boards are held; the ``preferred`` ones
    (whose keys the coordinator holds, or that a job names) come first.

    Raises:
        BrokerError: the broker could not be reached or refused us within ``connect_timeout_s``.
    """
    view = FleetView(settings.topic_prefix, max_boards=max_boards, preferred=frozenset(preferred))
    marker_topic = cmd_topic(settings.topic_prefix, f"{_MARKER_BOARD}-{socket.gethostname()}-{os.getpid()}")
    # A subscriber busy folding thousands of messages a second can miss paho's ping deadline and
    # reconnect with a clean session, losing what the broker had queued: give it a longer keepalive.
    settings = dataclasses.replace(settings, keepalive_s=max(settings.keepalive_s, MONITOR_KEEPALIVE_S))

    def subscribe(link: MqttLink) -> None:
        for kind in ("status", "caps", "telemetry"):
            link.subscribe(fleet_filter(settings.topic_prefix, kind), qos=1)
        # The broker answers a connection's packets in order: this marker comes back after every
        # retained message the subscriptions above replay, however slow the machine is.
        link.subscribe(marker_topic, qos=1)
        link.publish(marker_topic, b"", qos=1)

    def ingest(topic: str, payload: bytes, retained: bool = False) -> None:
        if topic == marker_topic:
            view.replayed.set()
        else:
            view.ingest(topic, payload, retained)

    # One id per view: two views in one process (train's power log, --metrics-listen) must not take each other's session.
    link = MqttLink(settings, client_id=coordinator_client_id("monitor"),
                    on_connect=subscribe, on_message=ingest)
    link.start()
    try:
        if not link.wait_connected(connect_timeout_s):
            raise BrokerError(f"could not connect to the broker at {settings.address()} within {connect_timeout_s:.0f} s: "
                              f"{link.last_failure or 'no answer'}; check --broker, $EDGEFLEET_BROKER or the [broker] "
                              "section")
        yield view
    finally:
        link.close()


def wait_for_snapshot(view: FleetView, *, timeout_s: float) -> None:
    """Wait for the retained messages, then until every online board has sent a sample or time runs out."""
    deadline = time.monotonic() + timeout_s
    replay_s = max(timeout_s, REPLAY_TIMEOUT_S)
    if not view.replayed.wait(replay_s):
        log.warning("the broker did not return our replay marker within %.0f s (does its ACL forbid this user "
                    "to write boards/+/cmd?); the fleet shown may miss boards", replay_s)
    while view.waiting_for_samples() and time.monotonic() < deadline:
        time.sleep(0.05)
