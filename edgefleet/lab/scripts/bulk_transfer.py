"""A bulk TCP transfer, bounded in bytes and time, measured by the receiving side.

Why its own script: the lab measures a board's link with the same kind of process a board runs
(started inside the namespace and cgroups), and the measurement must skip TCP slow start and the
token bucket's initial burst, which only the receiver sees precisely.

    python bulk_transfer.py listen --bind ADDR --role send|recv [--warmup-bytes N] [--seconds S] [--max-bytes N]
    python bulk_transfer.py connect --to ADDR:PORT --role send|recv [...]

The listening side prints ``listening PORT`` once it accepts connections. The receiving side
prints one JSON line: ``{"bytes": N, "seconds": S, "bits_per_s": R, "warmup_bytes": W}``, where
N and S are counted after the first W bytes. The sender stops when the receiver closes, after
``--max-bytes`` or after ``--max-seconds``, whichever comes first.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 256 * 1024


def send(sock: socket.socket, *, max_bytes: int, max_seconds: float) -> None:
    payload = b"\xa5" * CHUNK
    sent = 0
    deadline = time.monotonic() + max_seconds
    try:
        while sent < max_bytes and time.monotonic() < deadline:
            sent += sock.send(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the receiver has what it needs and closed


def receive(sock: socket.socket, *, warmup_bytes: int, seconds: float, max_seconds: float) -> dict[str, float]:
    got = 0
    started = time.monotonic()
    t0 = None
    counted = 0
    buf = bytearray(CHUNK)
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            break
        now = time.monotonic()
        got += n
        if t0 is None:
            if got >= warmup_bytes:
                t0 = now
        else:
            counted += n
            if now - t0 >= seconds:
                break
        if now - started > max_seconds:
            break
    elapsed = (time.monotonic() - t0) if t0 is not None else 0.0
    return {"bytes": counted, "seconds": round(elapsed, 4), "warmup_bytes": warmup_bytes,
            "bits_per_s": round(counted * 8 / elapsed, 1) if elapsed > 0 else 0.0}


def run(sock: socket.socket, args: argparse.Namespace) -> None:
    if args.role == "send":
        send(sock, max_bytes=args.max_bytes, max_seconds=args.max_seconds)
    else:
        print(json.dumps(receive(sock, warmup_bytes=args.warmup_bytes, seconds=args.seconds,
                                 max_seconds=args.max_seconds)), flush=True)
    sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("listen", "connect"))
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--to", default="")
    parser.add_argument("--role", choices=("send", "recv"), required=True)
    parser.add_argument("--warmup-bytes", type=int, default=512 * 1024)
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring window after the warm-up")
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.mode == "listen":
        with socket.create_server((args.bind, 0)) as server:
            server.settimeout(args.max_seconds)
            print(f"listening {server.getsockname()[1]}", flush=True)
            conn, _ = server.accept()
            conn.settimeout(args.max_seconds)
            run(conn, args)
    else:
        host, _, port = args.to.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=args.max_seconds)
        run(sock, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
