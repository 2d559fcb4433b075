"""The exchange server over real TCP sockets, with real board clients on threads."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edgefleet.agent.worker_exchange import ExchangeClient, ExchangeRefused, StopTraining
from edgefleet.coordinator.exchange.board_state import BoardState
from edgefleet.coordinator.exchange.gradient_reduce import GradientReducer
from edgefleet.coordinator.exchange.modes import DenseExact, OverlapStream, PeriodicAveraging, select_mode
from edgefleet.coordinator.exchange.server import ExchangeError, ExchangeServer
from edgefleet.protocol.codec import encode_value
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.protocol.exchange_frames import BatchSplit, Grad, Hello, Refusal, Welcome, decode_hello_reply
from edgefleet.protocol.split_schedule import SplitSchedule
from edgefleet.protocol.sync_schedule import SyncSchedule

P = 1000  # parameters
BOARDS = [("b0", 8), ("b1", 16), ("b2", 24)]


def _server(wire_dtype: str = "float32", **kwargs: Any) -> ExchangeServer:
    return ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=P, wire_dtype=wire_dtype,
                          welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                          **kwargs)


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {board: rng.standard_normal(P).astype(np.float32) for board, _ in BOARDS}


class Board(threading.Thread):
    """A board that joins and runs ``steps`` with the gradient ``make(step)`` (None: skip that step)."""

    def __init__(self, board_id: str, port: int, steps: int, make: Callable[[int], np.ndarray | None],
                 before_send: Callable[[int], None] = lambda step: None, token: str = "secret") -> None:
        super().__init__(daemon=True)
        self.board_id, self.port, self.steps, self.make, self.before_send, self.token = board_id, port, steps, make, before_send, token
        self.results: list[np.ndarray] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        n = dict(BOARDS)[self.board_id]
        try:
            client = ExchangeClient("127.0.0.1", self.port)
            client.hello(job_id="job", board_id=self.board_id, token=self.token, param_count=P)
            for step in range(self.steps):
                grad = self.make(step)
                if grad is None:
                    client.close()
                    return
                self.before_send(step)
                self.results.append(np.array(client.exchange(step=step, grad=grad, n=n, loss=1.0, compute_s=0.01)))
        except (ExchangeRefused, StopTraining, OSError) as exc:
            self.error = exc


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_weighted_mean_is_exact_and_every_board_gets_it() -> None:
    async def main() -> tuple[list[Any], list[Board], list[np.ndarray]]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        boards = [Board(b, port, 3, lambda step, b=b: _grads(step)[b]) for b, _ in BOARDS]
        for board in boards:
            board.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        results = [await server.run_step(s, apply=lambda g, r: applied.append(g.copy())) for s in range(3)]
        await server.close()
        return results, boards, applied

    results, boards, applied = _run(main())
    for step in range(3):
        g = _grads(step)
        expected = sum(n * g[b] for b, n in BOARDS) / 48
        np.testing.assert_allclose(applied[step], expected, atol=1e-6)
        for board in boards:
            np.testing.assert_array_equal(board.results[step], applied[step])  # the replica applies what boards get
        assert results[step].n_total == 48 and results[step].contributors == ["b0", "b1", "b2"]


def test_nan_and_wrong_shape_are_refused_for_that_step_only() -> None:
    def bad(board: str) -> Callable[[int], np.ndarray]:
        def make(step: int) -> np.ndarray:
            g = _grads(step)[board]
            if board == "b1" and step == 0:
                g = g.copy()
                g[3] = np.nan
            if board == "b2" and step == 1:
                g = g[:-1]  # wrong shape
            return g
        return make

    async def main() -> list[Any]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        for b, _ in BOARDS:
            Board(b, port, 3, bad(b)).start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        results = [await server.run_step(s, apply=lambda g, r: applied.append(g.copy())) for s in range(3)]
        flags = server.flags()
        await server.close()
        return [results, applied, flags]

    results, applied, flags = _run(main())
    assert results[0].contributors == ["b0", "b2"] and "NaN" in results[0].refused["b1"]
    g0 = _grads(0)
    np.testing.assert_allclose(applied[0], (8 * g0["b0"] + 24 * g0["b2"]) / 32, atol=1e-6)
    assert results[1].contributors == ["b0", "b1"] and "shape" in results[1].refused["b2"]
    assert results[2].contributors == ["b0", "b1", "b2"]  # both are back at the next step
    assert any("refused" in f for f in flags["b1"]) and any("refused" in f for f in flags["b2"])


def test_a_late_board_is_left_out_of_the_step_and_stays_in_sync() -> None:
    release = threading.Event()

    async def main() -> tuple[list[Any], Board, list[np.ndarray]]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        slow = Board("b2", port, 2, lambda s: _grads(s)["b2"], before_send=lambda s: release.wait(30) if s == 0 else None)
        for b, _ in BOARDS[:2]:
            Board(b, port, 2, lambda s, b=b: _grads(s)[b]).start()
        slow.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        server._recent_s = [0.01] * 5  # past the first steps: the deadline follows the recent median
        applied: list[np.ndarray] = []
        first = await server.run_step(0, apply=lambda g, r: applied.append(g.copy()), minimum_deadline_s=0.3)
        release.set()
        second = await server.run_step(1, apply=lambda g, r: applied.append(g.copy()), minimum_deadline_s=30)
        await server.close()
        slow.join(10)
        return [first, second], slow, applied

    (first, second), slow, applied = _run(main())
    assert first.late == ["b2"] and first.contributors == ["b0", "b1"]
    assert second.contributors == ["b0", "b1", "b2"]
    np.testing.assert_array_equal(slow.results[0], applied[0])  # it applied the step it missed


def test_a_board_that_disconnects_does_not_hold_up_the_step() -> None:
    async def main() -> Any:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        for b, _ in BOARDS:
            Board(b, port, 3, lambda s, b=b: None if (b == "b1" and s == 1) else _grads(s)[b]).start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        results = [await server.run_step(s, apply=lambda g, r: None, minimum_deadline_s=60) for s in range(3)]
        await server.close()
        return results

    results = _run(main())
    assert results[1].contributors == ["b0", "b2"] and results[1].wall_s < 30
    assert results[2].contributors == ["b0", "b2"]


def test_strangers_are_refused() -> None:
    async def main() -> list[Board]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        wrong_token = Board("b0", port, 1, lambda s: _grads(s)["b0"], token="guess")
        stranger = Board("b9", port, 1, lambda s: _grads(s)["b0"])
        BOARDS.append(("b9", 4))
        try:
            for board in (wrong_token, stranger):
                board.start()
            await asyncio.get_running_loop().run_in_executor(None, wrong_token.join, 10)
            await asyncio.get_running_loop().run_in_executor(None, stranger.join, 10)
        finally:
            BOARDS.pop()
            await server.close()
        return [wrong_token, stranger]

    wrong_token, stranger = _run(main())
    assert isinstance(wrong_token.error, ExchangeRefused) and "token" in str(wrong_token.error)
    assert isinstance(stranger.error, ExchangeRefused) and "not part of job" in str(stranger.error)


def _hello(port: int, hello: Hello) -> Welcome | Refusal:
    """What the exchange answers ``hello`` on a fresh connection."""
    from edgefleet.transport.frame_io import recv_frame, send_frame

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        send_frame(sock, hello.to_wire())
        return decode_hello_reply(recv_frame(sock))


@pytest.mark.parametrize("version, upgrade", [(2, "upgrade edge-coordinator"), (0, "upgrade edge-agent on board b1")])
def test_a_board_of_another_protocol_version_is_refused_and_reported_for_that_board(monkeypatch, version: int,
                                                                                    upgrade: str) -> None:
    """The real board client speaking another version: it is told which side to upgrade, and the coordinator's
    wait for the boards fails naming it. A hello of another version without the job's token fails no board."""
    import functools

    monkeypatch.setattr("edgefleet.agent.worker_exchange.Hello", functools.partial(Hello, v=version))

    async def main() -> tuple[Board, Welcome | Refusal, str, dict[str, list[str]]]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        stranger = await loop.run_in_executor(None, _hello, port, Hello(job_id="job", board_id="b0", token="guess",
                                                                         param_count=P, v=version))
        board = Board("b1", port, 1, lambda s: _grads(s)["b1"])
        board.start()
        try:
            with pytest.raises(ExchangeError) as failed:
                await server.wait_for_boards(10, need={"b0", "b1"})
            await loop.run_in_executor(None, board.join, 10)
            return board, stranger, str(failed.value), server.flags()
        finally:
            await server.close()

    board, stranger, failure, flags = _run(main())
    message = f"board b1 speaks exchange protocol {version}, this coordinator 1: {upgrade}"
    assert isinstance(board.error, ExchangeRefused) and str(board.error) == f"the coordinator refused this board: {message}"
    assert failure == f"board b1: {message}"
    assert flags == {"b1": [f"refused: {message}"]}
    assert isinstance(stranger, Refusal) and stranger.message.startswith(f"board b0 speaks exchange protocol {version}")


