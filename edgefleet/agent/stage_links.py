"""A stage host's links to its pipeline neighbours (issue 35): authenticated TLS, one stream a connection.

Every stage host listens on a port of its own with a TLS certificate it makes at start with its own
Ed25519 board key (``transport.board_tls``); its neighbours check that certificate's key against the
board's public key, which the signed plan lists (``StagePeer.public_key``). It opens a connection for each stream it sends
(``protocol.stage_frames``: ``act`` downstream, ``dact`` upstream, ``out`` from the last stage to the
first and ``dout`` back) and accepts one for each stream it receives, from the board the plan puts
at the sending stage, proving its key (``protocol.stage_auth``). Where a stage is a group of boards,
each micro-batch of a step goes to the one board the plan's routes give it (``protocol.stage_routes``),
so a board opens a stream to (and takes one from) each board its micro-batches go to (come from). A connection carries one stream in
one direction after its hello, so no TLS connection is read and written at once, and a reader
thread per incoming stream keeps every socket drained: no send waits on a peer that is itself
blocked sending.

Incoming tensors wait in an inbox keyed by (step, source board, micro-batch) until the training thread
takes them (:meth:`StageEndpoint.recv`), each bounded by the plan: a frame no larger than the
stream's largest micro-batch, at most two steps' micro-batches queued, shapes checked on taking.
Whatever goes wrong (a stall past the deadline, a closed connection, a malformed, oversized or
non-finite frame, a micro-batch the routes do not send this way, a refusal)
ends the job on this host with :class:`StageFault`, one line naming
the neighbour, its stage and why: never a hang, never a silently wrong step.

Imported only by a pipelined job's worker (``agent.stage_runtime``, ``agent.stage_worker``): it needs numpy.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefleet.protocol.errors import DecodeError, NeighbourFault
from edgefleet.protocol.exchange_auth import HelloProver
from edgefleet.protocol.pipeline_command import stage_and_member
from edgefleet.protocol.signing import ed25519_public_key
from edgefleet.protocol.stage_auth import StageCredentials
from edgefleet.protocol.stage_frames import (
    ACT,
    DACT,
    DOUT,
    OUT,
    STAGE_REFUSAL,
    STAGE_STOP,
    STAGE_WELCOME,
    StageHello,
    StageMessage,
    StageStopped,
    StageTensor,
    decode_stage_reply,
)
from edgefleet.protocol.stage_routes import StageRoutes, Unit, stage_routes
from edgefleet.transport.board_tls import board_certificate, connect_board_tls
from edgefleet.transport.exchange_tls import BoardTlsSocket, TlsRefused
from edgefleet.transport.frame_io import ConnectionClosed, recv_frame, send_frame

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_HELLO_BYTES = 4096
# the neighbours start at about the same time; a host still starting a fresh worker (torch and Lightning on a slow
# board: a minute or more) comes later, and the coordinator waits as long for every board to join (JOIN_TIMEOUT_S)
CONNECT_TIMEOUT_S = 180.0
STALL_TIMEOUT_S = 120.0  # a stream silent this long within a step: the neighbour is stalled or gone
FRAME_MARGIN_BYTES = 4096  # a frame's fields beside its tensor
CLOSE_JOIN_S = 2.0  # how long close() waits for each of this host's threads once their sockets are shut


class StageFault(NeighbourFault):
    """A neighbour stalled, left, refused this host or sent what the plan does not allow (the message says which)."""


@dataclass(frozen=True)
class StagePeer:
    """One stage's host, as the signed plan names it: its board, where it listens, and the board's Ed25519 public key
    (hex), which its certificate and its hellos' proofs are checked against."""

    board_id: str
    host: str
    port: int
    public_key: str


