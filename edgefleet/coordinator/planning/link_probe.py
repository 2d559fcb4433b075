"""The endpoint the boards measure their link against during ``edge-coordinator profile``.

Each profile job connects here (frames: ``protocol.probe_frames``). A board's first job
uploads then downloads a given number of bytes in bulk; every job then sends gradient-sized
frames that come straight back, and the board times both (``agent.link_probe``). Boards are served
one at a time, so that one board's figures are not shared with another's. Then, unless the boards
are profiled a few at a time, every board whose bulk transfer is done uploads at once: what the
coordinator takes in is its own link, the profile's ``coordinator_link_bytes_per_s``. Started and
closed by ``coordinator.planning.profiling.profile_fleet``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from edgefleet.protocol.errors import DecodeError, EdgeTrainError
from edgefleet.protocol.probe_frames import (
    Aggregate,
    Done,
    Down,
    End,
    Go,
    Got,
    ProbeHello,
    ProbeRefusal,
    ProbeRound,
    ProbeVersionError,
    decode_probe_frame,
    frame_name,
)
from edgefleet.transport.frame_io import read_frame, write_frame

log = logging.getLogger(__name__)

PROBE_WAIT_S = 300.0        # how long a probed board waits for the others before the aggregate upload
PROBE_IO_TIMEOUT_S = 120.0  # one transfer of the probe, or one frame
_CHUNK = 1 << 20


class LinkProbeServer:
    """The endpoint boards measure their link against (frames: ``protocol.probe_frames``).

    Args:
        job_id: the profile's first job id; a board must name it or another job of the same profile
            (``<job_id minus its last "-N">-M``, one job per model variant).
        token: the secret sent to the boards in their signed commands.
        boards: the boards expected; the aggregate upload starts once all of them (but those
            :meth:`drop`-ped) have had their turn, or ``PROBE_WAIT_S`` after the first one did.
        aggregate: False skips the aggregate upload (boards profiled a few at a time never
            upload together); :attr:`aggregate_bytes_per_s` is then None.
    """

    def __init__(self, *, job_id: str, token: str, boards: Iterable[str], aggregate: bool = True) -> None:
        self.job_id, self.token, self.aggregate = job_id, token, aggregate
        self._job_prefix = job_id.rsplit("-", 1)[0] + "-"
        self.expected = set(boards)
        self._dropped: set[str] = set()
        self._waiting: set[str] = set()
        self._solo = asyncio.Lock()
        self._release = asyncio.Event()
        self._members: set[str] = set()
        self._started = 0.0
        self._uploads: list[tuple[int, float]] = []  # (bytes, end time) of the aggregate phase
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen; returns the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    def drop(self, board: str) -> None:
        """Do not wait for ``board`` (its job failed)."""
        self._dropped.add(board)
        self._maybe_release()

    @property
    def aggregate_bytes_per_s(self) -> float | None:
        """What the coordinator took in with every waiting board uploading at once; None if not measured.

        The sum of each board's own rate during the concurrent upload, not total bytes over the
        slowest board's time: a 20 Mbit/s board finishing last must not make a gigabit link look
        slow. When the coordinator's link is the bottleneck the boards share it and the sum is
        its capacity; when it is not, the sum is about the boards' own links added up, and the
        cost model's coordinator term stays below its per-board link term.
        """
        if not self._uploads:
            return None
        return sum(n / max(end - self._started, 1e-9) for n, end in self._uploads)

    def _maybe_release(self) -> None:
        if not self._release.is_set() and self._waiting and self._waiting >= self.expected - self._dropped:
            self._release_now()

    def _release_now(self) -> None:
        self._members = set(self._waiting)
        self._started = asyncio.get_running_loop().time()
        self._release.set()

    def _checked_hello(self, frame: dict[str, Any]) -> tuple[ProbeHello | None, str]:
        """The hello if this profile takes it, else None and why not (another version: which side to upgrade)."""
        try:
            hello = ProbeHello.from_wire(frame)
        except (ProbeVersionError, DecodeError) as exc:
            return None, str(exc)
        job_id = hello.job_id
        same_profile = job_id == self.job_id or (job_id.startswith(self._job_prefix)
                                                 and job_id[len(self._job_prefix):].isdigit())
        if not same_profile or not hello.presents(self.token):
            return None, "wrong profile job or token"
        if hello.board_id not in self.expected:
            return None, f"board {hello.board_id!r} is not part of this profile"
        return hello, ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        board = "?"
        try:
            hello, refusal = self._checked_hello(await asyncio.wait_for(read_frame(reader, max_bytes=4096),
                                                                        PROBE_IO_TIMEOUT_S))
            if hello is None:
                log.warning("link probe: refused a connection: %s", refusal)
                await _send(writer, ProbeRefusal(refusal).to_wire())
                return
            board, size = hello.board_id, hello.nbytes
            async with self._solo:  # one board at a time: its figures are its own
                await _send(writer, Go().to_wire())
                if size:
                    await asyncio.wait_for(_discard(reader, size), PROBE_IO_TIMEOUT_S)
                    await _send(writer, Got().to_wire())
                    Down.from_wire(await asyncio.wait_for(read_frame(reader, max_bytes=4096), PROBE_IO_TIMEOUT_S))
                    await asyncio.wait_for(_zeros(writer, size), PROBE_IO_TIMEOUT_S)
                if hello.rounds:
                    await _echo_rounds(reader, writer, hello.round_bytes, hello.rounds)
            if not self.aggregate or not size:
                await _send(writer, Done().to_wire())
                return
            self._waiting.add(board)
            self._maybe_release()
            try:
                await asyncio.wait_for(self._release.wait(), PROBE_WAIT_S)
            except asyncio.TimeoutError:
                if not self._release.is_set():
                    log.warning("link probe: boards %s did not come within %.0f s; measuring the aggregate without them",
                                ", ".join(sorted(self.expected - self._dropped - self._waiting)), PROBE_WAIT_S)
                    self._release_now()
            if board in self._members:
                await _send(writer, Aggregate().to_wire())
                await asyncio.wait_for(_discard(reader, size), PROBE_IO_TIMEOUT_S)
                self._uploads.append((size, asyncio.get_running_loop().time()))
                await _send(writer, Got().to_wire())
            await _send(writer, Done().to_wire())
        except (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, EdgeTrainError) as exc:
            log.warning("link probe of board %s failed: %s", board, exc or type(exc).__name__)
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _echo_rounds(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, round_bytes: int, rounds: int) -> None:
    """Send every ``round`` frame straight back until the board says ``end`` (at most ``rounds``)."""
    for _ in range(rounds + 1):
        frame = decode_probe_frame(await asyncio.wait_for(read_frame(reader, max_bytes=round_bytes + 1024), PROBE_IO_TIMEOUT_S),
                                   round_bytes=round_bytes)
        if isinstance(frame, End):
            return
        if not isinstance(frame, ProbeRound):
            raise EdgeTrainError(f"expected a round of {round_bytes} bytes or 'end', got {frame_name(frame)!r}")
        await _send(writer, frame.to_wire())
    raise EdgeTrainError(f"the board sent more than the {rounds} rounds it announced")


async def _send(writer: asyncio.StreamWriter, frame: dict[str, Any]) -> None:
    write_frame(writer, frame)
    await writer.drain()


async def _discard(reader: asyncio.StreamReader, size: int) -> None:
    left = size
    while left:
        left -= len(await reader.readexactly(min(left, _CHUNK)))


async def _zeros(writer: asyncio.StreamWriter, size: int) -> None:
    chunk, left = bytes(min(size, _CHUNK)), size
    while left:
        n = min(left, len(chunk))
        writer.write(chunk[:n] if n < len(chunk) else chunk)
        await writer.drain()
        left -= n


__all__ = ["LinkProbeServer"]
