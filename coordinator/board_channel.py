"""The coordinator's MQTT side of a job: board status and job events in, signed commands out."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import BrokerError, DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import BoardCaps, BoardStatus
from edgefleet.protocol.signing import sign_command
from edgefleet.protocol.topics import caps_topic, cmd_topic, events_topic, parse_board_topic, status_topic
from edgefleet.transport.mqtt_link import MqttLink
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)


@dataclass
class BoardChannel:
    """Follows a set of boards' status and job events, and sends them signed commands."""

    settings: BrokerSettings
    fleet_key: bytes
    boards: list[str]
    status: dict[str, BoardStatus] = field(default_factory=dict)
    caps: dict[str, BoardCaps] = field(default_factory=dict)
    # Boards whose agent went offline since this channel opened (a live status, not a retained one), and why.
    went_offline: dict[str, str] = field(default_factory=dict)
    _events: asyncio.Queue[JobEvent] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _link: MqttLink | None = None

    async def open(self, connect_timeout_s: float = 5.0) -> None:
        """Connect and subscribe.

        Raises:
            BrokerError: the broker cannot be reached or refused us.
        """
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        prefix = self.settings.topic_prefix

        def subscribe(link: MqttLink) -> None:
            for board in self.boards:
                for topic in (status_topic(prefix, board), caps_topic(prefix, board), events_topic(prefix, board)):
                    link.subscribe(topic, qos=1)

        self._link = MqttLink(self.settings, client_id=f"edge-coordinator-train-{socket.gethostname()}-{os.getpid()}",
                              on_connect=subscribe, on_message=self._on_message)
        self._link.start()
        connected = await asyncio.get_running_loop().run_in_executor(None, self._link.wait_connected, connect_timeout_s)
        if not connected:
            self._link.close()
            raise BrokerError(f"could not connect to the broker at {self.settings.address()} within "
                              f"{connect_timeout_s:.0f} s; check --broker, $EDGEFLEET_BROKER or the [broker] section")

    def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        parsed = parse_board_topic(self.settings.topic_prefix, topic)
        if parsed is None or not payload:
            return
        try:
            if parsed.kind == "status":
                status = self.status[parsed.board_id] = BoardStatus.from_json(payload)
                if status.state == "offline" and not retained:
                    self.went_offline[parsed.board_id] = status.reason or "no reason given"
                elif status.state != "offline":
                    self.went_offline.pop(parsed.board_id, None)
            elif parsed.kind == "caps":
                self.caps[parsed.board_id] = BoardCaps.from_json(payload)
            elif parsed.kind == "events":
                event = JobEvent.from_msgpack(payload)
                if event.board_id == parsed.board_id and self._loop is not None and self._events is not None:
                    self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except DecodeError as exc:
            log.warning("board %s sent a malformed %s message: %s", parsed.board_id, parsed.kind, exc)

    async def wait_for_status(self, timeout_s: float = 3.0) -> None:
        """Give the retained statuses time to arrive (returns early once every board has one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(b not in self.status for b in self.boards):
            await asyncio.sleep(0.05)

    def send(self, board_id: str, command: dict[str, Any], *, wait_s: float = 0.0) -> None:
        """Sign and publish a command (QoS 1); with ``wait_s``, wait that long for the broker's ack."""
        assert self._link is not None
        payload = sign_command(command, key=self.fleet_key)
        info = self._link.publish(cmd_topic(self.settings.topic_prefix, board_id), payload, qos=1)
        if wait_s > 0:
            try:
                info.wait_for_publish(wait_s)
            except (ValueError, RuntimeError):
                log.warning("the command to board %s may not have reached the broker", board_id)

    def drain_events(self) -> list[JobEvent]:
        """Events received since the last call (never blocks)."""
        assert self._events is not None
        out = []
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out

    async def next_event(self, timeout_s: float) -> JobEvent | None:
        assert self._events is not None
        try:
            return await asyncio.wait_for(self._events.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        if self._link is not None:
            self._link.close(timeout_s=2.0)
