"""Allocate and touch memory in steps until told bytes are reached (or the kernel kills us).

Why touch every page: ``bytearray(n)`` and ``bytes(n)`` come from calloc and cost no memory until
written; only pages actually written count against the board's memory.limit_in_bytes.

    python memory_hog.py --bytes 3GiB-in-bytes [--step 33554432]

Prints ``holding N`` after each step, and ``reached N`` if it got there alive.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--step", type=int, default=32 * 1024 * 1024)
    parser.add_argument("--hold-seconds", type=float, default=30.0, help="keep the memory this long once reached")
    args = parser.parse_args(argv)
    held = []
    total = 0
    while total < args.bytes:
        held.append(b"\x5a" * args.step)  # malloc + memset: every page is written
        total += args.step
        print(f"holding {total}", flush=True)
    print(f"reached {total}", flush=True)
    time.sleep(args.hold_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
