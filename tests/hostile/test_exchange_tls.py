"""The exchange over TLS with per-board credentials: real sockets, real board clients on threads, a recording relay.

Issue 23 item 4: the per-job token travelled in clear inside the signed command (anyone reading the
broker could join as any board) and gradients travelled in clear on the LAN.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from edgefleet.agent.worker_exchange import ExchangeClient, ExchangeRefused
from edgefleet.coordinator.exchange.server import ExchangeServer
from edgefleet.protocol.codec import encode_value
from edgefleet.protocol.exchange_auth import HelloChecker, HelloProver
from edgefleet.protocol.signing import ed25519_public_key, generate_ed25519_seed
from edgefleet.transport.exchange_tls import make_job_certificate

P = 4096
BOARDS = [("b0", 8), ("b1", 24)]
SEEDS = {board: generate_ed25519_seed() for board, _ in BOARDS}
CERT = make_job_certificate("job")


def _checker(*, hmac_key: bytes | None = None, keys_for: tuple[str, ...] = ("b0", "b1"), sha256: str = CERT.sha256) -> HelloChecker:
    return HelloChecker(board_keys={b: (ed25519_public_key(SEEDS[b]),) for b in keys_for}, hmac_key=hmac_key, tls_sha256=sha256)


def _server(checker: HelloChecker, *, tls: bool = True) -> ExchangeServer:
    return ExchangeServer(job_id="job", token="unused", boards=BOARDS, param_count=P, wire_dtype="float32",
                          welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                          tls=CERT.server_context() if tls else None, checker=checker, hello_timeout_s=3)


def _grad(board: str, step: int) -> np.ndarray:
    return np.full(P, 1000.0 + step + (0.5 if board == "b1" else 0.25), np.float32)


class Board(threading.Thread):
    """A board that joins with ``credential`` (token, proof) over TLS pinned to ``sha256`` and runs ``steps``."""

    def __init__(self, board_id: str, port: int, steps: int, *, sha256: str = CERT.sha256,
                 credential: Callable[[str], tuple[str, bytes | None]] | None = None) -> None:
        super().__init__(daemon=True)
        self.board_id, self.port, self.steps, self.sha256 = board_id, port, steps, sha256
        self.credential = credential or (lambda b: ("", HelloProver("ed25519", SEEDS[b]).prove("job", b, sha256)))
        self.results: list[np.ndarray] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            client = ExchangeClient("127.0.0.1", self.port, result_timeout_s=10, tls_sha256=self.sha256)
            token, proof = self.credential(self.board_id)
            client.hello(job_id="job", board_id=self.board_id, token=token, param_count=P, proof=proof)
            for step in range(self.steps):
                self.results.append(np.array(client.exchange(step=step, grad=_grad(self.board_id, step),
                                                             n=dict(BOARDS)[self.board_id], loss=1.0, compute_s=0.01)))
            client.close()
        except (ExchangeRefused, OSError) as exc:
            self.error = exc


class Relay(threading.Thread):
    """A TCP relay between boards and the exchange that records every byte either way (a sniffer on the LAN)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(daemon=True)
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self._lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _train(server: ExchangeServer, boards_for: Callable[[int], list[Board]], steps: int) -> tuple[list[np.ndarray], list[Board]]:
    async def main() -> tuple[list[np.ndarray], list[Board]]:
        port = await server.start("127.0.0.1", 0)
        boards = boards_for(port)
        for board in boards:
            board.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        for step in range(steps):
            await server.run_step(step, apply=lambda g, r: applied.append(g.copy()))
        await server.close()
        return applied, boards

    applied, boards = asyncio.run(main())
    for board in boards:  # the last result may still be on its way to a board (through a relay) when the server closes
        board.join(timeout=30)
    return applied, boards


def _expected(step: int) -> np.ndarray:
    return (8 * _grad("b0", step) + 24 * _grad("b1", step)) / 32


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_a_sniffer_sees_gradients_only_without_tls_and_the_mean_is_exact_either_way(tls: bool) -> None:
    sha256 = CERT.sha256 if tls else ""
    relays: list[Relay] = []

    def boards(port: int) -> list[Board]:
        relay = Relay(port)
        relay.start()
        relays.append(relay)
        return [Board(b, relay.port, 3, sha256=sha256) for b, _ in BOARDS]

    applied, boards_run = _train(_server(_checker(sha256=sha256), tls=tls), boards, 3)
    relays[0].listener.close()
    for step in range(3):
        np.testing.assert_allclose(applied[step], _expected(step), rtol=1e-7)
        for board in boards_run:
            assert board.error is None
            np.testing.assert_array_equal(board.results[step], applied[step])
    gradient_bytes = _grad("b1", 2)[:64].tobytes()  # what b1 sent at step 2, as it lies in memory
    assert (gradient_bytes in relays[0].seen) is not tls


def test_a_board_that_pins_another_certificate_refuses_the_exchange() -> None:
    impostor = make_job_certificate("job")

    async def main() -> BaseException | None:
        server = _server(_checker())
        port = await server.start("127.0.0.1", 0)
        board = Board("b0", port, 1, sha256=impostor.sha256)
        board.start()
        await asyncio.get_running_loop().run_in_executor(None, board.join, 10)
        await server.close()
        return board.error

    error = asyncio.run(main())
    assert isinstance(error, ExchangeRefused) and "impersonating the exchange" in str(error)