@dataclass(frozen=True)
class StageLinkPlan:
    """What one stage host needs of the plan to link up.

    Args:
        job_id: the job.
        stage: this host's stage, from 0 (the first stage holds the data).
        peers: every board of the pipeline, stage by stage: stage 0's group (``group`` boards, each with its slice of
            the batch), then each later stage's board, or its group's boards (``sizes``).
        shapes: each stage's output shape per sample, in stage order (the last is the model's output).
        max_rows: the most samples a micro-batch holds (bounds every frame before it is read).
        micro_batches: the most micro-batches a board's step holds (bounds each inbox: two steps' worth).
        tls: False only with ``--no-exchange-tls`` (plain TCP; the hellos' proofs are still checked).
        group: how many boards stage 0 has (data-parallel among them).
        member: this board's place in its stage's group.
        sizes: each stage's boards, stage 0's first (): ``group``, then one a later stage.
        batch_sizes: stage 0's boards' slices, which the routes of a later group follow (``protocol.stage_routes``);
            (): ``micro_batches`` samples each (every board of stage 0 makes M micro-batches).
    """

    job_id: str
    stage: int
    peers: list[StagePeer]
    shapes: list[tuple[int, ...]]
    max_rows: int
    micro_batches: int
    tls: bool = True
    group: int = 1
    member: int = 0
    sizes: tuple[int, ...] = ()
    batch_sizes: tuple[int, ...] = ()
    routes: StageRoutes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = self.sizes or (self.group,) + (1,) * (len(self.peers) - self.group)
        if sum(sizes) != len(self.peers) or sizes[0] != self.group:
            raise ValueError(f"stage sizes {list(sizes)} do not fit {len(self.peers)} boards with stage 0's {self.group}")
        object.__setattr__(self, "sizes", tuple(sizes))
        slices = self.batch_sizes or (self.micro_batches,) * self.group
        object.__setattr__(self, "routes", stage_routes(sizes, slices, self.micro_batches))

    @property
    def stages(self) -> int:
        return len(self.sizes)

    def index_of(self, stage: int, member: int = 0) -> int:
        """The board of ``stage`` (its ``member``-th) as an index into :attr:`peers`."""
        return sum(self.sizes[:stage]) + member

    def stage_at(self, index: int) -> int:
        """The stage of :attr:`peers`' ``index``-th board."""
        return stage_and_member(list(self.sizes), index)[0]

    @property
    def me(self) -> StagePeer:
        return self.peers[self.index_of(self.stage, self.member)]

    def units(self) -> list[Unit]:
        """The units of a step this board handles (at stage 0: its own micro-batches)."""
        return self.routes.units_of(self.stage, self.member)

    def board_of(self, stage: int, src: int, micro: int) -> int:
        """The board (an index into :attr:`peers`) of ``stage`` that handles unit ``(src, micro)``."""
        member = self.routes.member(stage, src, micro)
        if member is None:
            raise StageFault(f"source board {src} makes no micro-batch {micro}")
        return self.index_of(stage, member)

    def sent_to(self, stream: str) -> int:
        """The stage this board sends ``stream`` to."""
        if self.stage == 0:
            return 1 if stream == ACT else self.stages - 1  # dout to the last stage
        if stream == DACT:
            return self.stage - 1
        return 0 if stream == OUT else self.stage + 1

    def sent_by(self, stream: str) -> int:
        """The stage that sends this board ``stream``."""
        if self.stage == 0:
            return 1 if stream == DACT else self.stages - 1  # out from the last stage
        if stream == ACT:
            return self.stage - 1
        return 0 if stream == DOUT else self.stage + 1

    def _streams(self, sending: bool) -> list[tuple[str, int]]:
        s, last = self.stage, self.stages - 1
        if sending:
            names = [ACT, DOUT] if s == 0 else [OUT if s == last else ACT, DACT]
            other = self.sent_to
        else:
            names = [OUT, DACT] if s == 0 else [ACT, DOUT if s == last else DACT]
            other = self.sent_by
        found: list[tuple[str, int]] = []
        for stream in names:
            for src, micro, _ in self.units():
                pair = (stream, self.board_of(other(stream), src, micro))
                if pair not in found:
                    found.append(pair)
        return found

    def sends(self) -> list[tuple[str, int]]:
        """The streams this board sends, each with its receiver (an index into :attr:`peers`)."""
        return self._streams(True)

    def receives(self) -> list[tuple[str, int]]:
        """The streams this board receives, each with its sender (an index into :attr:`peers`)."""
        return self._streams(False)

    def sender_of(self, stream: str, src: int, micro: int) -> int | None:
        """The board that sends this board unit ``(src, micro)`` on ``stream``; None: this board does not take it."""
        if self.routes.member(self.stage, src, micro) != self.member:
            return None
        return self.board_of(self.sent_by(stream), src, micro)

    def sample_shape(self, stream: str, *, sent_by: int) -> tuple[int, ...]:
        """One sample's shape on ``stream`` sent by stage ``sent_by``: an output of a stage, or the gradient of one."""
        if stream in (ACT, OUT, DOUT):
            return self.shapes[sent_by if stream != DOUT else self.stages - 1]
        return self.shapes[sent_by - 1]  # dact: the gradient of the sender's input, its upstream neighbour's output

    def max_frame_bytes(self, stream: str, sent_by: int) -> int:
        return self.max_rows * math.prod(self.sample_shape(stream, sent_by=sent_by)) * 4 + FRAME_MARGIN_BYTES