def test_a_malformed_hello_is_refused_with_what_is_wrong() -> None:
    async def main() -> list[Welcome | Refusal]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        try:
            return [await loop.run_in_executor(None, _hello, port, hello) for hello in (
                Hello(job_id="job", board_id="b0", token="secret", param_count=-1),
                Hello(job_id="job", board_id="b0", token="secret", param_count=P + 1),
                Hello(job_id="job", board_id="b0", token="secret", param_count=P))]
        finally:
            await server.close()

    negative, other_model, fine = _run(main())
    assert isinstance(negative, Refusal) and negative.message == "malformed hello (hello frame: param_count -1 is below 0)"
    assert isinstance(other_model, Refusal) and f"{P + 1} trainable parameters" in other_model.message
    assert isinstance(fine, Welcome) and fine.step == 0


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def main() -> None:
            await _server().start("127.0.0.1", port)

        with pytest.raises(ExchangeError, match="--exchange-port"):
            _run(main())


class SplitBoard(threading.Thread):
    """A board that follows re-splits: its n at each step is its size in the split in force then."""

    def __init__(self, board_id: str, port: int, steps: int) -> None:
        super().__init__(daemon=True)
        self.board_id, self.port, self.steps = board_id, port, steps
        self.index = [b for b, _ in BOARDS].index(board_id)
        self.welcome: Welcome | None = None
        self.announced: dict[int, tuple[int, list[int]]] = {}  # step whose result carried a split -> the split
        self.error: BaseException | None = None

    def run(self) -> None:
        sizes_from = [BatchSplit(0, tuple(n for _, n in BOARDS))]
        try:
            client = ExchangeClient("127.0.0.1", self.port)
            self.welcome = client.hello(job_id="job", board_id=self.board_id, token="secret", param_count=P)
            sizes_from += self.welcome.splits
            start = self.welcome.step
            for step in range(start, start + self.steps):
                n = [s.batch_sizes for s in sizes_from if s.from_step <= step][-1][self.index]
                client.exchange(step=step, grad=_grads(step)[self.board_id], n=n, loss=1.0, compute_s=0.01)
                if client.split is not None:
                    self.announced[step] = (client.split.from_step, list(client.split.batch_sizes))
                    sizes_from.append(client.split)
            client.close()
        except (EdgeTrainError, OSError) as exc:  # reported to the test through self.error
            self.error = exc


