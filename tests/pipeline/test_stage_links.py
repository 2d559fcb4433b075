"""Two real stage hosts (agent.stage_links) in one process, over TLS on 127.0.0.1 (issue 35): every stream
carries its micro-batches both ways, and whatever goes wrong (a stall, a bad tensor, an impostor, a wrong
certificate, an oversized frame, a neighbour that stops) ends in one StageFault naming the neighbour and why."""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.stage_links import StageEndpoint, StageFault, StageLinkPlan, StagePeer
from edgefleet.brokers.ports import free_port
from edgefleet.protocol.exchange_auth import HelloProver
from edgefleet.protocol.framing import FRAME_HEADER
from edgefleet.protocol.signing import ed25519_public_key, generate_ed25519_seed
from edgefleet.protocol.stage_auth import stage_hello_message
from edgefleet.protocol.stage_frames import ACT, DACT, DOUT, OUT, StageHello, decode_stage_reply
from edgefleet.transport.board_tls import connect_board_tls
from edgefleet.transport.frame_io import recv_frame, send_frame

JOB = "job-links"
BOARDS = ("board-0", "board-1")
SHAPES = [(3, 2), (5,)]  # stage 0's output per sample, stage 1's (the model's)
MAX_ROWS = 4
STALL_S = 10.0  # long enough never to fire on a busy host where a test does not want it to


@dataclass
class Fleet:
    """Two boards' keys, and every endpoint a test made (all closed at its end)."""

    seeds: list[bytes]
    ports: list[int]
    endpoints: list[StageEndpoint] = field(default_factory=list)

    def peers(self) -> list[StagePeer]:
        return [StagePeer(b, "127.0.0.1", p, ed25519_public_key(k).hex()) for b, p, k in zip(BOARDS, self.ports, self.seeds)]

    def endpoint(self, stage: int, *, peers: list[StagePeer] | None = None, seed: bytes | None = None,
                 max_rows: int = MAX_ROWS, stall_s: float = STALL_S, listen: bool = True) -> StageEndpoint:
        """Stage ``stage``'s host, listening on its port (``peers``/``seed``: what it claims and proves with; a
        ``seed`` of its own is named in its own plan, as an impostor's would be, not in the receiver's)."""
        peers = list(peers or self.peers())
        shapes = SHAPES if len(peers) == 2 else [SHAPES[0]] * (len(peers) - 1) + [SHAPES[1]]
        own = stage if len(peers) == 2 else BOARDS.index(peers[stage].board_id)
        if seed is not None:
            peers[stage] = replace(peers[stage], public_key=ed25519_public_key(seed).hex())
        plan = StageLinkPlan(job_id=JOB, stage=stage, peers=peers, shapes=shapes, max_rows=max_rows, micro_batches=4)
        endpoint = StageEndpoint(plan, seed=seed or self.seeds[own], stall_timeout_s=stall_s)
        self.endpoints.append(endpoint)
        if listen:
            endpoint.listen("127.0.0.1", self.ports[own])
        return endpoint


@pytest.fixture()
def fleet() -> Iterator[Fleet]:
    made = Fleet(seeds=[generate_ed25519_seed() for _ in BOARDS], ports=[free_port(), free_port()])
    before = set(threading.enumerate())
    try:
        yield made
    finally:
        for endpoint in made.endpoints:
            endpoint.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads left running after both endpoints closed: {left}"


def _in_threads(*calls: Callable[[], Any]) -> list[Exception | None]:
    """Run each call in a thread of its own and wait for all; what each raised (None: it returned)."""
    raised: list[Exception | None] = [None] * len(calls)

    def run(at: int) -> None:
        try:
            calls[at]()
        except Exception as exc:  # handed to the test, which asserts on it
            raised[at] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a call did not return within 30 s"
    return raised


def _linked(fleet: Fleet, **options: Any) -> tuple[StageEndpoint, StageEndpoint]:
    first, last = fleet.endpoint(0, **options), fleet.endpoint(1, **options)
    assert _in_threads(first.connect, last.connect) == [None, None]
    first.wait_connected(timeout_s=10)
    last.wait_connected(timeout_s=10)
    return first, last


def _rows(n: int, shape: tuple[int, ...], offset: float = 0.0) -> np.ndarray:
    return (np.arange(n * int(np.prod(shape)), dtype=np.float32).reshape(n, *shape) + offset)