@dataclass
class _Inbox:
    """One incoming stream from one board: frames by (step, source board, micro-batch), or why the stream ended."""

    peer: StagePeer
    stage: int
    index: int
    frames: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    error: str = ""
    connected: bool = False


class StageEndpoint:
    """This host's side of every stream of the pipeline.

    Args:
        plan: the stage links of the plan, for this host.
        seed: this board's Ed25519 key (``security.board_key_file``): its certificate's key and its proofs'.
        stall_timeout_s: how long :meth:`recv` waits for a micro-batch before the neighbour is taken for stalled.

    Raises:
        StageFault: ``seed`` is not the key the plan names for this board.
    """

    def __init__(self, plan: StageLinkPlan, *, seed: bytes, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        if plan.stages < 2:
            raise ValueError("a pipeline has at least two stages")
        if ed25519_public_key(seed).hex() != plan.me.public_key.lower():
            raise StageFault(f"this board's key is not the one the plan names for board {plan.me.board_id}: check "
                             "security.board_key_file and the coordinator's --board-keys")
        self.plan, self.stall_timeout_s = plan, stall_timeout_s
        self.credentials = StageCredentials(HelloProver("ed25519", seed),
                                            board_keys={p.board_id: [bytes.fromhex(p.public_key)] for p in plan.peers})
        self._tls: ssl.SSLContext | None = None
        if plan.tls:
            self._tls = board_certificate(seed, plan.me.board_id).server_context()
            self._tls.sslsocket_class = BoardTlsSocket  # the blocking frame reader's MSG_WAITALL, as on a board
        self._cond = threading.Condition()
        self._inboxes = {(s, i): _Inbox(plan.peers[i], plan.stage_at(i), i) for s, i in plan.receives()}
        self._out: dict[tuple[str, int], socket.socket] = {}
        self._listener: socket.socket | None = None
        self._links: set[socket.socket] = set()  # incoming connections, shut by close() to end their reader threads
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.bytes_sent = self.bytes_received = 0
        self.waited_s = 0.0  # seconds spent waiting in recv for a neighbour's tensor, since the links opened

    # --- setting up ---------------------------------------------------------------------------------------------
    def listen(self, host: str, port: int = 0) -> int:
        """Bind and accept the neighbours' streams in a thread; returns the port."""
        sock = socket.create_server((host, port))
        self._listener = sock
        self._start(self._accept_loop, sock, name="stage-accept")
        return int(sock.getsockname()[1])

    def connect(self, *, start: int = 0, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Open every stream this host sends, retrying while a neighbour is not listening yet.

        Raises:
            StageFault: a neighbour cannot be reached within ``timeout_s``, fails TLS, or refuses this board.
        """
        until = time.monotonic() + timeout_s
        for stream, to in self.plan.sends():
            self._out[(stream, to)] = self._open(stream, self.plan.peers[to], self.plan.stage_at(to), start, until)

    def wait_connected(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Wait until every stream this host receives is connected.

        Raises:
            StageFault: one is not within ``timeout_s`` (naming the neighbour), or a stream failed.
        """
        until = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_errors()
                missing = [(s, i) for s, i in self._inboxes.items() if not i.connected]
                if not missing:
                    return
                left = until - time.monotonic()
                if left <= 0:
                    (stream, _), inbox = missing[0]
                    raise StageFault(f"board {inbox.peer.board_id} (stage {inbox.stage}) did not open its {stream} "
                                     f"stream to this board within {timeout_s:g} s: check that it runs the job and "
                                     f"can reach {self.plan.me.host}:{self.plan.me.port}")
                self._cond.wait(left)

    # --- a step -------------------------------------------------------------------------------------------------
    def send(self, stream: str, step: int, micro: int, micros: int, tensor: np.ndarray, *, src: int = 0) -> None:
        """Send one micro-batch's tensor on ``stream``; ``src``: the board of stage 0's group whose samples it holds
        (the receiver, where the stream goes to each of them).

        Raises:
            StageFault: the connection failed (naming the neighbour).
        """
        to = self.plan.board_of(self.plan.sent_to(stream), src, micro)
        sock = self._out.get((stream, to))
        if sock is None:
            raise StageFault(f"this board sends no {stream} of source board {src} micro-batch {micro}")
        frame = StageTensor(stream, step, micro, micros, np.ascontiguousarray(tensor, dtype=np.float32), src).to_wire()
        try:
            self.bytes_sent += send_frame(sock, frame)
        except OSError as exc:
            peer = self.plan.peers[to]
            raise StageFault(f"board {peer.board_id} (stage {self.plan.stage_at(to)}) took no {stream} for step {step} "
                             f"({exc.strerror or exc}): it left or stalled") from None

    def recv(self, stream: str, step: int, micro: int, *, rows: int | None = None, src: int = 0) -> tuple[np.ndarray, int]:
        """Micro-batch ``micro`` of source board ``src`` (of stage 0's group) of ``step`` on ``stream``, and that
        board's micro-batch count for the step.

        Args:
            rows: the samples it must hold (None: any number up to the plan's ``max_rows``).

        Raises:
            StageFault: it did not come within the stall timeout, the stream failed, or the tensor is not what the
                plan allows (naming the neighbour and what was wrong).
        """
        sender = self.plan.sender_of(stream, src, micro)
        inbox = self._inboxes.get((stream, sender)) if sender is not None else None
        if inbox is None:
            raise StageFault(f"this board takes no {stream} of source board {src} micro-batch {micro}")
        until = time.monotonic() + self.stall_timeout_s
        key = (step, src, micro)
        began = time.perf_counter()
        with self._cond:
            while key not in inbox.frames:
                if inbox.error:  # only this stream's end matters here: a neighbour that finished closes its others
                    raise StageFault(self._why(stream, inbox))
                left = until - time.monotonic()
                if left <= 0:
                    raise StageFault(f"board {inbox.peer.board_id} (stage {inbox.stage}) sent no {stream} for step "
                                     f"{step} micro-batch {micro} within {self.stall_timeout_s:g} s: it stalled or "
                                     "left")
                self._cond.wait(left)
            frame = inbox.frames.pop(key)
            self.waited_s += time.perf_counter() - began  # what this board's busy time leaves out (its step's compute)
        sample = self.plan.sample_shape(stream, sent_by=inbox.stage)
        try:
            got = StageTensor.from_wire(frame, stream, step=step, micro=micro, sample=sample, rows=rows,
                                        max_rows=self.plan.max_rows, src=src)
        except DecodeError as exc:
            self._fail(inbox, str(exc))
            # this frame's fault, not the stream's first: a neighbour that sent a bad last frame and closed has an
            # error already ("it closed the connection"), which would hide what was wrong
            raise StageFault(f"board {inbox.peer.board_id} (stage {inbox.stage}), {stream} stream: {exc}") from None
        return np.array(got.tensor), got.micros

    def close(self, reason: str = "") -> None:
        """Tell the neighbours why (when there is a reason: a fault), close every connection and end this host's
        threads (a reader blocked on a neighbour that is still up would otherwise outlive the job)."""
        with self._cond:
            self._closed = True
            links, threads = list(self._links), list(self._threads)
        for sock in self._out.values():
            if reason:
                try:
                    sock.settimeout(1.0)
                    send_frame(sock, StageMessage(STAGE_STOP, reason).to_wire())
                except OSError:
                    pass
            _shut(sock)
        if self._listener is not None:
            _shut(self._listener)
        for link in links:
            try:  # the plain socket's shutdown: the reader thread still owns the TLS state, and closes the link
                socket.socket.shutdown(link, socket.SHUT_RDWR)
            except OSError:
                pass
        with self._cond:
            self._cond.notify_all()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)

    # --- inside ---------------------------------------------------------------------------------------------------
    def _open(self, stream: str, peer: StagePeer, stage: int, start: int, until: float) -> socket.socket:
        where = f"board {peer.board_id} (stage {stage}) at {peer.host}:{peer.port}"
        while True:
            try:
                sock = socket.create_connection((peer.host, peer.port), timeout=HELLO_TIMEOUT_S)
                break
            except OSError as exc:
                if time.monotonic() >= until:
                    raise StageFault(f"cannot reach {where} for the {stream} stream ({exc.strerror or exc}): check "
                                     "that it runs the job and that the firewall lets the plan's port through") from None
                time.sleep(0.2)  # a retry, not a synchronisation: the neighbour is not listening yet
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.plan.tls:
                sock = connect_board_tls(sock, bytes.fromhex(peer.public_key), peer.board_id)
            me = self.plan.me
            proof = self.credentials.prove(self.plan.job_id, me.board_id, self.plan.stage, stream, peer.public_key)
            send_frame(sock, StageHello(job_id=self.plan.job_id, board_id=me.board_id, stage=self.plan.stage,
                                        stream=stream, start=start, proof=proof).to_wire())
            decode_stage_reply(recv_frame(sock, max_bytes=MAX_HELLO_BYTES))
        except TlsRefused as exc:
            sock.close()
            raise StageFault(f"{where} failed TLS for the {stream} stream ({exc})") from None
        except (StageStopped, DecodeError, ConnectionClosed, OSError) as exc:
            sock.close()
            raise StageFault(f"{where} refused this board's {stream} stream ({exc})") from None
        sock.settimeout(self.stall_timeout_s)
        return sock

    def _start(self, target: Any, *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._cond:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, address = listener.accept()
            except OSError:
                return
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._links.add(conn)  # shut by close() even during the handshake
            self._start(self._serve, conn, address, name="stage-stream")

    def _serve(self, conn: socket.socket, address: Any) -> None:
        """One incoming connection: TLS, the hello, then its stream's frames into the inbox."""
        where = f"{address[0]}:{address[1]}"
        link: socket.socket = conn
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            if self._tls is not None:
                link = self._tls.wrap_socket(conn, server_side=True)
                with self._cond:  # the wrapped socket took over the descriptor
                    self._links.discard(conn)
                    self._links.add(link)
            hello = StageHello.from_wire(recv_frame(link, max_bytes=MAX_HELLO_BYTES))
            problem = self._claim(hello)
            if problem:
                log.warning("stage link: refused a connection from %s: %s", where, problem)
                send_frame(link, StageMessage(STAGE_REFUSAL, problem).to_wire())
                self._drop(link)
                return
            send_frame(link, StageMessage(STAGE_WELCOME).to_wire())
        except (OSError, ssl.SSLError, DecodeError, ConnectionClosed) as exc:
            log.info("stage link: closed a connection from %s: %s", where, exc or "no hello in time")
            self._drop(link)
            return
        link.settimeout(None)  # the stall deadline is the training thread's, in recv
        inbox = self._inbox_of(hello)
        assert inbox is not None  # claimed above
        with self._cond:
            self._cond.notify_all()
        log.info("stage link: board %s (stage %d) opened its %s stream from %s", hello.board_id, hello.stage,
                 hello.stream, where)
        self._read(link, hello.stream, inbox)

    def _inbox_of(self, hello: StageHello) -> _Inbox | None:
        """The inbox of the stream ``hello`` opens: the plan's sender of that stream with the board it names."""
        for (stream, _), inbox in self._inboxes.items():
            if stream == hello.stream and inbox.peer.board_id == hello.board_id:
                return inbox
        return None

    def _claim(self, hello: StageHello) -> str:
        """Why ``hello`` is refused ("": its stream is now this connection's; checked and marked under one lock, so
        two hellos for one stream cannot both be taken)."""
        with self._cond:
            problem = self._check(hello)
            if not problem:
                inbox = self._inbox_of(hello)
                assert inbox is not None
                inbox.connected = True
            return problem

    def _check(self, hello: StageHello) -> str:
        senders = [inbox for (stream, _), inbox in self._inboxes.items() if stream == hello.stream]
        if not senders:
            return f"stage {self.plan.stage} receives no {hello.stream} stream"
        inbox = self._inbox_of(hello)
        if hello.job_id != self.plan.job_id or inbox is None or hello.stage != inbox.stage:
            named = " or ".join(f"board {i.peer.board_id} (stage {i.stage})" for i in senders)
            return (f"the plan has {named} send this host its {hello.stream}, not board {hello.board_id} (stage "
                    f"{hello.stage}) of job {hello.job_id}")
        if not self.credentials.check(hello.job_id, hello.board_id, hello.stage, hello.stream, self.plan.me.public_key,
                                      hello.proof):
            return "wrong credential"
        if inbox.connected:
            return f"board {hello.board_id} already holds this host's {hello.stream} stream"
        return ""

    def _read(self, link: socket.socket, stream: str, inbox: _Inbox) -> None:
        max_bytes = self.plan.max_frame_bytes(stream, inbox.stage)
        try:
            while not self._closed:
                frame = recv_frame(link, max_bytes=max_bytes)
                step, src, micro, micros = StageTensor.key_of(frame, stream)
                if micros > self.plan.micro_batches:
                    raise DecodeError(f"a step of {micros} micro-batches; the plan has at most {self.plan.micro_batches}")
                if not 0 <= src < self.plan.group or self._carried_by(stream, src, micro) != inbox.index:
                    raise DecodeError(f"micro-batch {micro} of source board {src}, which this stream does not carry")
                with self._cond:
                    if len(inbox.frames) >= 2 * self.plan.micro_batches * self.plan.group:
                        raise DecodeError(f"it sent more {stream} micro-batches ahead than the plan allows "
                                          f"({len(inbox.frames)} waiting)")
                    inbox.frames[(step, src, micro)] = frame  # its tensor is checked when taken (recv)
                    self.bytes_received += _data_bytes(frame)
                    self._cond.notify_all()
        except ConnectionClosed:
            if not self._closed:
                self._fail(inbox, "it closed the connection")
        except StageStopped as exc:
            self._fail(inbox, f"it stopped: {exc}")
        except (OSError, DecodeError) as exc:
            if not self._closed:
                self._fail(inbox, f"{exc}")
        finally:
            self._drop(link)

    def _carried_by(self, stream: str, src: int, micro: int) -> int | None:
        try:
            return self.plan.sender_of(stream, src, micro)
        except StageFault:
            return None

    def _drop(self, link: socket.socket) -> None:
        with self._cond:
            self._links.discard(link)
        link.close()

    def _fail(self, inbox: _Inbox, why: str) -> None:
        with self._cond:
            inbox.error = inbox.error or why
            self._cond.notify_all()

    def _raise_errors(self) -> None:
        for (stream, _), inbox in self._inboxes.items():
            if inbox.error:
                raise StageFault(self._why(stream, inbox))

    @staticmethod
    def _why(stream: str, inbox: _Inbox) -> str:
        return f"board {inbox.peer.board_id} (stage {inbox.stage}), {stream} stream: {inbox.error}"


def _data_bytes(frame: dict[str, Any]) -> int:
    """A received frame's tensor bytes, for the counters; 0 where the frame has none (recv refuses it then)."""
    tensor = frame.get("t")
    data = tensor.get("data") if isinstance(tensor, dict) else None
    return memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else 0


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


__all__ = ["STALL_TIMEOUT_S", "StageEndpoint", "StageFault", "StageLinkPlan", "StagePeer"]