def test_a_resplit_travels_in_the_next_result_and_in_later_welcomes() -> None:
    replica = {"step": 0}  # what the coordinator's replica would hand a joining board
    applied: list[np.ndarray] = []

    def apply(g: np.ndarray, result: object) -> None:
        applied.append(g.copy())
        replica["step"] += 1

    async def main() -> tuple[list[Any], list[SplitBoard], Any]:
        server = ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=P, wire_dtype="float32",
                                welcome_state=lambda: (replica["step"], encode_value({}), encode_value({})))
        port = await server.start("127.0.0.1", 0)
        early = [SplitBoard(b, port, 6) for b in ("b0", "b1")]
        for board in early:
            board.start()
        await server.wait_for_boards(10, need={"b0", "b1"})
        results = [await server.run_step(0, apply=apply, minimum_deadline_s=30)]
        assert server.next_split_step == 3
        assert server.announce_split([16, 16, 16]) == 3       # goes out with step 1's result
        results.append(await server.run_step(1, apply=apply, minimum_deadline_s=30))
        late = SplitBoard("b2", port, 4)                      # joins at step 2: learns the split in its welcome
        late.start()
        await server.wait_for_boards(10, need={"b0", "b1", "b2"})
        for step in range(2, 6):
            results.append(await server.run_step(step, apply=apply, minimum_deadline_s=30))
        with pytest.raises(ExchangeError, match="keep the global batch of 48"):
            server.announce_split([16, 16, 10])
        in_force = server.splits_from(7)
        await server.close()
        return results, [*early, late], in_force

    results, boards, in_force = _run(main())
    assert not any(board.error for board in boards), [board.error for board in boards]
    assert [board.announced for board in boards[:2]] == [{1: (3, [16, 16, 16])}] * 2
    assert boards[2].welcome is not None and boards[0].welcome is not None
    assert boards[2].welcome.step == 2 and boards[2].welcome.splits == (BatchSplit(3, (16, 16, 16)),)
    assert boards[0].welcome.splits == () and boards[2].announced == {}
    assert [r.batch_sizes for r in results[:3]] == [{"b0": 8, "b1": 16}, {"b0": 8, "b1": 16}, {"b0": 8, "b1": 16, "b2": 24}]
    assert all(r.batch_sizes == {"b0": 16, "b1": 16, "b2": 16} and r.n_total == 48 for r in results[3:])
    assert in_force == [BatchSplit(3, (16, 16, 16))]
    g = _grads(4)  # after the change the reduce weighs each board by its new n
    np.testing.assert_allclose(applied[4], sum(16 * g[b] for b, _ in BOARDS) / 48, atol=1e-6)


