"""The coordinator's MQTT side of a job: board status and job events in, signed commands out.

With the boards' public keys (``--board-keys DIR``, carried in ``fleet_key``: see
``protocol.signing.CoordinatorKeys``) every job event must carry its board's signature: an unsigned
or forged one is dropped with a warning naming the board (at most one a minute per board), so a
forged "failed" cannot drop a healthy board. A job with a board that has no key there is refused
before it starts. Without board keys, events are taken as they come (as before signed events).

A board none of whose events for a job verifies (its events are unsigned, or signed with another key
than the coordinator holds for it: a reinstalled board) is named with the reason by
:meth:`BoardChannel.unverified`, so the join ends within seconds instead of timing out.

Statuses are not signed. An ``offline`` status counts (:attr:`BoardChannel.went_offline`) once it has
stood :data:`OFFLINE_CONFIRM_S` with no later status of the board saying otherwise: a running agent
answers an ``offline`` on its own topic at once with its real status, so a forged one never stands that
long, while the broker's last will for a dead agent does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import BrokerError, ConfigError, DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.signing import (
    GENERATE_HINT,
    CoordinatorKeys,
    SignatureError,
    check_event_signature,
    sign_command,
)
from edgefleet.protocol.topics import caps_topic, cmd_topic, events_topic, parse_board_topic, status_topic, telemetry_topic
from edgefleet.transport.log_limit import LogLimiter, suppressed_text
from edgefleet.transport.mqtt_link import MqttLink, coordinator_client_id
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

MALFORMED_LOG_BURST = 5  # warnings about malformed messages a minute; the rest are counted
EVENT_WARNING_INTERVAL_S = 60.0  # at most one warning a minute per board about events dropped as unsigned or forged
OFFLINE_CONFIRM_S = 3.0  # an offline status counts once it stood this long unanswered (a live agent answers a forged one)
MAX_UNVERIFIED = 256  # (board, job) pairs with failed events remembered: forgeries naming made-up jobs cannot fill memory
KEY_HINT = ("put its current public key in {pub} (on the board: python -m edgefleet.transport.fleet_key --public "
            "/etc/edge-agent/board.key; with Ansible: run the playbook on the board and the coordinator), or leave it "
            "out of --boards")


class _EventRefused(SignatureError):
    """An event that fails its signature check, with the job it names (if any)."""

    def __init__(self, reason: str, job_id: str | None) -> None:
        super().__init__(reason)
        self.job_id = job_id


@dataclass
class BoardChannel:
    """Follows a set of boards' status and job events, and sends them signed commands."""

    settings: BrokerSettings
    fleet_key: bytes   # the coordinator's keys (CoordinatorKeys.to_bytes), or a legacy HMAC fleet key
    boards: list[str]
    status: dict[str, BoardStatus] = field(default_factory=dict)
    caps: dict[str, BoardCaps] = field(default_factory=dict)
    telemetry: dict[str, TelemetrySample] = field(default_factory=dict)  # each board's latest (why a board slowed)
    # Boards whose live (not retained) offline status is waiting for OFFLINE_CONFIRM_S: (when it came, why).
    _offline: dict[str, tuple[float, str]] = field(default_factory=dict)
    # (board, job id) -> (when, reason) of the first event that failed verification; (board, job id) that verified.
    _unverified: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    _verified: set[tuple[str, str]] = field(default_factory=set)
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
                link.subscribe(telemetry_topic(prefix, board), qos=0)

        self._link = MqttLink(self.settings, client_id=coordinator_client_id("train"),
                              on_connect=subscribe, on_message=self._on_message)
        self._link.start()
        connected = await asyncio.get_running_loop().run_in_executor(None, self._link.wait_connected, connect_timeout_s)
        if not connected:
            why = self._link.last_failure or "no answer"
            self._link.close()
            raise BrokerError(f"could not connect to the broker at {self.settings.address()} within "
                              f"{connect_timeout_s:.0f} s: {why}; check --broker, $EDGEFLEET_BROKER or the [broker] section")

    def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        parsed = parse_board_topic(self.settings.topic_prefix, topic)
        if parsed is None or not payload:
            return
        try:
            if parsed.kind == "status":
                status = self.status[parsed.board_id] = BoardStatus.from_json(payload)
                if status.state == "offline" and not retained:
                    self._offline.setdefault(parsed.board_id, (time.monotonic(), status.reason or "no reason given"))
                elif status.state != "offline":
                    self._offline.pop(parsed.board_id, None)
            elif parsed.kind == "caps":
                self.caps[parsed.board_id] = BoardCaps.from_json(payload)
            elif parsed.kind == "telemetry":
                sample = TelemetrySample.from_json(payload)
                if sample.board_id == parsed.board_id:
                    self.telemetry[parsed.board_id] = sample
            elif parsed.kind == "events":
                event = JobEvent.from_msgpack(payload, check=self._event_check(parsed.board_id))
                if event.board_id == parsed.board_id and self._loop is not None and self._events is not None:
                    if self._keys.board_keys is not None:
                        self._verified.add((parsed.board_id, event.job_id))
                    self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except _EventRefused as exc:
            key = (parsed.board_id, exc.job_id or "")
            if exc.job_id is not None and (key in self._unverified or len(self._unverified) < MAX_UNVERIFIED):
                self._unverified.setdefault(key, (time.monotonic(), str(exc)))
            self._drop_event(parsed.board_id, str(exc))
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

        def check(fields: dict[str, Any]) -> None:
            try:
                check_event_signature(fields, public)
            except SignatureError as exc:
                job = fields.get("job_id")
                raise _EventRefused(str(exc), job if isinstance(job, str) else None) from None
        return check

    @property
    def went_offline(self) -> dict[str, str]:
        """Boards whose agent went offline since this channel opened (a live status that stood
        :data:`OFFLINE_CONFIRM_S` unanswered, not a retained one), and why."""
        now = time.monotonic()
        return {board: reason for board, (since, reason) in list(self._offline.items())
                if now - since >= OFFLINE_CONFIRM_S}

    def unverified(self, job_id: str, grace_s: float) -> dict[str, str]:
        """Boards with an event for ``job_id`` that failed verification at least ``grace_s`` ago and none that
        passed (with board keys only): board -> why, with what to do. A board that proved itself with one good
        event keeps its place whatever else arrives on its topic."""
        now = time.monotonic()
        return {board: self._unverified_reason(board, reason)
                for (board, job), (since, reason) in list(self._unverified.items())
                if job == job_id and now - since >= grace_s and (board, job_id) not in self._verified}

    def _unverified_reason(self, board: str, reason: str) -> str:
        """Why ``board``'s events fail verification, in words an operator can act on."""
        source = self._keys.board_keys_source or "the --board-keys directory"
        pub = f"{source}/{board}.pub"
        if reason.startswith("unsigned event"):
            return (f"its job events are unsigned, so this coordinator (--board-keys {source}) cannot tell them from "
                    "forgeries: its agent has no security.board_key_file (a reinstalled board?). Give it one "
                    "(python -m edgefleet.transport.fleet_key --generate --output /etc/edge-agent/board.key, named as "
                    f"board_key_file in its agent.toml), then {KEY_HINT.format(pub=pub)}")
        return (f"its job events are signed with another key than the one this coordinator holds for it in {pub} "
                f"({reason}; a reinstalled board whose key was made anew?): {KEY_HINT.format(pub=pub)}")

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
        """Give the retained statuses and capabilities time to arrive (returns early once every board has both: the
        broker sends each topic's retained message on its own, and a pipeline's command needs every board's address
        from its capabilities)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(b not in self.status or b not in self.caps for b in self.boards):
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
