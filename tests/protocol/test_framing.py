from __future__ import annotations

import asyncio
import socket
import struct
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgefleet.protocol._msgpack_view as msgpack_view
from edgefleet.protocol._msgpack_view import ZERO_COPY_MIN_BYTES
from edgefleet.protocol.codec import decode_array, decode_value, encode_array, encode_value
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.framing import FRAME_ALIGN, MAX_FRAME_BYTES, decode_frame, encode_frame
from edgefleet.transport.frame_io import ConnectionClosed, read_frame, recv_frame, send_frame, write_frame

TIMEOUT_S = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair; every wait fails after TIMEOUT_S instead of hanging."""
    left, right = socket.socketpair()
    left.settimeout(TIMEOUT_S)
    right.settimeout(TIMEOUT_S)
    try:
        yield left, right
    finally:
        left.close()
        right.close()


def _plain(obj: Any) -> Any:
    """Memoryviews as bytes, so a decoded frame compares with msgpack.unpackb's result."""
    if isinstance(obj, memoryview):
        return obj.tobytes()
    if isinstance(obj, dict):
        return {key: _plain(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_plain(item) for item in obj]
    return obj


def _payload(message: dict[str, Any]) -> bytes:
    return b"".join(bytes(segment) for segment in encode_frame(message))[4:]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _gradients(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)


def _sender(sock: socket.socket, messages: list[dict[str, Any]]) -> threading.Thread:
    """Send ``messages`` from a thread: big frames do not fit in the socket buffer."""
    thread = threading.Thread(target=lambda: [send_frame(sock, m) for m in messages], daemon=True)
    thread.start()
    return thread


# --- the encoding is plain msgpack ----------------------------------------------------------------

BIG_BINS = st.builds(lambda n, seed: np.random.default_rng(seed).bytes(n),
                     st.integers(64 * 1024 - 2, 70_000), st.integers(0, 2**32 - 1))
LEAVES = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
          | st.text(max_size=10) | st.binary(max_size=300) | BIG_BINS)
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
MESSAGES = st.builds(lambda kind, body: {"type": kind, **body},
                     st.text(max_size=8), st.dictionaries(st.text(max_size=6).filter(lambda k: k not in ("type", "_align")), VALUES,
                                                          max_size=4))


def _first_big_bin(obj: Any) -> bytes | None:
    """The first bin of ZERO_COPY_MIN_BYTES or more in packing order."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            found = _first_big_bin(item)
            if found is not None:
                return found
    if isinstance(obj, bytes) and len(obj) >= ZERO_COPY_MIN_BYTES:
        return obj
    return None


@settings(deadline=None, max_examples=60)
@given(MESSAGES)
def test_frame_is_a_length_header_and_exactly_msgpack_packb(message: dict[str, Any]) -> None:
    """msgpack.packb of the message, with a first padding entry when it holds a large bin."""
    joined = b"".join(bytes(s) for s in encode_frame(message))
    payload = joined[4:]
    assert joined[:4] == struct.pack(">I", len(payload))
    big = _first_big_bin(message)
    if big is None:
        assert payload == msgpack.packb(message, use_bin_type=True)
    else:
        pad = msgpack.unpackb(payload)["_align"]
        assert payload == msgpack.packb({"_align": pad, **message}, use_bin_type=True)
        assert len(pad) < FRAME_ALIGN and set(pad) <= {0}
        assert payload.index(big) % FRAME_ALIGN == 0
    assert msgpack.packb(_plain(decode_frame(payload))) == msgpack.packb(message)  # bytes compare: NaN equals itself


def test_large_bins_are_sent_from_and_received_into_place_without_copies() -> None:
    array = _gradients(0, 1 << 20)
    segments = encode_frame({"type": "grad", "w": encode_array(array)})
    assert any(isinstance(s, memoryview) and np.shares_memory(np.frombuffer(s, np.uint8), array) for s in segments)
    payload = bytearray(b"".join(bytes(s) for s in segments)[4:])
    decoded = decode_array(decode_frame(payload)["w"], max_elements=1 << 20)
    assert np.shares_memory(decoded, np.frombuffer(payload, np.uint8))
    assert np.array_equal(decoded, array)


@pytest.mark.parametrize("shape", [(61_706,), (1_150_000,), (3, 40_000), (17_000, 3)])
@pytest.mark.parametrize("extra", [{}, {"step": 1 << 40, "loss": 0.5}, {f"k{i}": i for i in range(16)}])
def test_a_large_tensor_received_into_a_buffer_is_an_aligned_array(shape: tuple[int, ...], extra: dict[str, Any]) -> None:
    """Misaligned float32 made numpy's dot 30-50x slower: the frame pads so the data lands aligned."""
    array = np.ones(shape, dtype=np.float32)
    payload = bytearray(b"".join(bytes(s) for s in encode_frame({"type": "grad", **extra, "g": encode_array(array)}))[4:])
    frame = decode_frame(payload)
    decoded = decode_array(frame["g"], max_elements=array.size)
    assert decoded.flags.aligned and decoded.ctypes.data % FRAME_ALIGN == 0
    assert "_align" not in frame and set(frame) == {"type", "g", *extra}


