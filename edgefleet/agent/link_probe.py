"""The board's side of the link probe: time an upload and a download against the coordinator.

After its steps are measured, a profile job connects to the coordinator's probe endpoint
(``coordinator.planning.link_probe.LinkProbeServer``, frames ``protocol.probe_frames``) and waits for
its turn (the coordinator serves one board at a time so that each board's figures are its own).

* Bulk (a board's first job): it sends ``nbytes`` of zeros and then receives as many: the two
  rates are the board's own link.
* Rounds (every job): a gradient-sized frame goes up and comes straight back, as in a training
  step, ``rounds`` times. What a link costs depends on the size of a transfer: on the lab, 4 MB
  moved at 97 Mbit/s over a 100 Mbit/s link for 0.8-1.1 ms of CPU per MB, LeNet-5's 0.25 MB
  gradient at 125 Mbit/s (the shaper's burst) for 1.9-2.1 ms per MB (each round's wake-ups). The
  median round is the time one gradient's exchange takes this board; the planner scales the bulk
  rates to it.

Given a power meter, it also reads the board's draw while the bytes move (bulk and rounds apart):
moving a gradient costs CPU (the TCP stack, copies, framing), and on a slow board that is well
above idle. If the coordinator then asks for it (first job only), the board uploads once more
together with the other boards, which measures the coordinator's link.

:class:`ProfileError`, which the whole profile job raises, is defined here rather than in
``agent.profile_worker`` so that this module needs neither torch nor Lightning.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Protocol, TypeVar

from edgefleet.protocol.errors import DecodeError, EdgeTrainError
from edgefleet.protocol.jobs import MAX_PROBE_ROUNDS, probe_rounds_ok
from edgefleet.protocol.probe_frames import (
    Aggregate,
    Done,
    Down,
    End,
    Go,
    Got,
    ProbeFrame,
    ProbeHello,
    ProbeRefusal,
    ProbeRound,
    ProbeVersionError,
    decode_probe_frame,
    frame_name,
)
from edgefleet.transport.frame_io import FrameReceiver, recv_frame, send_frame

log = logging.getLogger(__name__)

PROBE_CONNECT_TIMEOUT_S = 30.0
PROBE_WAIT_S = 900.0      # for the coordinator to serve the boards before this one
_CHUNK = 1 << 20
ROUND_BUDGET_S = 1.0      # timed rounds stop early once they have taken this long ...
MIN_TIMED_ROUNDS = 4      # ... and at least this many are timed


class ProfileError(EdgeTrainError):
    """The profile cannot be measured here; the message says why and what to do."""


class Meter(Protocol):
    """Average power over a window (``agent.board_resources.PowerMeter``)."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


@dataclass(frozen=True, slots=True)
class LinkFigures:
    up_bytes_per_s: float      # board -> coordinator, this board alone
    down_bytes_per_s: float    # coordinator -> board, this board alone
    power_w: float | None = None  # the board's draw during the upload and download; None: no meter


@dataclass(frozen=True, slots=True)
class RoundFigures:
    """A gradient-sized frame up and straight back, as a training step moves it."""

    round_bytes: int           # payload of each frame
    rounds: int                # rounds timed (the first one, untimed, warms the connection)
    round_s: float             # median time of one round
    power_w: float | None = None  # the board's draw during the timed rounds; None: no meter


@dataclass(frozen=True, slots=True)
class ProbeResult:
    bulk: LinkFigures | None     # None: the job asked for no bulk transfer
    rounds: RoundFigures | None  # None: the job asked for no rounds


def _recv_discard(sock: socket.socket, nbytes: int) -> None:
    buffer = bytearray(min(_CHUNK, max(nbytes, 1)))
    view, left = memoryview(buffer), nbytes
    while left:
        got = sock.recv_into(view[:min(left, len(buffer))])
        if not got:
            raise ConnectionError("the coordinator closed the probe connection")
        left -= got


def _send_zeros(sock: socket.socket, nbytes: int) -> None:
    chunk = bytes(min(_CHUNK, nbytes))
    left = nbytes
    while left:
        n = min(left, len(chunk))
        sock.sendall(memoryview(chunk)[:n])
        left -= n


_Expected = TypeVar("_Expected", Go, Got, Done)


def _recv(sock: socket.socket) -> ProbeFrame:
    """The coordinator's next frame. Raises ProfileError: it refused the probe, or speaks another version."""
    try:
        frame = decode_probe_frame(recv_frame(sock, max_bytes=64 * 1024))
    except ProbeVersionError as exc:
        raise ProfileError(str(exc)) from None
    if isinstance(frame, ProbeRefusal):
        raise ProfileError(f"the coordinator refused the link probe: {frame.message}")
    return frame


