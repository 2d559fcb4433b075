"""The endpoint the boards measure their link against during ``edge-coordinator profile``.

Each profile job connects here (frames: ``protocol.jobs.PROBE_VERSION``). A board's first job
uploads then downloads a given number of bytes in bulk; every job then sends gradient-sized
frames that come straight back, and the board times both (``agent.link_probe``). Boards are served
one at a time, so that one board's figures are not shared with another's. Then, unless the boards
are profiled a few at a time, every board whose bulk transfer is done uploads at once: what the
coordinator takes in is its own link, the profile's ``coordinator_link_bytes_per_s``. Started and
closed by ``coordinator.profiling.profile_fleet``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Iterable
from typing import Any

from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.protocol.jobs import (
    MAX_PROBE_BYTES,
    MAX_PROBE_ROUNDS,
    PROBE_VERSION,
    probe_rounds_ok,
)
from edgefleet.transport.frame_io import read_frame, write_frame

log = logging.getLogger(__name__)

PROBE_WAIT_S = 300.0        # how long a probed board waits for the others before the aggregate upload
PROBE_IO_TIMEOUT_S = 120.0  # one transfer of the probe, or one frame
_CHUNK = 1 << 20


class LinkProbeServer:
    """The endpoint boards measure their link against (frames: ``protocol.jobs.PROBE_VERSION``).

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

    def _refusal(self, hello: dict[str, Any]) -> str:
        if hello.get("type") != "probe-hello" or hello.get("v") != PROBE_VERSION:
            return f"expected probe-hello version {PROBE_VERSION}; upgrade the agent or the coordinator"
        job_id = str(hello.get("job_id"))
        same_profile = job_id == self.job_id or (job_id.startswith(self._job_prefix)
                                                 and job_id[len(self._job_prefix):].isdigit())
        if not same_profile or not hmac.compare_digest(str(hello.get("token", "")), self.token):
            return "wrong profile job or token"
        if hello.get("board_id") not in self.expected:
            return f"board {hello.get('board_id')!r} is not part of this profile"
        size, round_bytes, rounds = hello.get("bytes"), hello.get("round_bytes"), hello.get("rounds")
        if not isinstance(size, int) or not 0 <= size <= MAX_PROBE_BYTES:
            return f"bytes must be 0-{MAX_PROBE_BYTES}"
        if not isinstance(round_bytes, int) or not 0 <= round_bytes <= MAX_PROBE_BYTES:
            return f"round_bytes must be 0-{MAX_PROBE_BYTES}"
        if not isinstance(rounds, int) or not probe_rounds_ok(rounds) or (rounds > 0) != (round_bytes > 0):
            return (f"rounds must be 0 or 2-{MAX_PROBE_ROUNDS} (the first is not timed), and more than 0 exactly "
                    "when round_bytes is")
        if not size and not rounds:
            return "nothing to measure: bytes and rounds are both 0"
        return ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        board = "?"
        try:
            hello = await asyncio.wait_for(read_frame(reader, max_bytes=4096), PROBE_IO_TIMEOUT_S)
            refusal = self._refusal(hello)
            if refusal:
                log.warning("link probe: refused a connection: %s", refusal)
                write_frame(writer, {"type": "error", "message": refusal})
                await writer.drain()
                return
            board, size = str(hello["board_id"]), int(hello["bytes"])
            async with self._solo:  # one board at a time: its figures are its own
                await _send(writer, {"type": "go"})
                if size:
                    await asyncio.wait_for(_discard(reader, size), PROBE_IO_TIMEOUT_S)
                    await _send(writer, {"type": "got"})
                    down = await asyncio.wait_for(read_frame(reader, max_bytes=4096), PROBE_IO_TIMEOUT_S)
                    if down.get("type") != "down":
                        raise EdgeTrainError(f"expected 'down', got {down.get('type')!r}")
                    await asyncio.wait_for(_zeros(writer, size), PROBE_IO_TIMEOUT_S)
                if hello["rounds"]:
                    await _echo_rounds(reader, writer, int(hello["round_bytes"]), int(hello["rounds"]))
            if not self.aggregate or not size:
                await _send(writer, {"type": "done"})
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
                await _send(writer, {"type": "aggregate"})
                await asyncio.wait_for(_discard(reader, size), PROBE_IO_TIMEOUT_S)
                self._uploads.append((size, asyncio.get_running_loop().time()))
                await _send(writer, {"type": "got"})
            await _send(writer, {"type": "done"})
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
        frame = await asyncio.wait_for(read_frame(reader, max_bytes=round_bytes + 1024), PROBE_IO_TIMEOUT_S)
        if frame.get("type") == "end":
            return
        data = frame.get("data")
        if frame.get("type") != "round" or not isinstance(data, (bytes, memoryview)) or len(data) != round_bytes:
            raise EdgeTrainError(f"expected a round of {round_bytes} bytes or 'end', got {frame.get('type')!r}")
        await _send(writer, {"type": "round", "data": data})
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