def _walker(payload: bytes) -> Any:
    """What the general decoder (no fast path) makes of a payload, or the DecodeError it raises."""
    try:
        obj, end = msgpack_view._Reader(memoryview(payload).toreadonly()).read(0, 0)
    except DecodeError as exc:
        return type(exc)
    return obj if end == len(payload) else DecodeError


def _decoded(payload: bytes) -> Any:
    try:
        return decode_frame(payload)
    except DecodeError as exc:
        return type(exc)


def _tail(start: int, total: int) -> bytes:
    """A bin32 header whose data would start at ``start`` (aligned) and run to ``total``: a decoy."""
    return b"\xc6" + struct.pack(">I", total - start)


def test_a_tensor_at_the_end_decodes_exactly_what_the_walker_does() -> None:
    """Aligned or not, and with fake bin headers hidden in other bins: decode_frame says what msgpack says."""
    big = np.arange(20_000, dtype=np.float32).tobytes()  # 80 kB
    aligned = b"".join(bytes(s) for s in encode_frame({"type": "avg", "step": 7, "g": {"data": big}}))[4:]
    unaligned = msgpack.packb({"type": "avg", "step": 7, "g": {"data": big}})  # an older sender: no padding
    assert _decoded(aligned) == _decoded(unaligned) == {"type": "avg", "step": 7, "g": {"data": memoryview(big)}}
    assert isinstance(_decoded(aligned)["g"]["data"], memoryview)
    # A fake bin header inside a bin that runs to the end: the outer bin wins, as msgpack says.
    head = b"\x82\xa4type\xa4grad\xa1s\xc6"
    total = len(head) + 4 + 70_000
    body = bytearray(70_000)
    body[48 - 5 - len(head) - 4:48 - len(head) - 4] = _tail(48, total)
    swallowed = head + struct.pack(">I", 70_000) + bytes(body)
    assert _decoded(swallowed) == _walker(swallowed) == {"type": "grad", "s": bytes(body)}
    # Inside a str the fake header is invalid UTF-8: both decoders refuse it.
    as_text = head[:-1] + b"\xdb" + swallowed[len(head):]
    assert _decoded(as_text) is DecodeError and _walker(as_text) is DecodeError
    # A bin that would swallow the stand-in (ending 13 bytes after the fake header), then more entries.
    head = b"\x83\xa4type\xa4grad\xa1s\xc4"
    length = 48 + 13 - len(head) - 1
    body = bytearray(b"y" * length)
    rest = b"\xa1d\xc6" + struct.pack(">I", 70_000) + bytes(70_000)
    total = len(head) + 1 + length + len(rest)
    body[length - 18:length - 13] = _tail(48, total)
    tricky = head + bytes((length,)) + bytes(body) + rest
    assert len(tricky) == total and _decoded(tricky) == _walker(tricky)
    assert _decoded(tricky)["s"] == bytes(body) and _decoded(tricky)["d"] == bytes(70_000)
    # The same bin as the last value: the input has bytes the map does not hold, for both decoders.
    body[length - 18:length - 13] = _tail(48, len(head) + 1 + length + 70_000)
    tricky_last = b"\x82" + head[1:] + bytes((length,)) + bytes(body) + bytes(70_000)
    assert _decoded(tricky_last) is DecodeError and _walker(tricky_last) is DecodeError