def test_a_resumed_exchange_welcomes_boards_with_the_split_in_force() -> None:
    server = ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=P, wire_dtype="float32",
                            welcome_state=lambda: (0, encode_value({}), encode_value({})),
                            splits=[BatchSplit(4, (16, 16, 16)), BatchSplit(9, (4, 20, 24))])
    assert server.splits_from(3) == server.splits == [BatchSplit(4, (16, 16, 16)), BatchSplit(9, (4, 20, 24))]
    assert server.splits_from(9) == [BatchSplit(9, (4, 20, 24))]
    assert server.splits_from(5) == server.splits_from(4) == server.splits
    assert [server.batch_sizes_at(s) for s in (3, 4, 9)] == [[8, 16, 24], [16, 16, 16], [4, 20, 24]]
    with pytest.raises(ExchangeError, match="would come before"):
        ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=P, wire_dtype="float32",
                       welcome_state=lambda: (0, None, None), splits=[BatchSplit(9, (16, 16, 16)), BatchSplit(4, (16, 16, 16))])


def test_a_board_whose_coordinator_stops_answering_gets_a_timeout_naming_the_wait() -> None:
    from edgefleet.transport.frame_io import recv_frame, send_frame

    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def silent_coordinator() -> None:  # welcomes the board, takes its gradient, never answers
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            seen.append(type(Hello.from_wire(recv_frame(conn))).__name__)
            send_frame(conn, Welcome(step=0, model={}, optimizer={}).to_wire())
            seen.append(type(Grad.from_wire(recv_frame(conn), elements=P, dtype="float32")).__name__)
            conn.recv(1)  # until the board gives up and closes

    coordinator = threading.Thread(target=silent_coordinator, daemon=True)
    coordinator.start()
    client = ExchangeClient("127.0.0.1", listener.getsockname()[1], result_timeout_s=0.5)
    try:
        client.hello(job_id="job", board_id="b0", token="secret", param_count=P)
        with pytest.raises(TimeoutError, match="no answer from the coordinator within 0.5 s"):
            client.exchange(step=0, grad=np.zeros(P, np.float32), n=8, loss=1.0, compute_s=0.01)
    finally:
        client.close()
        listener.close()
    coordinator.join(10)
    assert seen == ["Hello", "Grad"]


def _reference_sum(grads: dict[str, np.ndarray], counts: dict[str, int]) -> np.ndarray:
    """The average as the server defines it: weights n_i / sum(n) in float32, added in board order."""
    total = sum(counts.values())
    acc = None
    for board, _ in BOARDS:
        part = grads[board] * np.float32(counts[board] / total)
        acc = part if acc is None else acc + part
    assert acc is not None
    return acc