def _expect(sock: socket.socket, kind: type[_Expected]) -> _Expected:
    frame = _recv(sock)
    if not isinstance(frame, kind):
        raise ProfileError(f"link probe: expected {kind.TYPE!r} from the coordinator, got {frame_name(frame)!r}")
    return frame


def probe_link(*, host: str, port: int, token: str, job_id: str, board_id: str, nbytes: int,
               round_bytes: int = 0, rounds: int = 0, meter: Meter | None = None) -> ProbeResult:
    """Move ``nbytes`` up then down in bulk, then ``rounds`` frames of ``round_bytes`` up and back; time both.

    ``meter``, if given, runs over the bulk transfers and over the timed rounds, apart (not over
    the wait for the turn). Rounds stop early once ``MIN_TIMED_ROUNDS`` were timed over
    ``ROUND_BUDGET_S``: a probe costs a slow link a second or two, not ``rounds`` gradients.

    Raises:
        ProfileError: the endpoint cannot be reached, refused this board, or broke the exchange.
    """
    if not probe_rounds_ok(rounds):
        raise ProfileError(f"a link probe of {rounds} rounds: ask for 0 or 2-{MAX_PROBE_ROUNDS} "
                           "(1 round times nothing: the first is not timed)")
    try:
        sock = socket.create_connection((host, port), timeout=PROBE_CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ProfileError(f"cannot reach the coordinator's link probe at {host}:{port} ({exc.strerror or exc}); "
                           "check the coordinator's address towards the boards and the firewall") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, ProbeHello(job_id=job_id, board_id=board_id, token=token, nbytes=nbytes, round_bytes=round_bytes,
                                    rounds=rounds).to_wire())
        sock.settimeout(PROBE_WAIT_S)
        _expect(sock, Go)
        sock.settimeout(PROBE_CONNECT_TIMEOUT_S + max(nbytes, round_bytes) / 10_000)  # at least 10 kB/s
        bulk = _bulk(sock, nbytes, meter) if nbytes else None
        timed = _rounds(sock, round_bytes, rounds, meter) if rounds else None
        sock.settimeout(PROBE_WAIT_S)
        if _aggregate_next(sock):
            _send_zeros(sock, nbytes)
            _expect(sock, Got)
            _expect(sock, Done)
        return ProbeResult(bulk, timed)
    except (OSError, EdgeTrainError) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"the link probe with the coordinator at {host}:{port} failed: {exc}") from None
    finally:
        sock.close()


def _bulk(sock: socket.socket, nbytes: int, meter: Meter | None) -> LinkFigures:
    if meter is not None:
        meter.start()
    started = time.perf_counter()
    _send_zeros(sock, nbytes)
    _expect(sock, Got)
    up_s = time.perf_counter() - started
    started = time.perf_counter()
    send_frame(sock, Down().to_wire())
    _recv_discard(sock, nbytes)
    down_s = time.perf_counter() - started
    power_w = meter.stop() if meter is not None else None
    return LinkFigures(nbytes / max(up_s, 1e-9), nbytes / max(down_s, 1e-9), power_w)


def _rounds(sock: socket.socket, round_bytes: int, rounds: int, meter: Meter | None) -> RoundFigures:
    """Send a ``round`` frame of ``round_bytes`` and receive it back, as the worker does a step's gradient."""
    frame = ProbeRound(bytes(round_bytes)).to_wire()
    receiver = FrameReceiver(sock, max_bytes=round_bytes + 1024)
    times: list[float] = []
    for i in range(rounds):
        if i == 1 and meter is not None:
            meter.start()
        started = time.perf_counter()
        send_frame(sock, frame)
        try:
            ProbeRound.from_wire(receiver.recv(), round_bytes=round_bytes)
        except DecodeError as exc:
            raise ProfileError(f"link probe: the coordinator did not send the round back ({exc})") from None
        if i:
            times.append(time.perf_counter() - started)
        if len(times) >= MIN_TIMED_ROUNDS and sum(times) >= ROUND_BUDGET_S:
            break
    power_w = meter.stop() if meter is not None else None
    send_frame(sock, End().to_wire())
    return RoundFigures(round_bytes, len(times), statistics.median(times), power_w)


def _aggregate_next(sock: socket.socket) -> bool:
    """True if the coordinator asks for the aggregate upload next, False if the probe is done."""
    frame = _recv(sock)
    if not isinstance(frame, (Aggregate, Done)):
        raise ProfileError(f"link probe: unexpected {frame_name(frame)!r} from the coordinator")
    return isinstance(frame, Aggregate)


__all__ = ["LinkFigures", "Meter", "ProbeResult", "ProfileError", "RoundFigures", "probe_link"]
