"""The live fleet view: folds every board's status, caps and telemetry into one table of rows.

``ingest()`` is called on the MQTT network thread for every message and must stay cheap; a
malformed message is counted and logged once per board, and never stops the view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample, is_measured
from edgefleet.protocol.topics import parse_board_topic

log = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a sample older than this many intervals is shown as stale


@dataclass(slots=True)
class _Board:
    board_id: str
    status: BoardStatus | None = None
    caps: BoardCaps | None = None
    sample: TelemetrySample | None = None
    sample_received: float | None = None   # local monotonic time, immune to the board's clock
    bad_messages: int = 0
    last_error: str = ""
    last_bad_n: int = 0       # message counter when the last bad one came
    last_good_n: int = 0      # … and the last good sample


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardRow:
    """One board as the views show it."""

    board_id: str
    state: str               # online, offline, busy, unknown (telemetry but no status yet)
    health: str              # ok, stale, no-data, bad-data, offline
    age_s: float | None      # seconds since the last sample arrived here
    sample: TelemetrySample | None
    caps: BoardCaps | None
    offline_reason: str = ""
    bad_messages: int = 0
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        s = self.sample
        return {
            "board_id": self.board_id, "state": self.state, "health": self.health,
            "age_s": None if self.age_s is None else round(self.age_s, 2),
            "offline_reason": self.offline_reason,
            "cpu_percent": s.cpu_percent if s else None,
            "mem_used_bytes": s.mem_used_bytes if s else None,
            "mem_total_bytes": s.mem_total_bytes if s else None,
            "mem_percent": s.mem_percent if s else None,
            "net_rx_bytes_per_s": s.net_rx_bytes_per_s if s else None,
            "net_tx_bytes_per_s": s.net_tx_bytes_per_s if s else None,
            "temp_c": s.temp_c if s else None,
            "power_w": s.power_w if s else None,
            "power_source": s.power_source if s else None,
            "power_measured": is_measured(s.power_source) if s else None,
            "interval_s": s.interval_s if s else None,
            "seq": s.seq if s else None,
            "bad_messages": self.bad_messages, "last_error": self.last_error,
            "caps": None if self.caps is None else {
                "model": self.caps.model, "machine": self.caps.machine, "cores": self.caps.cores,
                "ram_bytes": self.caps.ram_bytes, "accelerator": self.caps.accelerator,
                "power_source": self.caps.power_source, "agent_version": self.caps.agent_version,
                "training_available": self.caps.training_available, "cpu_cores": self.caps.cpu_cores,
                "train_threads": self.caps.train_threads},
        }


_DECODERS = {"status": BoardStatus.from_json, "caps": BoardCaps.from_json, "telemetry": TelemetrySample.from_json}


@dataclass
class FleetView:
    """Thread-safe fold of the fleet's MQTT messages."""

    prefix: str
    boards: dict[str, _Board] = field(default_factory=dict)
    messages: int = 0
    bad_messages: int = 0
    clock: Callable[[], float] = time.monotonic
    # Set by the monitor once the broker has delivered what it retained when we subscribed.
    replayed: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ingest(self, topic: str, payload: bytes, retained: bool = False) -> None:
        parsed = parse_board_topic(self.prefix, topic)
        if parsed is None or parsed.kind not in _DECODERS:
            return
        now = self.clock()
        with self._lock:
            self.messages += 1
            board = self.boards.get(parsed.board_id)
            if board is None:
                if not payload and parsed.kind == "status":
                    return  # a cleared retained status of a board we never saw
                board = self.boards[parsed.board_id] = _Board(parsed.board_id)
            if not payload and parsed.kind == "status":
                del self.boards[parsed.board_id]  # the operator removed the board (cleared its retained topics)
                return
            try:
                message = _DECODERS[parsed.kind](payload)
            except DecodeError as exc:
                self._bad(board, parsed.kind, str(exc))
                return
            if parsed.kind == "telemetry":
                assert isinstance(message, TelemetrySample)
                if message.board_id != board.board_id:
                    self._bad(board, "telemetry", f"sample claims board_id {message.board_id!r}")
                    return
                board.sample, board.sample_received = message, now
                board.last_good_n = self.messages
            elif parsed.kind == "status":
                assert isinstance(message, BoardStatus)
                board.status = message
            else:
                assert isinstance(message, BoardCaps)
                board.caps = message

    def _bad(self, board: _Board, kind: str, error: str) -> None:
        self.bad_messages += 1
        board.bad_messages += 1
        board.last_error, board.last_bad_n = f"{kind}: {error}", self.messages
        if board.bad_messages == 1:  # once per board; the count is in the view
            log.warning("board %s sent malformed %s (%s); counting further ones silently", board.board_id, kind, error)

    def rows(self) -> list[BoardRow]:
        now = self.clock()
        with self._lock:
            return [self._row(b, now) for b in sorted(self.boards.values(), key=lambda b: b.board_id)]

    @staticmethod
    def _row(board: _Board, now: float) -> BoardRow:
        state = board.status.state if board.status else "unknown"
        age = None if board.sample_received is None else now - board.sample_received
        interval = board.sample.interval_s if board.sample else (board.status.interval_s if board.status else None)
        if state == "offline":
            health = "offline"
        elif board.last_bad_n > board.last_good_n:
            health = "bad-data"
        elif age is None:
            health = "no-data"
        elif interval is not None and age > STALE_INTERVALS * interval:
            health = "stale"
        else:
            health = "ok"
        return BoardRow(board_id=board.board_id, state=state, health=health, age_s=age, sample=board.sample,
                        caps=board.caps, offline_reason=board.status.reason if board.status and state == "offline" else "",
                        bad_messages=board.bad_messages, last_error=board.last_error)

    def waiting_for_samples(self) -> bool:
        """True while some board that says it is online has sent no sample yet."""
        with self._lock:
            return any(b.sample is None and b.status is not None and b.status.state != "offline" for b in self.boards.values())