def test_summing_gradients_as_they_arrive_gives_the_same_bits_in_any_arrival_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """b2 starts sending first and b0 last; from step 1 on the server adds each gradient as it arrives (the
    counts of step 0 give the weights), and at step 3 the counts change (a re-split for that step only: a board
    may send no count but the split's): summed in full again, and at step 4, back to the first counts."""
    steps = 5
    sent = {board: [threading.Event() for _ in range(steps)] for board, _ in BOARDS}
    after = {"b2": None, "b1": "b2", "b0": "b1"}  # who waits for whom

    def make(board: str) -> Callable[[int], np.ndarray]:
        return lambda step: _grads(step)[board]

    def before_send(board: str) -> Callable[[int], None]:
        def wait(step: int) -> None:
            if after[board] is not None:
                sent[after[board]][step].wait(10)
            sent[board][step].set()  # just before its send: the next board is likely, not sure, to arrive later
        return wait

    class CountingBoard(Board):
        def run(self) -> None:  # b1 and b2 send 20 samples instead of 16 and 24 at step 3 (the re-split's)
            client = ExchangeClient("127.0.0.1", self.port)
            client.hello(job_id="job", board_id=self.board_id, token=self.token, param_count=P)
            for step in range(self.steps):
                self.before_send(step)
                n = 20 if step == 3 and self.board_id in ("b1", "b2") else dict(BOARDS)[self.board_id]
                self.results.append(np.array(client.exchange(step=step, grad=self.make(step), n=n, loss=1.0,
                                                             compute_s=0.01)))

    async def main() -> tuple[list[np.ndarray], int]:
        server = _server(splits=[BatchSplit(from_step=3, batch_sizes=(8, 20, 20)),
                                 BatchSplit(from_step=4, batch_sizes=(8, 16, 24))])
        full_sums = 0
        original = server._reducer.weighted_sum

        def counting(*args: Any) -> list[float]:
            nonlocal full_sums
            full_sums += 1
            return original(*args)

        monkeypatch.setattr(server._reducer, "weighted_sum", counting)
        port = await server.start("127.0.0.1", 0)
        for b, _ in BOARDS:
            CountingBoard(b, port, steps, make(b), before_send=before_send(b)).start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        for s in range(steps):
            await server.run_step(s, apply=lambda g, r: applied.append(g.copy()))
        await server.close()
        return applied, full_sums

    applied, full_sums = _run(main())
    for step in range(steps):
        counts = dict(BOARDS) | ({"b1": 20, "b2": 20} if step == 3 else {})
        np.testing.assert_array_equal(applied[step], _reference_sum(_grads(step), counts))
    assert full_sums == 3  # step 0 (no counts known yet), step 3 (the counts changed), step 4 (after it)


def test_buffers_travel_from_the_first_board_and_do_not_count_in_the_norm_check() -> None:
    """The vector's last 10 elements are float buffers: the result carries the first board's exactly."""
    buffers = 10

    def make(step: int, board: str) -> np.ndarray:
        vector = _grads(step)[board]
        vector[-buffers:] = 1e6 * (1 + BOARDS.index((board, dict(BOARDS)[board])))  # |buffers| far over max_grad_norm
        return vector

    async def main(sync: str) -> list[np.ndarray]:
        server = ExchangeServer(job_id="job", token="secret", boards=BOARDS, param_count=P, wire_dtype="float32",
                                welcome_state=lambda: (0, encode_value({}), encode_value({})), max_grad_norm=1e3,
                                buffer_elements=buffers, buffer_sync=sync)
        port = await server.start("127.0.0.1", 0)
        boards = [Board(b, port, 2, lambda step, b=b: make(step, b)) for b, _ in BOARDS]
        for board in boards:
            board.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        results = [await server.run_step(s, apply=lambda g, r: applied.append(g.copy())) for s in range(2)]
        await server.close()
        assert all(r.contributors == [b for b, _ in BOARDS] and not r.refused for r in results)
        return applied

    broadcast, average = _run(main("broadcast")), _run(main("average"))
    for step in range(2):
        expected = sum(n * make(step, b) for b, n in BOARDS) / 48
        np.testing.assert_allclose(broadcast[step][:-buffers], expected[:-buffers], atol=1e-6)
        assert np.array_equal(broadcast[step][-buffers:], make(step, "b0")[-buffers:])
        np.testing.assert_allclose(average[step], expected, rtol=1e-6, atol=1e-6)


def test_logged_values_are_weighted_by_samples_and_bad_ones_refuse_the_gradient() -> None:
    class Logging(Board):
        def run(self) -> None:
            n = dict(BOARDS)[self.board_id]
            client = ExchangeClient("127.0.0.1", self.port)
            client.hello(job_id="job", board_id=self.board_id, token=self.token, param_count=P)
            logs: dict[str, Any] = {"acc": [float(n), True, True, False]}
            if self.board_id == "b2":
                logs = {"acc": [float(n), True, True, False], "x": ["not a number", True, False, False]}
            for step in range(2):
                client.exchange(step=step, grad=_grads(step)[self.board_id], n=n, loss=1.0, compute_s=0.01,
                                logs=logs if step == 0 or self.board_id != "b2" else {"acc": [24.0, True, True, False]})

    async def main() -> list[Any]:
        server = _server()
        port = await server.start("127.0.0.1", 0)
        for b, _ in BOARDS:
            Logging(b, port, 2, lambda step: None).start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        results = [await server.run_step(s, apply=lambda g, r: None) for s in range(2)]
        await server.close()
        return results

    first, second = _run(main())
    assert set(first.refused) == {"b2"} and "logged value 'x'" in first.refused["b2"]
    assert first.logs == {"acc": pytest.approx((8 * 8 + 16 * 16) / 24)} and first.log_flags["acc"] == (True, True, False)
    assert second.logs == {"acc": pytest.approx((8 * 8 + 16 * 16 + 24 * 24) / 48)} and not second.refused


