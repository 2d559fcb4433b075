"""The board's energy total: its power readings integrated over time, kept across agent restarts.

Home Assistant's Energy dashboard (and any meter-style consumer) wants a total that only grows:
``state_class: total_increasing``. :class:`EnergyMeter` integrates each sample's ``power_w`` with
the trapezoid rule over the monotonic time between samples and publishes the running total as the
telemetry field ``energy_wh``. It integrates what the board reports, a sensor's reading or the
CPU-based estimate alike; ``power_source`` says which (see docs/telemetry.md).

A gap of more than :data:`MAX_GAP_INTERVALS` telemetry intervals between two readings (a
suspended board, a stalled loop, a sensor that gave nothing) adds nothing: the power during it is
unknown, and a guess would be worse than a slight undercount.

With a ``state_dir`` the total is kept in ``<state_dir>/energy-<board_id>.json``
(``{"version": 1, "board_id": ..., "energy_wh": ..., "ts": <unix s>}``, replaced whole by
``transport.atomic_file.write_atomically``), written every :data:`SAVE_EVERY_S` and when the
agent stops, so a restart continues from it. A crash loses at most that long's energy: the total
then dips a little, which Home Assistant accepts in a ``total_increasing`` sensor (a drop of less
than 10% is not taken for a meter reset). Without a ``state_dir`` the total starts at 0 with each
start, which Home Assistant counts as a new meter cycle: nothing is counted twice.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from edgefleet.protocol.messages import MAX_ENERGY_WH
from edgefleet.transport.atomic_file import write_atomically

log = logging.getLogger(__name__)

ENERGY_FILE_VERSION = 1
SAVE_EVERY_S = 300.0        # how often the running total is written to the state_dir (and at every clean stop)
MAX_GAP_INTERVALS = 5.0     # readings further apart than this many intervals are not integrated across
_MAX_RECORD_BYTES = 4096


def energy_file_path(state_dir: str, board_id: str) -> Path | None:
    """Where a board's energy total is kept (one file per board id); None without a state_dir."""
    return Path(state_dir) / f"energy-{board_id}.json" if state_dir else None


def load_energy_wh(path: Path, board_id: str) -> float:
    """The total kept in ``path``.

    Raises:
        FileNotFoundError: no record yet.
        OSError: it cannot be read.
        ValueError: it is not a record of this board (the message says what is wrong).
    """
    with path.open("rb") as f:
        data = f.read(_MAX_RECORD_BYTES + 1)
    if len(data) > _MAX_RECORD_BYTES:
        raise ValueError(f"over {_MAX_RECORD_BYTES} bytes")
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(record, dict) or record.get("version") != ENERGY_FILE_VERSION:
        raise ValueError(f"not a version-{ENERGY_FILE_VERSION} energy record")
    if record.get("board_id") != board_id:
        raise ValueError(f"the record of board {record.get('board_id')!r}, not of {board_id!r}")
    total = record.get("energy_wh")
    if isinstance(total, bool) or not isinstance(total, (int, float)) or not 0 <= total <= MAX_ENERGY_WH:
        raise ValueError(f"energy_wh {total!r:.40} is not a number from 0 to {MAX_ENERGY_WH:g}")
    return float(total)


class EnergyMeter:
    """One board's running energy total, fed one power reading per telemetry sample.

    Args:
        board_id: the board (the record names it, so a copied state_dir is not counted twice).
        interval_s: the telemetry interval, for :data:`MAX_GAP_INTERVALS`.
        record: the file that keeps the total across restarts (:func:`energy_file_path`), or None.
        clock: monotonic seconds (tests drive their own).
    """

    def __init__(self, *, board_id: str, interval_s: float, record: Path | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.board_id = board_id
        self.record = record
        self.max_gap_s = MAX_GAP_INTERVALS * interval_s
        self._clock = clock
        self._total_wh = 0.0
        self._saved_wh = 0.0
        self._last: tuple[float, float] | None = None  # (when, watts) of the previous reading
        self._reading = False    # a power reading arrived since the agent started: the total is reported
        self._save_failed = False
        self._last_save = clock()
        if record is not None:
            try:
                self._total_wh = self._saved_wh = load_energy_wh(record, board_id)
                log.info("energy: continuing from %.4g Wh (%s)", self._total_wh, record)
            except FileNotFoundError:
                log.info("energy: no record yet at %s; counting from 0 Wh", record)
            except (OSError, ValueError) as exc:
                log.warning("energy: the record %s is unusable (%s); counting from 0 Wh, which Home Assistant takes for "
                            "a new meter cycle", record, exc)

    @property
    def total_wh(self) -> float:
        return self._total_wh

    def add(self, power_w: float | None) -> float | None:
        """Integrate one reading; returns the total in Wh (rounded to 0.1 mWh), or None while the board has
        given no power reading since the agent started (``power.source = "none"``)."""
        now = self._clock()
        if power_w is None or not math.isfinite(power_w) or power_w < 0:
            self._last = None  # the next reading starts a new segment: the gap is not guessed
        else:
            if self._last is not None and 0 < now - self._last[0] <= self.max_gap_s:
                self._total_wh = min(MAX_ENERGY_WH, self._total_wh + (self._last[1] + power_w) / 2 * (now - self._last[0]) / 3600)
            self._last = (now, power_w)
            self._reading = True
        if self.record is not None and now - self._last_save >= SAVE_EVERY_S:
            self.save()
        return round(self._total_wh, 4) if self._reading else None

    def save(self) -> None:
        """Write the total to the record if it grew since the last write; a failure is logged once, not raised."""
        self._last_save = self._clock()
        if self.record is None or self._total_wh == self._saved_wh:
            return
        data = json.dumps({"version": ENERGY_FILE_VERSION, "board_id": self.board_id, "energy_wh": self._total_wh,
                           "ts": round(time.time(), 3)}, separators=(",", ":")).encode()
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.record, data, mode=0o600)
        except OSError as exc:
            if not self._save_failed:
                log.warning("energy: cannot write %s (%s); the total restarts from its last saved value after a "
                            "restart", self.record, exc)
            self._save_failed = True
            return
        self._saved_wh = self._total_wh
        self._save_failed = False


__all__ = ["ENERGY_FILE_VERSION", "MAX_GAP_INTERVALS", "SAVE_EVERY_S", "EnergyMeter", "energy_file_path", "load_energy_wh"]
