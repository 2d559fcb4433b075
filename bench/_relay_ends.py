"""The ends of ``bench/stage_relay.py``'s transfers, run inside the lab's namespaces (standard library only).

* ``sink`` (the downstream stage host): accepts one connection, then for each round reads a frame of
  ``--bytes`` (the activations) and sends as many back (their gradients); ends when the peer closes.
* ``relay`` (the coordinator): accepts one connection, connects to ``--to`` and copies bytes both ways as they
  come, 64 KiB at a time (a relay that streams; one that stored whole frames would only add to its time).
* ``source`` (the upstream stage host): connects to ``--to`` and runs ``--rounds`` rounds, each a frame out and
  its answer back; prints ``{"rounds_s": [...]}``.

A listening end prints ``listening PORT`` first.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

CHUNK = 64 * 1024


def _listen(bind: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((bind, 0))
    server.listen(1)
    print(f"listening {server.getsockname()[1]}", flush=True)
    return server


def _connect(to: str) -> socket.socket:
    host, port = to.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=60)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _read_exactly(conn: socket.socket, n: int, buffer: memoryview) -> bool:
    """Read ``n`` bytes (into ``buffer``, reused); False when the peer closed first."""
    while n:
        got = conn.recv_into(buffer, min(n, len(buffer)))
        if not got:
            return False
        n -= got
    return True


def sink(bind: str, size: int) -> None:
    with _listen(bind) as server:
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer, frame = memoryview(bytearray(CHUNK)), bytes(size)
    with conn:
        while _read_exactly(conn, size, buffer):
            conn.sendall(frame)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    buffer = memoryview(bytearray(CHUNK))
    while got := src.recv_into(buffer):
        dst.sendall(buffer[:got])
    dst.shutdown(socket.SHUT_WR)


def relay(bind: str, to: str) -> None:
    with _listen(bind) as server:
        upstream, _ = server.accept()
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    downstream = _connect(to)
    back = threading.Thread(target=_copy, args=(downstream, upstream), daemon=True)
    back.start()
    _copy(upstream, downstream)
    back.join(timeout=60)
    upstream.close()
    downstream.close()


def source(to: str, size: int, rounds: int) -> None:
    conn = _connect(to)
    buffer, frame, times = memoryview(bytearray(CHUNK)), bytes(size), []
    with conn:
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(frame)
            if not _read_exactly(conn, size, buffer):
                sys.exit("the far end closed before answering")
            times.append(time.perf_counter() - start)
    print(json.dumps({"rounds_s": times}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("sink", "relay", "source"))
    parser.add_argument("--bind", default="0.0.0.0", help="address a listening end binds (sink, relay)")
    parser.add_argument("--to", help="HOST:PORT to connect to (relay, source)")
    parser.add_argument("--bytes", type=int, default=0, help="bytes of a frame each way (sink, source)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (source)")
    args = parser.parse_args()
    if args.role == "sink":
        sink(args.bind, args.bytes)
    elif args.role == "relay":
        relay(args.bind, args.to)
    else:
        source(args.to, args.bytes, args.rounds)


if __name__ == "__main__":
    main()