def test_the_padding_key_is_reserved() -> None:
    with pytest.raises(ValueError, match="_align"):
        encode_frame({"type": "grad", "_align": b""})


@given(st.binary(max_size=200))
def test_garbage_payload_decodes_as_msgpack_would_or_raises_decode_error(payload: bytes) -> None:
    try:
        message = decode_frame(payload)
    except DecodeError:
        return
    assert msgpack.packb(_plain(message)) == msgpack.packb(msgpack.unpackb(payload))


@settings(deadline=None)
@given(MESSAGES, st.data())
def test_every_truncation_of_a_frame_raises_decode_error(message: dict[str, Any], data: st.DataObject) -> None:
    payload = _payload(message)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(DecodeError):
        decode_frame(payload[:cut])


@pytest.mark.parametrize("payload, fragment", [
    (msgpack.packb([1, 2]), "must hold a map, not list"),
    (msgpack.packb({"kind": "grad"}), "no str 'type' key"),
    (msgpack.packb({"type": 7}), "no str 'type' key"),
    (msgpack.packb({"type": "x"}) + b"\x00", "1 extra bytes"),
    (msgpack.packb({"type": "x", 1: 2}, strict_types=False), "not str"),
    (msgpack.packb({"type": "x", "t": msgpack.Timestamp(1)}), "ext type"),
    (msgpack.packb({"type": "x", "e": msgpack.ExtType(3, b"")}), "ext type"),
    (b"\x82\xa4type\xa1x\xa4type\xa1y", "appears twice"),
    (b"\xc1", "not a msgpack type"),
    (b"\xdd\xff\xff\xff\xff", "exceeds the limit"),
    (b"\xdc\x00\x10\x01", "cannot fit"),
    (b"\x81\xa4type" + b"\x91" * 40 + b"\xc0", "deeper than 32"),
    (b"\x81\xa4type\xa2\xff\xfe", "not UTF-8"),
])
def test_malformed_frames_raise_decode_error_naming_the_problem(payload: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        decode_frame(payload)
    assert fragment in str(excinfo.value)


@pytest.mark.parametrize("message, fragment", [
    ([1], "str 'type'"),
    ({"kind": "x"}, "str 'type'"),
    ({"type": "x", 3: "y"}, "keys must be str"),
    ({"type": "x", "deep": _nested(40)}, "deeper than 32"),
])
def test_encode_frame_refuses_what_the_peer_would_reject(message: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        encode_frame(message)


def test_constants() -> None:
    assert MAX_FRAME_BYTES == 1 << 30


# --- sync sockets ---------------------------------------------------------------------------------


def test_frame_round_trip_over_a_socketpair(pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    message = {"type": "hello", "version": 1, "board": "pi-1", "token": b"\x01" * 16}
    sent = send_frame(left, message)
    assert recv_frame(right) == message
    assert sent == 4 + len(msgpack.packb(message))


def test_40_mb_frames_reuse_the_buffer_and_never_overwrite_live_arrays(
        pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    arrays = [_gradients(seed, 40_000_000) for seed in range(3)]
    thread = _sender(left, [{"type": "grad", "step": i, "w": encode_array(a)} for i, a in enumerate(arrays)])
    buffer = bytearray()
    in_buffer = lambda a: np.shares_memory(a, np.frombuffer(buffer, np.uint8))  # noqa: E731

    first = decode_array(recv_frame(right, buffer=buffer)["w"], max_elements=10_000_000)
    assert np.array_equal(first, arrays[0]) and in_buffer(first)
    size_after_first = len(buffer)
    del first  # consumed: the next frame may reuse the buffer

    second = decode_array(recv_frame(right, buffer=buffer)["w"], max_elements=10_000_000)
    assert in_buffer(second) and len(buffer) == size_after_first
    third = decode_array(recv_frame(right, buffer=buffer)["w"], max_elements=10_000_000)  # second still alive
    thread.join(TIMEOUT_S)

    assert np.array_equal(second, arrays[1]) and np.array_equal(third, arrays[2])
    assert not in_buffer(third)


def test_many_out_of_band_segments_go_out_in_iov_max_batches(
        pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(msgpack_view, "ZERO_COPY_MIN_BYTES", 8)
    left, right = pair
    message = {"type": "many", "bins": [bytes([i % 256]) * (8 + i % 5) for i in range(3000)]}
    assert len(encode_frame(message)) > 3 * 1024
    thread = _sender(left, [message])
    received = recv_frame(right)
    thread.join(TIMEOUT_S)
    assert _plain(received) == message


class _SocketWithoutSendmsg:
    """A real socket seen through an object that lacks sendmsg, or refuses it like ssl.SSLSocket."""

    def __init__(self, sock: socket.socket, *, refuse: bool) -> None:
        self._sock = sock
        if refuse:
            self.sendmsg = self._refuse

    def _refuse(self, *_: Any) -> int:
        raise NotImplementedError("sendmsg not allowed on instances of SSLSocket")

    def sendall(self, data: Any) -> None:
        self._sock.sendall(data)


@pytest.mark.parametrize("refuse", [False, True], ids=["no-sendmsg", "sendmsg-refused"])
def test_sockets_without_sendmsg_fall_back_to_sendall(pair: tuple[socket.socket, socket.socket], refuse: bool) -> None:
    left, right = pair
    array = _gradients(4, 1 << 20)
    thread = threading.Thread(target=send_frame, args=(_SocketWithoutSendmsg(left, refuse=refuse),
                                                        {"type": "grad", "w": encode_array(array)}))
    thread.start()
    received = decode_array(recv_frame(right)["w"], max_elements=1 << 20)
    thread.join(TIMEOUT_S)
    assert np.array_equal(received, array)


def test_model_state_travels_as_a_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    exp_avg = _gradients(5, 400_000)
    state = {"state": {0: {"step": np.float32(3), "exp_avg": exp_avg}},
             "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]}
    thread = _sender(left, [{"type": "checkpoint", "state": encode_value(state)}])
    received = decode_value(recv_frame(right)["state"])
    thread.join(TIMEOUT_S)
    assert np.array_equal(received["state"][0]["exp_avg"], exp_avg)
    assert received["state"][0]["step"].dtype == np.float32
    assert received["param_groups"] == [{"lr": 0.01, "betas": [0.9, 0.999], "params": [0]}]


def test_clean_close_between_frames_is_connection_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    send_frame(left, {"type": "bye"})
    left.shutdown(socket.SHUT_WR)
    assert recv_frame(right) == {"type": "bye"}
    with pytest.raises(ConnectionClosed):
        recv_frame(right)


@pytest.mark.parametrize("raw, fragment", [
    (b"\x00\x00", "truncated frame header: 2 of 4 bytes"),
    (struct.pack(">I", 100) + b"\x80" * 10, "truncated frame: 10 of 100 bytes"),
    (struct.pack(">I", 0), "empty frame"),
])
def test_eof_mid_frame_is_a_truncation_error(pair: tuple[socket.socket, socket.socket], raw: bytes,
                                             fragment: str) -> None:
    left, right = pair
    left.sendall(raw)
    left.shutdown(socket.SHUT_WR)
    with pytest.raises(DecodeError, match=fragment):
        recv_frame(right)


@pytest.mark.parametrize("announced, max_bytes", [(2 << 30, MAX_FRAME_BYTES), (1001, 1000)])
def test_oversized_length_is_refused_before_allocating_or_reading(
        pair: tuple[socket.socket, socket.socket], announced: int, max_bytes: int) -> None:
    left, right = pair
    left.sendall(struct.pack(">I", announced))  # and no payload: reading on would time out
    buffer = bytearray()
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match=f"announces {announced} bytes, over the limit of {max_bytes}"):
            recv_frame(right, max_bytes=max_bytes, buffer=buffer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 and len(buffer) == 0


def test_send_refuses_a_frame_over_max_bytes(pair: tuple[socket.socket, socket.socket]) -> None:
    with pytest.raises(ValueError, match="exceeds max_bytes=100"):
        send_frame(pair[0], {"type": "x", "blob": bytes(200)}, max_bytes=100)


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_garbage_stream_ends_in_connection_closed_or_decode_error(raw: bytes) -> None:
    left, right = socket.socketpair()
    right.settimeout(TIMEOUT_S)
    with left, right:
        left.sendall(raw)
        left.shutdown(socket.SHUT_WR)
        with pytest.raises((ConnectionClosed, DecodeError)):
            while True:
                assert isinstance(recv_frame(right, max_bytes=1 << 20)["type"], str)


# --- asyncio --------------------------------------------------------------------------------------


async def _serve(handler: Any) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_async_frames_round_trip_over_a_tcp_server() -> None:
    async def main() -> tuple[list[np.ndarray], Exception]:
        server_ended: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def double(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    message = await read_frame(reader)
                    w = decode_array(message["w"], max_elements=1 << 22)
                    write_frame(writer, {"type": "doubled", "step": message["step"], "w": encode_array(w * 2)})
                    await writer.drain()
            except Exception as exc:
                server_ended.set_result(exc)
            finally:
                writer.close()

        server, port = await _serve(double)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            results = []
            for step in range(3):
                write_frame(writer, {"type": "grad", "step": step, "w": encode_array(_gradients(step, 8_000_000))})
                await writer.drain()
                reply = await asyncio.wait_for(read_frame(reader), TIMEOUT_S)
                assert reply["type"] == "doubled" and reply["step"] == step
                results.append(decode_array(reply["w"], max_elements=1 << 22))
            writer.close()
            await writer.wait_closed()
            return results, await asyncio.wait_for(server_ended, TIMEOUT_S)

    results, server_end = asyncio.run(main())
    for step, result in enumerate(results):
        assert np.array_equal(result, _gradients(step, 8_000_000) * 2)
    assert isinstance(server_end, ConnectionClosed)


@pytest.mark.parametrize("raw, error, fragment", [
    (b"", ConnectionClosed, "closed"),
    (b"\x00", DecodeError, "truncated frame header: 1 of 4"),
    (struct.pack(">I", 50) + b"\x81", DecodeError, "truncated frame: 1 of 50"),
    (struct.pack(">I", 2 << 30), DecodeError, "over the limit"),
    (struct.pack(">I", 4) + b"\x93\x01\x02\x03", DecodeError, "not list"),
])
def test_async_reader_reports_bad_streams(raw: bytes, error: type[Exception], fragment: str) -> None:
    async def main() -> Exception:
        raised: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await read_frame(reader)
            except Exception as exc:
                raised.set_result(exc)
            finally:
                writer.close()

        server, port = await _serve(record)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            await writer.drain()
            if not raw.startswith(struct.pack(">I", 2 << 30)):
                writer.close()  # the oversized case must fail while the connection is still open
            try:
                return await asyncio.wait_for(raised, TIMEOUT_S)
            finally:
                writer.close()

    exc = asyncio.run(main())
    assert isinstance(exc, error) and fragment in str(exc)
