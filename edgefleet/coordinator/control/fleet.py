"""The live fleet view: folds every board's status, caps and telemetry into one table of rows.

``ingest()`` is called on the MQTT network thread for every message and must stay cheap; a
malformed message (bad JSON, too large or deep, a value outside what a board can report) is
counted, logged once per board (and at most a few times a minute for the whole fleet), and never
stops the view. The board is then shown as ``bad-data``, never as healthy.

The view holds at most ``max_boards`` boards (default :data:`DEFAULT_MAX_BOARDS`), so a broker full
of bogus retained board ids cannot grow it without bound. When it is full, a new board that says it
is online, or sends a valid sample, takes the place of a leftover (a board that never sent a sample;
see ``_admit``); any other new board is ignored and counted (``ignored_boards()``), and the views say so.
Boards the caller names as ``preferred`` (those whose keys the coordinator holds, or that a job names)
come first: a new preferred board takes the place of a board that is not, so 600 bogus boards on a
broker without an ACL cannot push a real one out of the view.
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
from edgefleet.transport.log_limit import LogLimiter, suppressed_text

log = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a sample older than this many intervals is shown as stale
DEFAULT_MAX_BOARDS = 512  # boards one view holds; more are ignored and counted (status --max-boards)
MAX_IGNORED_TRACKED = 10_000  # distinct ignored board ids remembered for the count (then "at least")
BAD_LOG_BURST = 5  # boards' first malformed messages logged per minute, fleet-wide; the rest counted


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
_CLAIM_NONE, _CLAIM_ONLINE, _CLAIM_SAMPLE = 0, 1, 2  # how strongly a new board's first message says it is real


def _claim(kind: str, message: object) -> int:
    if kind == "telemetry" and message is not None:
        return _CLAIM_SAMPLE
    if isinstance(message, BoardStatus) and message.state != "offline":
        return _CLAIM_ONLINE
    return _CLAIM_NONE


@dataclass
class FleetView:
    """Thread-safe fold of the fleet's MQTT messages."""

    prefix: str
    boards: dict[str, _Board] = field(default_factory=dict)
    messages: int = 0
    bad_messages: int = 0
    clock: Callable[[], float] = time.monotonic
    max_boards: int = DEFAULT_MAX_BOARDS
    preferred: frozenset[str] = frozenset()  # boards that come first when the view is full (see _admit)
    # Called with each accepted sample and the board's caps, under the view's lock (keep it cheap): the exporter's counters.
    on_sample: Callable[[TelemetrySample, BoardCaps | None], None] | None = field(default=None, repr=False)
    # Set by the monitor once the broker has delivered what it retained when we subscribed.
    replayed: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ignored: set[str] = field(default_factory=set, repr=False)
    _bad_log: LogLimiter = field(default_factory=lambda: LogLimiter(burst=BAD_LOG_BURST), repr=False)

    def __post_init__(self) -> None:
        if self.max_boards < 1:
            raise ValueError(f"max_boards = {self.max_boards}: a fleet view must hold at least one board")

    def ingest(self, topic: str, payload: bytes, retained: bool = False) -> None:
        parsed = parse_board_topic(self.prefix, topic)
        if parsed is None or parsed.kind not in _DECODERS:
            return
        now = self.clock()
        with self._lock:
            self.messages += 1
            board = self.boards.get(parsed.board_id)
            if not payload:  # an empty (retained) payload clears a topic: `forget` removed the board, it is not malformed
                if board is not None:
                    del self.boards[parsed.board_id]
                return
            try:
                message = _DECODERS[parsed.kind](payload)
            except DecodeError as exc:
                error = str(exc)
                message = None
            except Exception as exc:  # a decoder bug must not stop the fold: the message is bad data
                error = f"{type(exc).__name__} while decoding: {str(exc)[:200]}"
                message = None
            if board is None:
                board = self._admit(parsed.board_id, claim=_claim(parsed.kind, message))
                if board is None:
                    return
            if message is None:
                self._bad(board, parsed.kind, error)
                return
            if parsed.kind == "telemetry":
                assert isinstance(message, TelemetrySample)
                if message.board_id != board.board_id:
                    self._bad(board, "telemetry", f"sample claims board_id {message.board_id!r}")
                    return
                board.sample, board.sample_received = message, now
                board.last_good_n = self.messages
                if self.on_sample is not None:
                    self.on_sample(message, board.caps)
            elif parsed.kind == "status":
                assert isinstance(message, BoardStatus)
                board.status = message
            else:
                assert isinstance(message, BoardCaps)
                board.caps = message

    def _admit(self, board_id: str, *, claim: int) -> _Board | None:
        """A new board's entry, or None when the view is full (the id is counted as ignored). Under the lock.

        In a full view, a board that never sent a sample and says it is offline (or nothing) is a
        leftover: a new board that says it is online, or sends a valid sample, takes its place. A valid
        sample also displaces a board that only claims to be online. Junk displaces nobody.
        """
        if len(self.boards) >= self.max_boards:
            evict = None
            if board_id in self.preferred:
                evict = self._least_wanted()
            elif claim >= _CLAIM_ONLINE:
                silent = [b for b in self.boards.values() if b.sample is None and b.board_id not in self.preferred]
                evict = next((b for b in silent if b.status is None or b.status.state == "offline"), None)
                if evict is None and claim == _CLAIM_SAMPLE and silent:
                    evict = silent[0]
            if evict is None:
                self._ignore(board_id)
                return None
            del self.boards[evict.board_id]
            self._ignore(evict.board_id)
        self._ignored.discard(board_id)
        board = self.boards[board_id] = _Board(board_id)
        return board

    def _least_wanted(self) -> _Board | None:
        """The board a preferred one takes the place of: one not preferred, silent ones first. Under the lock."""
        others = [b for b in self.boards.values() if b.board_id not in self.preferred]
        return next((b for b in others if b.sample is None), others[0] if others else None)

    def _ignore(self, board_id: str) -> None:
        if not self._ignored:
            log.warning("more than %d boards on this broker and topic prefix: board %s and further new ones are not "
                        "shown. Raise the limit (status --max-boards), or clear the retained topics of boards that do "
                        "not exist (mosquitto_pub -r -n -t %s/boards/<id>/status)", self.max_boards, board_id, self.prefix)
        if len(self._ignored) < MAX_IGNORED_TRACKED:
            self._ignored.add(board_id)

    def ignored_boards(self) -> int:
        """How many distinct board ids the view left out for lack of room (at most MAX_IGNORED_TRACKED)."""
        with self._lock:
            return len(self._ignored)

    def _bad(self, board: _Board, kind: str, error: str) -> None:
        self.bad_messages += 1
        board.bad_messages += 1
        board.last_error, board.last_bad_n = f"{kind}: {error}", self.messages
        if board.bad_messages == 1:  # once per board, a few boards a minute; the count is in the view
            suppressed = self._bad_log.allow()
            if suppressed is not None:
                log.warning("board %s sent malformed %s (%s); dropped, and further ones from it are counted silently. "
                            "Check that board's agent version and sensors, or who else publishes with its credentials%s",
                            board.board_id, kind, error, suppressed_text(suppressed))

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
