"""A real coordinator-side exchange in its own process, for the fault tests (run by path, not collected).

It serves one job on 127.0.0.1 and reports on stdout, one JSON object a line:
``{"port": p}`` once listening, ``{"gathering": s, "deadline_s": d}`` once step s waits for gradients (its
deadline of d seconds running), ``{"split_from": s}`` when ``--split`` was announced (from step s),
``{"step": s, "contributors": [...], "late": [...], "refused": {...}, "loss": l, "n_total": n, "batch_sizes": {...}}``
after each step, and
last ``{"done": true, "flags": {...}, "peak_rss_kb": k}`` or ``{"error": "..."}`` (exit code 1). Its log
goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.coordinator.exchange.server import ExchangeError, ExchangeServer
from edgefleet.protocol.codec import encode_value

JOB, TOKEN = "job", "secret"


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def _serve(args: argparse.Namespace) -> None:
    boards = [(item.split(":")[0], int(item.split(":")[1])) for item in args.boards.split(",")]
    model = {"w": np.zeros(args.welcome_bytes // 4, np.float32)}
    extra: dict[str, Any] = {"hello_timeout_s": args.hello_timeout} if args.hello_timeout is not None else {}
    if args.accumulate != 1:
        extra["accumulate_grad_batches"] = args.accumulate
    server = ExchangeServer(job_id=JOB, token=TOKEN, boards=boards, param_count=args.param_count, wire_dtype="float32",
                            welcome_state=lambda: (0, encode_value(model), encode_value({})), **extra)
    port = await server.start("127.0.0.1", 0)
    _say(port=port)
    try:
        await server.wait_for_boards(args.join_timeout, need={b for b, _ in boards})
        for step in range(args.steps):
            server.finished = step == args.steps - 1  # boards close their connection once they have the last result
            minimum_s = args.min_deadline
            if step == args.short_step:  # as if the recent steps were instant: the deadline is the short one
                server._recent_s.clear()
                server._recent_s.extend([0.001] * 3)
                minimum_s = args.short_deadline
            if step == args.split_at:  # travels with this step's result
                _say(split_from=server.announce_split([int(b) for b in args.split.split(",")]))
            deadline_s = server.deadline_for_next_step(minimum_s)  # what run_step gives this step
            task = asyncio.ensure_future(server.run_step(step, apply=lambda g, r: None, minimum_deadline_s=minimum_s))
            await asyncio.sleep(0)  # the step's first turn: it takes the boundary, opens and starts its deadline
            if not task.done():
                _say(gathering=step, deadline_s=deadline_s)
            result = await task
            _say(step=step, contributors=result.contributors, late=result.late, refused=result.refused,
                 loss=result.loss, n_total=result.n_total, batch_sizes=result.batch_sizes)
        flags = server.flags()
    finally:
        await server.close()
    _say(done=True, flags=flags, peak_rss_kb=_peak_rss_kb())


def _peak_rss_kb() -> int:
    """This program's peak resident memory (VmHWM: unlike ru_maxrss, not the forking parent's before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boards", default="b0:8,b1:16,b2:24")
    parser.add_argument("--param-count", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-deadline", type=float, default=10.0)
    parser.add_argument("--short-step", type=int, default=-1, help="the step that gets --short-deadline")
    parser.add_argument("--short-deadline", type=float, default=1.0)
    parser.add_argument("--hello-timeout", type=float, default=None)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--welcome-bytes", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1, help="the job's accumulate_grad_batches")
    parser.add_argument("--split-at", type=int, default=-1, help="announce --split before this step")
    parser.add_argument("--split", default="", help="the re-split's batch sizes, by board index")
    parser.add_argument("--nofile", type=int, default=0, help="lower the soft RLIMIT_NOFILE to this")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    try:
        asyncio.run(_serve(args))
    except ExchangeError as exc:
        _say(error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
