"""A CPU-bound loop for a fixed time, in N processes, to check a board's CPU quota.

Why processes, not threads: CPython's threads share one interpreter lock and would never use more
than one core, so a board with a quota above 1.0 would look throttled when it is not.

    python busy_loop.py --seconds 4 [--workers 1]

Prints ``started`` once every worker runs, then ``done`` when they finish.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time


def spin(seconds: float, ready: multiprocessing.synchronize.Event) -> None:
    ready.set()
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(args.workers)]
    workers = [ctx.Process(target=spin, args=(args.seconds, e)) for e in events]
    for w in workers:
        w.start()
    for e in events:
        e.wait(timeout=args.seconds + 30)
    print("started", flush=True)
    for w in workers:
        w.join()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