def _fault(call: Callable[[], Any]) -> str:
    with pytest.raises(StageFault) as caught:
        call()
    return str(caught.value)


def _raw_stream(fleet: Fleet, *, stream: str = ACT, to: int = 1) -> socket.socket:
    """A connection to stage ``to``'s host opened by hand as the plan's sender of ``stream``, welcomed."""
    sender = 1 - to
    receiver_key = ed25519_public_key(fleet.seeds[to])
    sock = connect_board_tls(socket.create_connection(("127.0.0.1", fleet.ports[to]), timeout=10), receiver_key,
                             BOARDS[to])
    proof = HelloProver("ed25519", fleet.seeds[sender]).prove_message(
        stage_hello_message(JOB, BOARDS[sender], sender, stream, receiver_key.hex()))
    send_frame(sock, StageHello(job_id=JOB, board_id=BOARDS[sender], stage=sender, stream=stream, start=0,
                                proof=proof).to_wire())
    decode_stage_reply(recv_frame(sock, max_bytes=4096))
    return sock


# --- tensors both ways ----------------------------------------------------------------------------------------------

def test_every_stream_carries_its_micro_batches_out_of_order_and_they_are_taken_in_order(fleet: Fleet) -> None:
    first, last = _linked(fleet)
    sent: dict[tuple[str, int, int], np.ndarray] = {}
    for step in (0, 1):
        for micro in (1, 0, 2):  # micro-batch 1 before 0
            rows = 2 + micro % 2
            for endpoint, stream, shape in ((first, ACT, SHAPES[0]), (last, OUT, SHAPES[1]),
                                            (first, DOUT, SHAPES[1]), (last, DACT, SHAPES[0])):
                sent[stream, step, micro] = _rows(rows, shape, offset=100 * step + 10 * micro)
                endpoint.send(stream, step, micro, 3, sent[stream, step, micro])
        for micro in (0, 1, 2):
            for endpoint, stream in ((last, ACT), (first, OUT), (last, DOUT), (first, DACT)):
                got, micros = endpoint.recv(stream, step, micro, rows=sent[stream, step, micro].shape[0])
                assert micros == 3
                assert got.dtype == np.float32 and np.array_equal(got, sent[stream, step, micro]), (stream, micro)
    assert first.bytes_sent > 0 and first.bytes_received > 0 and last.bytes_received > 0


# --- faults on a stream ---------------------------------------------------------------------------------------------

def test_a_stall_names_the_peer_its_stage_the_stream_step_and_micro_batch(fleet: Fleet) -> None:
    first, last = _linked(fleet, stall_s=0.5)
    why = _fault(lambda: last.recv(ACT, 3, 2))
    assert all(part in why for part in ("board board-0 (stage 0)", "act", "step 3 micro-batch 2", "within 0.5 s")), why
    why = _fault(lambda: first.recv(DACT, 0, 0))
    assert "board board-1 (stage 1)" in why and "dact" in why and "within" in why, why


@pytest.mark.parametrize(("tensor", "what"), [
    (np.zeros((2, 2, 3), np.float32), r"shape (2, 2, 3) float32, expected shape (2, 3, 2) float32"),
    (np.full((2, 3, 2), np.nan, np.float32), "holds NaN or infinite values"),
    (np.full((2, 3, 2), -np.inf, np.float32), "holds NaN or infinite values"),
])
def test_a_bad_tensor_from_the_peer_is_a_fault_naming_it_and_what_was_wrong(fleet: Fleet, tensor: np.ndarray,
                                                                             what: str) -> None:
    first, last = _linked(fleet)
    first.send(ACT, 0, 0, 1, tensor)
    why = _fault(lambda: last.recv(ACT, 0, 0, rows=2))
    assert "board board-0 (stage 0), act stream" in why and what in why, why


def test_a_bad_last_tensor_of_a_peer_that_then_closed_is_reported_as_the_bad_tensor(fleet: Fleet) -> None:
    first, last = _linked(fleet)
    first.send(ACT, 0, 0, 2, np.full((2, 3, 2), np.nan, np.float32))
    first.close()
    assert "within" not in _fault(lambda: last.recv(ACT, 0, 1))  # the close has been read: the NaN frame came first
    why = _fault(lambda: last.recv(ACT, 0, 0))
    assert "NaN" in why, why


