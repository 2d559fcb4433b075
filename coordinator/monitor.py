"""Connects a FleetView to the broker: subscribe to every board's status, caps and telemetry."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from coordinator.fleet import FleetView
from protocol.errors import BrokerError
from protocol.mqtt_link import MqttLink
from protocol.settings import BrokerSettings
from protocol.topics import fleet_filter

MONITOR_KEEPALIVE_S = 60
SETTLE_S = 0.3  # retained status and caps arrive right after the subscription; give them this long


@contextmanager
def monitor_fleet(settings: BrokerSettings, *, connect_timeout_s: float = 5.0) -> Iterator[FleetView]:
    """Yield a FleetView that the broker keeps up to date until the block ends.

    Raises:
        BrokerError: the broker could not be reached or refused us within ``connect_timeout_s``.
    """
    view = FleetView(settings.topic_prefix)
    # A subscriber busy folding thousands of messages a second can miss paho's ping deadline and
    # reconnect with a clean session, losing what the broker had queued: give it a longer keepalive.
    settings = dataclasses.replace(settings, keepalive_s=max(settings.keepalive_s, MONITOR_KEEPALIVE_S))

    def subscribe(link: MqttLink) -> None:
        for kind in ("status", "caps", "telemetry"):
            link.subscribe(fleet_filter(settings.topic_prefix, kind), qos=1)

    link = MqttLink(settings, client_id=f"edge-coordinator-{socket.gethostname()}-{os.getpid()}",
                    on_connect=subscribe, on_message=view.ingest)
    link.start()
    try:
        if not link.wait_connected(connect_timeout_s):
            raise BrokerError(f"could not connect to the broker at {settings.address()} within {connect_timeout_s:.0f} s "
                              f"(see the warning above); check --broker, $EDGEFLEET_BROKER or the [broker] section")
        yield view
    finally:
        link.close()


def wait_for_snapshot(view: FleetView, *, timeout_s: float) -> None:
    """Wait for retained messages, then until every online board has sent a sample or time runs out."""
    start = time.monotonic()
    time.sleep(SETTLE_S)
    while view.waiting_for_samples() and time.monotonic() - start < timeout_s:
        time.sleep(0.05)