def _refused(credential: Callable[[str], tuple[str, bytes | None]], checker: HelloChecker) -> str:
    async def main() -> BaseException | None:
        server = _server(checker)
        port = await server.start("127.0.0.1", 0)
        board = Board("b0", port, 1, credential=credential)
        board.start()
        await asyncio.get_running_loop().run_in_executor(None, board.join, 10)
        await server.close()
        return board.error

    error = asyncio.run(main())
    assert isinstance(error, ExchangeRefused), error
    return str(error)


def test_a_proof_made_by_another_board_or_for_another_exchange_is_refused() -> None:
    b1_key = HelloProver("ed25519", SEEDS["b1"])
    other_cert = make_job_certificate("job").sha256
    cases: list[Callable[[str], tuple[str, bytes | None]]] = [
        lambda b: ("", b1_key.prove("job", "b0", CERT.sha256)),                                  # b1 posing as b0
        lambda b: ("", HelloProver("ed25519", SEEDS["b0"]).prove("job", "b0", other_cert)),     # a proof for another exchange
        lambda b: ("", HelloProver("ed25519", SEEDS["b0"]).prove("other-job", "b0", CERT.sha256)),  # for another job
        lambda b: ("a-token-read-on-the-broker", None),                                          # no proof at all
    ]
    for credential in cases:
        assert "wrong job or credential" in _refused(credential, _checker())


def test_legacy_hmac_fleets_prove_with_the_fleet_key_and_keyless_boards_get_a_token_of_their_own() -> None:
    fleet_key = bytes(range(32))
    checker = _checker(hmac_key=fleet_key, keys_for=())
    assert checker.token_for("b0") == "" and checker.proves_with_key("b0")  # nothing secret in the command

    def hmac_boards(port: int) -> list[Board]:
        return [Board(b, port, 1, credential=lambda b: ("", HelloProver("hmac", fleet_key).prove("job", b, CERT.sha256)))
                for b, _ in BOARDS]

    applied, _ = _train(_server(checker), hmac_boards, 1)
    np.testing.assert_allclose(applied[0], _expected(0), rtol=1e-7)

    keyless = _checker(keys_for=("b1",))  # Ed25519 commands; the coordinator has no public key of b0
    token = keyless.token_for("b0")
    assert token and keyless.token_for("b1") == "" and keyless.token_boards == ["b0"]
    assert keyless.token_for("b0") == token  # one token per board for the whole job

    def mixed(port: int) -> list[Board]:
        return [Board("b0", port, 1, credential=lambda b: (token, None)), Board("b1", port, 1)]

    applied, _ = _train(_server(keyless), mixed, 1)
    np.testing.assert_allclose(applied[0], _expected(0), rtol=1e-7)
    assert "wrong job or credential" in _refused(lambda b: (keyless.token_for("b1") or "guess", None), _checker(keys_for=()))


def test_a_plaintext_client_on_a_tls_exchange_is_closed_without_harm() -> None:
    async def main() -> tuple[bytes, list[np.ndarray]]:
        server = _server(_checker())
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()

        def plaintext_hello() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"\x00\x00\x00\x10" + b"\x85" * 16)
                return sock.recv(100)

        answer = await loop.run_in_executor(None, plaintext_hello)
        boards = [Board(b, port, 1) for b, _ in BOARDS]
        for board in boards:
            board.start()
        await server.wait_for_boards(10, need={b for b, _ in BOARDS})
        applied: list[np.ndarray] = []
        await server.run_step(0, apply=lambda g, r: applied.append(g.copy()))
        await server.close()
        return answer, applied

    answer, applied = asyncio.run(main())
    assert answer == b""  # closed, nothing said in clear
    np.testing.assert_allclose(applied[0], _expected(0), rtol=1e-7)


def test_large_gradients_cross_tls_intact() -> None:
    big = 3_000_000  # 12 MB each way: many TLS records, the socket buffers fill and drain
    rng = np.random.default_rng(7)
    grads = {b: rng.standard_normal(big).astype(np.float32) for b, _ in BOARDS}

    class BigBoard(Board):
        def run(self) -> None:
            try:
                client = ExchangeClient("127.0.0.1", self.port, result_timeout_s=30, tls_sha256=self.sha256)
                token, proof = self.credential(self.board_id)
                client.hello(job_id="job", board_id=self.board_id, token=token, param_count=big, proof=proof)
                for step in range(self.steps):
                    self.results.append(np.array(client.exchange(step=step, grad=grads[self.board_id] * (step + 1),
                                                                 n=dict(BOARDS)[self.board_id], loss=1.0, compute_s=0.01)))
                client.close()
            except (ExchangeRefused, OSError) as exc:
                self.error = exc

    server = ExchangeServer(job_id="job", token="unused", boards=BOARDS, param_count=big, wire_dtype="float32",
                            welcome_state=lambda: (0, encode_value({"w": np.zeros(3, np.float32)}), encode_value({})),
                            tls=CERT.server_context(), checker=_checker(), hello_timeout_s=5)
    applied, boards = _train(server, lambda port: [BigBoard(b, port, 2) for b, _ in BOARDS], 2)
    for step in range(2):
        expected = (8 * grads["b0"] * (step + 1) + 24 * grads["b1"] * (step + 1)) / 32
        np.testing.assert_allclose(applied[step], expected, rtol=1e-6, atol=1e-6)
        for board in boards:
            assert board.error is None
            np.testing.assert_array_equal(board.results[step], applied[step])

