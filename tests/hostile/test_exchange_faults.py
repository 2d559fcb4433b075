"""Faults and hostile peers against the gradient exchange: a real coordinator-side exchange in its own
process (``exchange_proc.py``), real board clients (``ExchangeClient``) on threads, raw sockets on 127.0.0.1.

Issue 23: a paused coordinator (item 3), file-descriptor exhaustion and stalled connections (item 7), an
oversized frame, a second connection presenting a connected board's id and an outlier gradient (item 4).
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.worker_exchange import ExchangeClient, ExchangeRefused
from edgefleet.protocol.exchange_frames import Hello, Welcome
from edgefleet.transport.frame_io import recv_frame, send_frame
from tests.helpers import wait_until
from tests.hostile.exchange_server import ServerProcess

BATCH = {"b0": 8, "b1": 16, "b2": 24}


def gradient(board: str, step: int, size: int) -> np.ndarray:
    """Board ``board``'s gradient at ``step``: distinct per board and step; large ones are a scaled fixed vector (cheap)."""
    if size > 1_000_000:
        return _base(board, size) * np.float32(step + 1)
    rng = np.random.default_rng(1000 * int(board[1:]) + step)
    return (rng.standard_normal(size) * 0.1).astype(np.float32)


@functools.lru_cache(maxsize=3)
def _base(board: str, size: int) -> np.ndarray:
    return np.random.default_rng(int(board[1:])).random(size, dtype=np.float32)


def average(boards: list[str], step: int, size: int) -> np.ndarray:
    total = sum(BATCH[b] for b in boards)
    return sum(np.float64(BATCH[b]) * gradient(b, step, size) for b in boards) / total


class Board(threading.Thread):
    """A real board client: joins, then runs ``steps`` steps; ``gate(step)`` runs before each gradient is sent."""

    def __init__(self, board_id: str, port: int, steps: int, size: int, *,
                 gate: Callable[[int], None] = lambda step: None,
                 make: Callable[[str, int, int], np.ndarray] = gradient,
                 keep: Callable[[int], bool] = lambda step: True) -> None:
        super().__init__(daemon=True, name=f"board-{board_id}")
        self.board_id, self.port, self.steps, self.size, self.gate, self.make = board_id, port, steps, size, gate, make
        self.keep = keep
        self.client: ExchangeClient | None = None
        self.sending = [threading.Event() for _ in range(steps)]
        self.results: dict[int, np.ndarray] = {}  # the steps ``keep`` asks for
        self.done_steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.client = ExchangeClient("127.0.0.1", self.port, result_timeout_s=60)
            self.client.hello(job_id="job", board_id=self.board_id, token="secret", param_count=self.size)
            for step in range(self.steps):
                grad = self.make(self.board_id, step, self.size)
                self.gate(step)
                self.sending[step].set()
                avg = self.client.exchange(step=step, grad=grad, n=BATCH[self.board_id], loss=1.0, compute_s=0.01)
                if self.keep(step):
                    self.results[step] = np.array(avg)
                self.done_steps += 1
            self.client.close()
        except Exception as exc:  # recorded for the assertions, which name it
            self.error = exc


def start_boards(port: int, steps: int, size: int, ids: tuple[str, ...] = ("b0", "b1", "b2"), **kwargs: Any) -> list[Board]:
    boards = [Board(b, port, steps, size, **kwargs) for b in ids]
    for board in boards:
        board.start()
    return boards


def join_boards(boards: list[Board], timeout_s: float = 60) -> None:
    for board in boards:
        board.join(timeout_s)
        assert not board.is_alive(), f"board {board.board_id} did not finish"
        assert board.error is None, f"board {board.board_id} failed: {board.error!r}"


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes this socket sent that the peer's kernel has not acknowledged yet (TIOCOUTQ)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


def readable_bytes(sock: socket.socket) -> int:
    out = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