def test_a_malformed_tensor_map_fails_only_its_micro_batch_and_the_stream_goes_on(fleet: Fleet) -> None:
    last = fleet.endpoint(1, stall_s=3.0)
    with _raw_stream(fleet) as raw:
        send_frame(raw, {"type": "stage_tensor", "k": ACT, "step": 0, "mb": 0, "n": 2, "t": {"dtype": "float32"}})
        good = _rows(1, SHAPES[0])
        send_frame(raw, {"type": "stage_tensor", "k": ACT, "step": 0, "mb": 1, "n": 2,
                         "t": {"dtype": "float32", "shape": [1, 3, 2], "data": good.tobytes()}})
        assert np.array_equal(last.recv(ACT, 0, 1)[0], good)
        why = _fault(lambda: last.recv(ACT, 0, 0))
    assert "board board-0 (stage 0), act stream" in why and "tensor map lacks" in why, why


# --- who may open a stream ------------------------------------------------------------------------------------------

def _refused(fleet: Fleet, claimant: StageEndpoint, receiver: StageEndpoint) -> str:
    (raised,) = _in_threads(claimant.connect)
    assert isinstance(raised, StageFault), raised
    assert "refused" in str(raised), raised
    not_open = _fault(lambda: receiver.wait_connected(timeout_s=0.3))  # a bound, not a synchronisation
    assert "board board-0 (stage 0) did not open its act stream" in not_open, not_open
    return str(raised)


def test_a_peer_proving_with_the_wrong_key_is_refused(fleet: Fleet) -> None:
    receiver = fleet.endpoint(1)
    why = _refused(fleet, fleet.endpoint(0, seed=generate_ed25519_seed()), receiver)
    assert "wrong credential" in why and "act stream" in why, why


def test_a_board_the_plan_does_not_name_is_refused(fleet: Fleet) -> None:
    receiver = fleet.endpoint(1)
    peers = fleet.peers()
    stranger = fleet.endpoint(0, peers=[replace(peers[0], board_id="board-x"), peers[1]], listen=False)
    why = _refused(fleet, stranger, receiver)
    assert "not board board-x (stage 0)" in why, why


def test_the_right_board_claiming_another_stage_is_refused(fleet: Fleet) -> None:
    receiver = fleet.endpoint(1)
    peers = fleet.peers()  # board-0 claims stage 1 of a three-stage plan whose stage 2 is the receiver
    claimant = fleet.endpoint(1, peers=[StagePeer("board-y", "127.0.0.1", 1, "00" * 32), peers[0], peers[1]], listen=False)
    why = _refused(fleet, claimant, receiver)
    assert "the plan has board board-0 (stage 0)" in why and "not board board-0 (stage 1)" in why, why


def test_a_client_pinning_another_certificate_fails_tls(fleet: Fleet) -> None:
    receiver = fleet.endpoint(1)
    peers = fleet.peers()
    other = ed25519_public_key(generate_ed25519_seed()).hex()
    pinning = fleet.endpoint(0, peers=[peers[0], replace(peers[1], public_key=other)], listen=False)
    (raised,) = _in_threads(pinning.connect)
    assert isinstance(raised, StageFault) and "TLS" in str(raised) and "board-1 (stage 1)" in str(raised), raised
    assert "did not open" in _fault(lambda: receiver.wait_connected(timeout_s=0.3))


# --- frames over the plan's bound -----------------------------------------------------------------------------------

def test_a_frame_over_the_plan_bound_is_a_fault(fleet: Fleet) -> None:
    first, last = fleet.endpoint(0, max_rows=64), fleet.endpoint(1)  # the sender's plan allows more rows
    assert _in_threads(first.connect, last.connect) == [None, None]
    first.send(ACT, 0, 0, 1, _rows(64, SHAPES[0]))
    why = _fault(lambda: last.recv(ACT, 0, 0))
    assert "board board-0 (stage 0), act stream" in why and "over the limit" in why, why


def test_an_oversized_frame_is_refused_from_its_header_before_memory_is_allocated(fleet: Fleet) -> None:
    last = fleet.endpoint(1)
    announced = 512 << 20
    with _raw_stream(fleet) as raw:
        tracemalloc.start()
        try:
            raw.sendall(FRAME_HEADER.pack(announced))  # and never the body: only the header can be judged
            why = _fault(lambda: last.recv(ACT, 0, 0))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert f"frame announces {announced} bytes, over the limit" in why and "within" not in why, why
    assert peak < announced // 16, f"{peak} bytes allocated for a refused frame"