def _mode_boards(sizes: list[int]) -> list[BoardState]:
    return [BoardState(f"b{i}", i, b) for i, b in enumerate(sizes)]


@pytest.mark.parametrize("overlap", [False, True])
def test_dense_and_overlap_expect_the_splits_batch_times_the_accumulation(overlap: bool) -> None:
    """Issue 36 item 1: the count a board must send at an exact step follows the schedule, re-splits included."""
    schedule = SplitSchedule([8, 16, 24], [BatchSplit(from_step=5, batch_sizes=(16, 16, 16))])
    mode = select_mode(GradientReducer(10, wire_dtype="float32"), schedule, overlap=overlap, accumulate=3)
    assert isinstance(mode, OverlapStream if overlap else DenseExact)
    boards = _mode_boards([8, 16, 24])
    assert [mode.expected_n(b, 0) for b in boards] == [24, 48, 72]
    assert [mode.expected_n(b, 4) for b in boards] == [24, 48, 72]
    assert [mode.expected_n(b, 5) for b in boards] == [48, 48, 48]  # the re-split's sizes from its step on
    schedule.add(9, [8, 8, 32])  # announced later: the mode sees it
    assert [mode.expected_n(b, 9) for b in boards] == [24, 24, 96]
    assert [mode.expected_n(b, 1) for b in _mode_boards([8, 16, 24])] == [24, 48, 72]
    assert select_mode(GradientReducer(10, wire_dtype="float32"), SplitSchedule([8])).expected_n(boards[0], 0) == 8
    with pytest.raises(ExchangeError, match="accumulate_grad_batches 0"):
        select_mode(GradientReducer(10, wire_dtype="float32"), schedule, accumulate=0)


def test_periodic_averaging_expects_the_batch_at_a_local_step_and_the_samples_since_the_average_at_a_sync_step() -> None:
    """Issue 36 item 1: exact steps (the warm-up) count batch x accumulation; a local step its batch; a sync step
    the board's batches summed since the last average (``ParameterAnchor.samples``), or since it joined if later."""
    sync = SyncSchedule(every=3, warmup=2, total_steps=100)  # 0, 1 exact; 2, 3 local, 4 sync; 5, 6 local, 7 sync; ...
    schedule = SplitSchedule([8, 24], [BatchSplit(from_step=6, batch_sizes=(16, 16))])
    mode = select_mode(GradientReducer(10, wire_dtype="float32"), schedule, sync=sync)
    assert isinstance(mode, PeriodicAveraging)
    assert [sync.kind(s) for s in range(8)] == ["exact", "exact", "local", "local", "sync", "local", "local", "sync"]
    b0, b1 = _mode_boards([8, 24])
    assert (mode.expected_n(b0, 0), mode.expected_n(b1, 1)) == (8, 24)
    assert (mode.expected_n(b0, 2), mode.expected_n(b1, 3)) == (8, 24)
    assert (mode.expected_n(b0, 4), mode.expected_n(b1, 4)) == (3 * 8, 3 * 24)  # steps 2, 3, 4
    assert (mode.expected_n(b0, 6), mode.expected_n(b1, 6)) == (16, 16)          # a local step after the re-split
    assert (mode.expected_n(b0, 7), mode.expected_n(b1, 7)) == (8 + 16 + 16, 24 + 16 + 16)  # steps 5, 6 (re-split), 7
    b1.joined_step = 6  # joined mid-period: its anchor is taken at its first local step
    assert mode.expected_n(b1, 7) == 16 + 16
    b1.joined_step = 7  # joined at the sync step itself
    assert mode.expected_n(b1, 7) == 16
    b1.joined_step = 0
    assert mode.expected_n(b1, 7) == 24 + 16 + 16