def process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def closed_by_peer(sock: socket.socket, timeout_s: float) -> float:
    """Seconds until the peer closes ``sock`` (reading and dropping what it sends); fails after ``timeout_s``."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the exchange did not close the connection within {timeout_s} s") from None
    return time.monotonic() - started


# --- item 3: a paused coordinator --------------------------------------------------------------

@pytest.mark.parametrize("size, short_s", [(1000, 1.0), (10_000_000, 3.0)], ids=["in-kernel-buffers", "larger-than-buffers"])
def test_a_coordinator_paused_past_the_deadline_drops_no_board_that_delivered(servers: Callable[..., ServerProcess],
                                                                              size: int, short_s: float) -> None:
    """SIGSTOP the exchange's process while step 1 waits, let every board send its gradient, keep the
    process stopped for 1.5 s longer than the step's deadline, SIGCONT: every board is a contributor of step 1.

    Small gradients wait whole in the coordinator's kernel buffers; 40 MB ones do not fit (loopback
    buffers take at most 32 MB + 4 MB) and wait on the boards for room, which only a deadline that does
    not count the pause lets them have."""
    pause_step, steps = 1, 3  # the other steps have a generous deadline (60 s): a loaded machine makes no board late there
    server = servers("--param-count", str(size), "--steps", str(steps), "--min-deadline", "60",
                     "--short-step", str(pause_step), "--short-deadline", str(short_s))
    go = threading.Event()
    boards = start_boards(server.port, steps, size, gate=lambda step: go.wait(60) if step == pause_step else None,
                          keep=lambda step: step == pause_step)
    deadline_s = server.wait_for("gathering", value=pause_step, timeout_s=120)["deadline_s"]
    assert deadline_s == short_s
    os.kill(server.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_until(lambda: process_state(server.pid) == "T", timeout_s=10, what="the exchange process to stop")
        go.set()
        for board in boards:
            assert board.sending[pause_step].wait(30), f"board {board.board_id} did not start sending"
        sockets = [board.client.sock for board in boards if board.client is not None]
        if size <= 1000:  # whole gradients acknowledged by the stopped coordinator's kernel: delivered
            wait_until(lambda: all(unsent_bytes(s) == 0 for s in sockets), timeout_s=10, what="gradients delivered")
        else:  # more than its buffers take: the rest waits on the boards
            wait_until(lambda: all(unsent_bytes(s) > 0 for s in sockets), timeout_s=10, what="gradients sending")
        # The thing under test: the process stays stopped for longer than the step's deadline.
        time.sleep(max(0.0, deadline_s + 1.5 - (time.monotonic() - stopped_at)))
    finally:
        os.kill(server.pid, signal.SIGCONT)
    done = server.finish()
    join_boards(boards)
    result = server.steps()[pause_step]
    assert result["contributors"] == ["b0", "b1", "b2"] and result["late"] == [], (result, done["flags"], server.log()[-2000:])
    assert all(board.done_steps == steps for board in boards)
    expected = average(["b0", "b1", "b2"], pause_step, size)
    for board in boards:
        np.testing.assert_allclose(board.results[pause_step], expected, atol=1e-6)
    assert not done["flags"], done["flags"]


# --- item 7: file-descriptor exhaustion and stalled connections --------------------------------

def test_the_accept_loop_survives_running_out_of_file_descriptors(servers: Callable[..., ServerProcess]) -> None:
    """The exchange's process may open 40 descriptors; 80 connections exhaust them (EMFILE). Once they close,
    a real board still joins and trains; the exchange said so once, naming the fix."""
    limit = 40
    server = servers("--boards", "b0:8", "--steps", "2", "--nofile", str(limit), "--hello-timeout", "60",
                     "--join-timeout", "60")
    crowd: list[socket.socket] = []
    try:
        for _ in range(80):
            crowd.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        fds = Path(f"/proc/{server.pid}/fd")  # at the limit, with connections still queued: accept() fails with EMFILE
        wait_until(lambda: len(os.listdir(fds)) >= limit, timeout_s=20, what=f"the exchange to hold {limit} descriptors")
    finally:
        for sock in crowd:
            sock.close()
    (board,) = start_boards(server.port, 2, 1000, ids=("b0",))
    done = server.finish()
    join_boards([board])
    assert [server.steps()[s]["contributors"] for s in (0, 1)] == [["b0"], ["b0"]]
    assert server.log().count("cannot accept connections") == 1 and "ulimit -n" in server.log()
    assert done["flags"] == {}


def test_connections_that_send_no_hello_are_closed_within_the_bound(servers: Callable[..., ServerProcess]) -> None:
    """Silent, half-a-header and half-a-frame connections are closed within the hello bound (0.5 s here)
    while real boards join and train."""
    bound = 0.5
    server = servers("--boards", "b0:8,b1:16", "--steps", "3", "--hello-timeout", str(bound))
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    half_header = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    half_header.sendall(b"\x00\x00")
    half_frame = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    half_frame.sendall(struct.pack(">I", 100) + b"\x82" + b"x" * 9)
    boards = start_boards(server.port, 3, 1000, ids=("b0", "b1"))
    try:
        for sock in (silent, half_header, half_frame):
            assert closed_by_peer(sock, timeout_s=bound + 5) < bound + 3
    finally:
        for sock in (silent, half_header, half_frame):
            sock.close()
    done = server.finish()
    join_boards(boards)
    assert [server.steps()[s]["contributors"] for s in range(3)] == [["b0", "b1"]] * 3
    assert done["flags"] == {}


def test_a_connection_that_stops_taking_its_welcome_does_not_hold_up_the_job(servers: Callable[..., ServerProcess]) -> None:
    """A peer with the job's token says hello as b1 and then reads nothing of its 16 MB welcome (which is sent
    between steps, holding every step up): it is closed once it has taken nothing for the bound, and the
    real boards join and train."""
    server = servers("--boards", "b0:8,b1:16", "--steps", "3", "--hello-timeout", "1.0",
                     "--welcome-bytes", str(16 << 20))
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        send_frame(stalled, Hello(job_id="job", board_id="b1", token="secret", param_count=1000).to_wire())
        wait_until(lambda: readable_bytes(stalled) > 0, timeout_s=10, what="the welcome to start arriving")
        boards = start_boards(server.port, 3, 1000, ids=("b0",))  # waits for the welcomes' turn
        # b1 itself joins once the stalled connection no longer holds its place (while it does, b1 would be refused)
        wait_until(lambda: "did not take its welcome" in server.log(), timeout_s=30, what="the stalled connection closed")
        boards += start_boards(server.port, 3, 1000, ids=("b1",))
        done = server.finish(timeout_s=60)
        join_boards(boards)
    finally:
        stalled.close()
    assert [server.steps()[s]["contributors"] for s in range(3)] == [["b0", "b1"]] * 3
    assert "did not take its welcome" in server.log()
    assert done["flags"] == {}


# --- item 4: an oversized frame, a second connection for a connected board, an outlier gradient ---

def test_an_authenticated_board_announcing_a_1_gib_frame_is_dropped_without_allocating_it(
        servers: Callable[..., ServerProcess]) -> None:
    server = servers("--steps", "3")
    boards = start_boards(server.port, 3, 1000, ids=("b0", "b1"))
    hostile = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        send_frame(hostile, Hello(job_id="job", board_id="b2", token="secret", param_count=1000).to_wire())
        Welcome.from_wire(recv_frame(hostile))
        server.wait_for("gathering", value=0, timeout_s=30)
        hostile.sendall(struct.pack(">I", 1 << 30) + b"\x00" * 4096)
        closed_by_peer(hostile, timeout_s=10)
    finally:
        hostile.close()
    done = server.finish()
    join_boards(boards)
    assert [server.steps()[s]["contributors"] for s in range(3)] == [["b0", "b1"]] * 3
    (left,) = done["flags"]["b2"]
    assert "frame of 1073741824 bytes" in left and "at most" in left, left
    assert done["peak_rss_kb"] < 300 * 1024, f"the exchange's peak memory was {done['peak_rss_kb']} KiB"


def test_a_second_connection_cannot_replace_a_connected_board(servers: Callable[..., ServerProcess]) -> None:
    server = servers("--steps", "3")
    tried = threading.Event()
    boards = start_boards(server.port, 3, 1000, gate=lambda step: tried.wait(30) if step == 1 else None)
    server.wait_for("gathering", value=1, timeout_s=30)
    intruder = ExchangeClient("127.0.0.1", server.port, result_timeout_s=10)
    try:
        with pytest.raises(ExchangeRefused, match=r"board b1 is already connected to job job \(from 127\.0\.0\.1:\d+\); "
                                                  "a second connection cannot replace it"):
            intruder.hello(job_id="job", board_id="b1", token="secret", param_count=1000)
    finally:
        intruder.close()
        tried.set()
    done = server.finish()
    join_boards(boards)
    assert [server.steps()[s]["contributors"] for s in range(3)] == [["b0", "b1", "b2"]] * 3
    for step in range(3):
        np.testing.assert_allclose(boards[1].results[step], average(["b0", "b1", "b2"], step, 1000), atol=1e-6)
    assert done["flags"] == {"b1": [done["flags"]["b1"][0]]} and "second connection" in done["flags"]["b1"][0]
    assert "refused a connection from 127.0.0.1" in server.log() and "presenting board b1's id" in server.log()


def test_a_gradient_far_outside_the_other_boards_norms_is_refused_and_flagged(servers: Callable[..., ServerProcess]) -> None:
    """b2 sends a gradient of norm 5e5 at step 1 (the others' are about 3; the old absolute limit is 1e6)."""

    def make(board: str, step: int, size: int) -> np.ndarray:
        g = gradient(board, step, size)
        return g * np.float32(5e5 / np.linalg.norm(g)) if (board, step) == ("b2", 1) else g

    server = servers("--steps", "3")
    boards = start_boards(server.port, 3, 1000, make=make)
    done = server.finish()
    join_boards(boards)
    steps = server.steps()
    assert steps[0]["contributors"] == steps[2]["contributors"] == ["b0", "b1", "b2"]
    assert steps[1]["contributors"] == ["b0", "b1"] and list(steps[1]["refused"]) == ["b2"]
    assert "outlier" in steps[1]["refused"]["b2"] and "5e+05" in steps[1]["refused"]["b2"]
    for board in boards:
        np.testing.assert_allclose(board.results[1], average(["b0", "b1"], 1, 1000), atol=1e-6)
    assert any("step 1: refused" in flag and "outlier" in flag for flag in done["flags"]["b2"])