# --- a neighbour that stops -----------------------------------------------------------------------------------------

def test_a_peer_closing_with_a_reason_fails_a_pending_recv_with_it(fleet: Fleet) -> None:
    first, last = _linked(fleet)
    raised = _in_threads(lambda: last.recv(ACT, 0, 0), lambda: first.close("board-0 ran out of memory"))
    assert isinstance(raised[0], StageFault) and raised[1] is None, raised
    assert "board board-0 (stage 0), act stream" in str(raised[0]), raised[0]
    assert "board-0 ran out of memory" in str(raised[0]), raised[0]


def test_a_peer_closing_normally_after_its_last_frame_leaves_frames_already_sent_to_take(fleet: Fleet) -> None:
    first, last = _linked(fleet)
    out, dact = _rows(2, SHAPES[1]), _rows(2, SHAPES[0], offset=1)
    last.send(OUT, 0, 0, 1, out)
    last.send(DACT, 0, 0, 1, dact)
    last.close()
    assert np.array_equal(first.recv(DACT, 0, 0, rows=2)[0], dact)
    assert np.array_equal(first.recv(OUT, 0, 0, rows=2)[0], out)
    why = _fault(lambda: first.recv(OUT, 1, 0))  # nothing more comes: said at once, not after the stall timeout
    assert "board board-1 (stage 1), out stream" in why and "within" not in why, why


def test_a_peer_sending_too_far_ahead_is_a_fault(fleet: Fleet) -> None:
    first, last = _linked(fleet)  # the plan: at most 4 micro-batches a step, two steps' worth waiting
    try:
        for step in range(3):
            for micro in range(4):
                first.send(ACT, step, micro, 4, _rows(1, SHAPES[0]))
    except StageFault:
        pass  # the receiver may have closed the stream at the excess before the sender finished: the fault is its
    assert np.array_equal(last.recv(ACT, 0, 0)[0], _rows(1, SHAPES[0]))  # what came before the excess is taken
    why = _fault(lambda: last.recv(ACT, 2, 3))
    assert "more act micro-batches ahead than the plan allows" in why, why


def test_a_step_of_more_micro_batches_than_the_plan_is_a_fault(fleet: Fleet) -> None:
    first, last = _linked(fleet)
    first.send(ACT, 0, 0, 5, _rows(1, SHAPES[0]))
    why = _fault(lambda: last.recv(ACT, 0, 0))
    assert "a step of 5 micro-batches; the plan has at most 4" in why, why


def test_each_board_links_to_the_boards_the_plan_says_with_a_group_of_two_at_stage_0() -> None:
    peers = [StagePeer(f"b{i}", "127.0.0.1", 1 + i, "00" * 32) for i in range(4)]  # b0, b1: stage 0; b2, b3: 1, 2

    def plan(stage: int, member: int = 0) -> StageLinkPlan:
        return StageLinkPlan(job_id=JOB, stage=stage, peers=peers, shapes=[(3,), (3,), (2,)], max_rows=4,
                             micro_batches=2, group=2, member=member)

    assert plan(0).stages == 3 and plan(0, 1).me.board_id == "b1"
    assert plan(0, 1).sends() == [(ACT, 2), (DOUT, 3)] and plan(0, 1).receives() == [(OUT, 3), (DACT, 2)]
    assert plan(1).sends() == [(ACT, 3), (DACT, 0), (DACT, 1)] and plan(1).receives() == [(ACT, 0), (ACT, 1), (DACT, 3)]
    assert plan(2).sends() == [(OUT, 0), (OUT, 1), (DACT, 2)] and plan(2).receives() == [(ACT, 2), (DOUT, 0), (DOUT, 1)]


def test_a_stage_host_waits_for_its_neighbours_as_long_as_the_coordinator_waits_for_every_board() -> None:
    # a neighbour starting a fresh worker on a slow board comes late (fleet8's pi4-3 after its agent's restart took
    # over a minute): the host must not give up on it while the coordinator still waits for it to join
    from edgefleet.agent import stage_links
    from edgefleet.coordinator.run.training import JOIN_TIMEOUT_S

    assert stage_links.CONNECT_TIMEOUT_S >= JOIN_TIMEOUT_S
