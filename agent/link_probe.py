"""The board's side of the link probe: time an upload and a download against the coordinator.

After its steps are measured, the first profile job of a board connects to the coordinator's
probe endpoint (``coordinator.link_probe.LinkProbeServer``, frames ``protocol.jobs.PROBE_VERSION``),
waits for its turn (the coordinator serves one board at a time so that each board's figures are
its own), sends ``nbytes`` of zeros and then receives as many: the two rates are the board's
own link. Given a power meter, it also reads the board's draw while the bytes move: moving a
gradient costs CPU (the TCP stack, copies), and on a slow board that is well above idle. If the
coordinator then asks for it, the board uploads once more together with the other boards, which
measures the coordinator's link.

:class:`ProfileError`, which the whole profile job raises, is defined here rather than in
``agent.profile_worker`` so that this module needs neither torch nor Lightning.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.errors import EdgeTrainError
from protocol.framing import recv_frame, send_frame
from protocol.jobs import PROBE_VERSION

PROBE_CONNECT_TIMEOUT_S = 30.0
PROBE_WAIT_S = 900.0      # for the coordinator to serve the boards before this one
_CHUNK = 1 << 20


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


def _expect(sock: socket.socket, kind: str) -> dict[str, Any]:
    frame = recv_frame(sock, max_bytes=64 * 1024)
    if frame["type"] == "error":
        raise ProfileError(f"the coordinator refused the link probe: {frame.get('message')}")
    if frame["type"] != kind:
        raise ProfileError(f"link probe: expected {kind!r} from the coordinator, got {frame['type']!r}")
    return frame


def probe_link(*, host: str, port: int, token: str, job_id: str, board_id: str, nbytes: int,
               meter: Meter | None = None) -> LinkFigures:
    """Upload then download ``nbytes`` to the coordinator's probe endpoint and time both.

    ``meter``, if given, runs over the upload and the download only (not the wait for the turn).

    Raises:
        ProfileError: the endpoint cannot be reached, refused this board, or broke the exchange.
    """
    try:
        sock = socket.create_connection((host, port), timeout=PROBE_CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ProfileError(f"cannot reach the coordinator's link probe at {host}:{port} ({exc.strerror or exc}); "
                           "check the coordinator's address towards the boards and the firewall") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, {"type": "probe-hello", "v": PROBE_VERSION, "job_id": job_id, "board_id": board_id,
                          "token": token, "bytes": nbytes})
        sock.settimeout(PROBE_WAIT_S)
        _expect(sock, "go")
        sock.settimeout(PROBE_CONNECT_TIMEOUT_S + nbytes / 10_000)  # at least 10 kB/s
        if meter is not None:
            meter.start()
        started = time.perf_counter()
        _send_zeros(sock, nbytes)
        _expect(sock, "got")
        up_s = time.perf_counter() - started
        started = time.perf_counter()
        send_frame(sock, {"type": "down"})
        _recv_discard(sock, nbytes)
        down_s = time.perf_counter() - started
        power_w = meter.stop() if meter is not None else None
        sock.settimeout(PROBE_WAIT_S)
        if _next(sock) == "aggregate":
            _send_zeros(sock, nbytes)
            _expect(sock, "got")
            _expect(sock, "done")
        return LinkFigures(nbytes / max(up_s, 1e-9), nbytes / max(down_s, 1e-9), power_w)
    except (OSError, EdgeTrainError) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"the link probe with the coordinator at {host}:{port} failed: {exc}") from None
    finally:
        sock.close()


def _next(sock: socket.socket) -> str:
    frame = recv_frame(sock, max_bytes=64 * 1024)
    if frame["type"] not in ("aggregate", "done"):
        raise ProfileError(f"link probe: unexpected {frame['type']!r} from the coordinator")
    return str(frame["type"])


__all__ = ["LinkFigures", "Meter", "ProfileError", "probe_link"]
