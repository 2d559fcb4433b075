"""The coordinator's MQTT side of a job: board status and job events in, signed commands out.

With the boards' public keys (``--board-keys DIR``, carried in ``fleet_key``: see
``protocol.signing.CoordinatorKeys``) every job event must carry its board's signature: an unsigned
or forged one is dropped with a warning naming the board (at most one a minute per board), so a
forged "failed" cannot drop a healthy board. A job with a board that has no key there is refused
before it starts. Without board keys, events are taken as they come (as before signed events).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import BrokerError, ConfigError, DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import BoardCaps, BoardStatus
from edgefleet.protocol.signing import (
    GENERATE_HINT,
    CoordinatorKeys,
    SignatureError,
    check_event_signature,
    sign_command,
)
from edgefleet.protocol.topics import caps_topic, cmd_topic, events_topic, parse_board_topic, status_topic
from edgefleet.transport.log_limit import LogLimiter, suppressed_text
from edgefleet.transport.mqtt_link import MqttLink
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

MALFORMED_LOG_BURST = 5  # warnings about malformed messages a minute; the rest are counted
EVENT_WARNING_INTERVAL_S = 60.0  # at most one warning a minute per board about events dropped as unsigned or forged


@dataclass
class BoardChannel:
    """Follows a set of boards' status and job events, and sends them signed commands."""

    settings: BrokerSettings
    fleet_key: bytes   # the coordinator's keys (CoordinatorKeys.to_bytes), or a legacy HMAC fleet key
    boards: list[str]
    status: dict[str, BoardStatus] = field(default_factory=dict)
    caps: dict[str, BoardCaps] = field(default_factory=dict)
    # Boards whose agent went offline since this channel opened (a live status, not a retained one), and why.
    went_offline: dict[str, str] = field(default_factory=dict)
    _events: asyncio.Queue[JobEvent] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _link: MqttLink | None = None
    _keys: CoordinatorKeys = field(init=False)
    _dropped: dict[str, tuple[float, int]] = field(default_factory=dict)  # board -> (last warning, dropped since)
    _malformed_log: LogLimiter = field(default_factory=lambda: LogLimiter(burst=MALFORMED_LOG_BURST), repr=False)

    def __post_init__(self) -> None:
        try:
            self._keys = CoordinatorKeys.from_bytes(self.fleet_key)
        except ValueError as exc:
            raise ConfigError(f"the fleet key cannot sign commands: {exc}; {GENERATE_HINT}") from None

    def check_board_keys(self) -> None:
        """With board keys, every board of the job must have one. Raises ConfigError naming those without."""
        keys = self._keys.board_keys
        if keys is None:
            return
        missing = [board for board in self.boards if board not in keys]
        if missing:
            source = self._keys.board_keys_source or "the board keys"
            raise ConfigError(f"--board-keys {source}: no public key for board(s) {', '.join(missing)} (expected "
                              f"{', '.join(b + '.pub' for b in missing)} there, holding an 'ed25519-public' line), so "
                              "their job events could not be told from forgeries. Fetch each board's key (the Ansible role "
                              "does; by hand: python -m edgefleet.transport.fleet_key --public /etc/edge-agent/board.key "
                              "on the board), leave those boards out (--boards), or leave out --board-keys")

    async def open(self, connect_timeout_s: float = 5.0) -> None:
        """Connect and subscribe.

        Raises:
            ConfigError: board keys were given and a board has none (before anything is sent).
            BrokerError: the broker cannot be reached or refused us.
        """
        self.check_board_keys()
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
                event = JobEvent.from_msgpack(payload, check=self._event_check(parsed.board_id))
                if event.board_id == parsed.board_id and self._loop is not None and self._events is not None:
                    self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except SignatureError as exc:
            self._drop_event(parsed.board_id, str(exc))
        except DecodeError as exc:
            shown = self._malformed_log.allow()  # junk a thousand times a second must not fill the log
            if shown is not None:
                log.warning("board %s sent a malformed %s message: %s%s", parsed.board_id, parsed.kind, exc,
                            suppressed_text(shown))

    def _event_check(self, board: str) -> Callable[[dict[str, Any]], None] | None:
        """What an event from ``board`` must pass: its signature with board keys, nothing without."""
        keys = self._keys.board_keys
        if keys is None:
            return None
        public = keys.get(board)
        if public is None:
            def refuse(fields: dict[str, Any]) -> None:
                raise SignatureError(f"board {board} has no key in {self._keys.board_keys_source}")
            return refuse
        return lambda fields: check_event_signature(fields, public)

    def _drop_event(self, board: str, reason: str) -> None:
        """Drop an event that fails its signature check; warn at most once a minute per board."""
        now = time.monotonic()
        last, count = self._dropped.get(board, (-math.inf, 0))
        if now - last < EVENT_WARNING_INTERVAL_S:
            self._dropped[board] = (last, count + 1)
            return
        also = f" ({count} more since the last warning)" if count else ""
        log.warning("dropped a job event on board %s's topic: %s%s. Either someone forges events for it, or its key "
                    "changed (e.g. the board was reinstalled): then fetch its public key into %s/%s.pub again",
                    board, reason, also, self._keys.board_keys_source or "the --board-keys directory", board)
        self._dropped[board] = (now, 0)

    async def wait_for_status(self, timeout_s: float = 3.0) -> None:
        """Give the retained statuses time to arrive (returns early once every board has one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(b not in self.status for b in self.boards):
            await asyncio.sleep(0.05)

    def send(self, board_id: str, command: dict[str, Any], *, wait_s: float = 0.0) -> None:
        """Sign and publish a command (QoS 1); with ``wait_s``, wait that long for the broker's ack."""
        assert self._link is not None
        payload = sign_command(command, key=self._keys)
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
