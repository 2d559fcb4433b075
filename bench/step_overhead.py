"""What the gradient exchange adds to a training step: LeNet-5 on digits, 2 boards, batch 32 each.

What is measured, all with ``torch.set_num_threads(1)`` in every process:

* local plain step: one process, the model from ``workloads.registry`` (``build_model("lenet5",
  (1, 32, 32), 10, {})``, Adam) and ``build_dataset("digits", "train", {})``, a plain loop over a
  DataLoader with batches of 32: fetch the batch, forward, cross-entropy, backward, optimizer step;
* local Lightning step: the same model and batches through ``pytorch_lightning.Trainer.fit``
  (the Trainer flags the agent's worker uses);
* distributed step: the real components of a training job without MQTT. This process runs the
  coordinator's side: ``coordinator.exchange.server.ExchangeServer`` on 127.0.0.1 (asyncio) with the real
  ``coordinator.run.replica.Replica`` as ``apply`` (the coordinator's replica steps once the step's
  result is on its way to the boards, while they compute the next step, as in ``coordinator.run.training``). Two board
  processes (spawned) each run what
  ``agent.worker.run_job`` runs: ``ExchangeClient.hello``, the welcome's model and optimizer state,
  a ``BoardBatchSampler`` over a ``GlobalBatchPlan`` with batch sizes (32, 32), and
  ``Trainer.fit`` with ``agent.worker_exchange.GradientExchange`` as the callback. The client's
  ``exchange`` is timed by a thin subclass (the call itself is unchanged).

Step time is the time from one ``on_train_batch_start`` (or loop iteration, for the plain loop) to
the next, so it includes fetching the batch and the optimizer step; the figure is the median over
the ``--steps`` timed steps after ``--warmup`` untimed ones, pooled over ``--passes`` passes. The
exchange's share is (time spent in ``client.exchange``) / (wall time of the timed steps), per
board, averaged over the two boards. A distributed step processes 64 samples (32 per board), a
local step 32; samples/s is given for both.

Reference (issue): about 8 ms for the plain step and about 11 ms through Lightning on this 2-core
machine. There is no pass/fail target: the ratios to the local steps (measured in the same run)
and the exchange's share are the figures. The table comes last. Exit code 0 if the run completed,
2 if it could not be made. Bounded by ``--max-seconds``; board processes and the server are
stopped on every exit path (SIGTERM and Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import statistics
import sys
import time
from typing import Any

from _harness import BenchError, die_with_parent, quiet_lightning  # bench/ is the script's folder, first on sys.path

MODEL, DATASET, INPUT_SHAPE, CLASSES = "lenet5", "digits", (1, 32, 32), 10
BATCH = 32
BOARDS = 2
SEED = 7


def trainer_kwargs(steps: int) -> dict[str, Any]:
    """The Trainer flags of agent.worker.run_job."""
    return {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "max_steps": steps, "logger": False,
            "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "limit_val_batches": 0, "use_distributed_sampler": False}


def make_step_timer() -> Any:
    import pytorch_lightning as pl

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.compute: list[float] = []  # batch start to optimizer step: forward, backward and hooks

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.compute.append(time.perf_counter() - self.starts[-1])

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append(time.perf_counter())  # the end of the last step

    return StepTimer()


def step_times(starts: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(starts[warmup:], starts[warmup + 1:])]


# ----------------------------------------------------------------------------- local

def local_plain(steps: int, warmup: int) -> list[float]:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import BoardBatchSampler, GlobalBatchPlan

    torch.manual_seed(SEED)
    dataset = build_dataset(DATASET, "train", {})
    model = build_model(MODEL, {}, input_shape=INPUT_SHAPE, num_classes=CLASSES)
    optimizer = model.configure_optimizers()
    loader = DataLoader(dataset, batch_sampler=BoardBatchSampler(GlobalBatchPlan(len(dataset), [BATCH], SEED), 0, 0,
                                                                 warmup + steps))
    model.train()
    starts = []
    for x, y in in_loader_with_clock(loader, starts):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    starts.append(time.perf_counter())
    return step_times(starts, warmup)


def in_loader_with_clock(loader: Any, starts: list[float]) -> Any:
    """Iterate ``loader``, noting the time before each batch is fetched."""
    iterator = iter(loader)
    while True:
        starts.append(time.perf_counter())
        try:
            yield next(iterator)
        except StopIteration:
            starts.pop()
            return


def local_lightning(steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Step times, and forward + backward times measured over the span GradientExchange uses on a board."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader

    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import BoardBatchSampler, GlobalBatchPlan

    torch.manual_seed(SEED)
    dataset = build_dataset(DATASET, "train", {})
    model = build_model(MODEL, {}, input_shape=INPUT_SHAPE, num_classes=CLASSES)
    timer = make_step_timer()
    trainer = pl.Trainer(**trainer_kwargs(warmup + steps), callbacks=[timer])
    sampler = BoardBatchSampler(GlobalBatchPlan(len(dataset), [BATCH], SEED), 0, 0, warmup + steps)
    trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_sampler=sampler))
    return step_times(timer.starts, warmup), timer.compute[warmup:]


# ----------------------------------------------------------------------------- distributed: a board

def board_main(index: int, host: str, port: int, token: str, total: int, queue: Any) -> None:
    """One board: what agent.worker.run_job does once the job command arrived, minus MQTT."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    try:
        import torch

        torch.set_num_threads(1)
        quiet_lightning()
        import pytorch_lightning as pl
        from torch.utils.data import DataLoader

        from edgefleet.agent.worker_exchange import ExchangeClient, GradientExchange
        from edgefleet.protocol.codec import decode_value
        from edgefleet.workloads.lightning_api import callback_class
        from edgefleet.workloads.params import (
            param_count,
            single_optimizer,
            to_torch_tree,
            trainable_params,
        )
        from edgefleet.workloads.registry import build_dataset, build_model
        from edgefleet.workloads.sharding import BoardBatchSampler, GlobalBatchPlan

        class TimedClient(ExchangeClient):
            calls: list[tuple[float, float]]  # (start, end) of every exchange() call, CLOCK_MONOTONIC

            def exchange(self, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return super().exchange(**kwargs)
                finally:
                    self.calls.append((t0, time.perf_counter()))

        dataset = build_dataset(DATASET, "train", {})
        model = build_model(MODEL, {}, input_shape=INPUT_SHAPE, num_classes=CLASSES)
        count = param_count(trainable_params(single_optimizer(model.configure_optimizers())))
        client = TimedClient(host, port)
        client.calls = []
        compute: list[float] = []
        try:
            welcome = client.hello(job_id="bench", board_id=f"board-{index}", token=token, param_count=count)
            model.load_state_dict(to_torch_tree(decode_value(welcome.model)))
            start = welcome.step
            sampler = BoardBatchSampler(GlobalBatchPlan(len(dataset), [BATCH] * BOARDS, SEED), index, start, total)
            exchange = callback_class(pl, GradientExchange, "GradientExchange")(
                                        client, batch_size=BATCH, start_step=start, wire_dtype="float32",
                                        optimizer_state=decode_value(welcome.optimizer),
                                        on_step=lambda step, loss, compute_s: compute.append(compute_s))
            timer = make_step_timer()
            trainer = pl.Trainer(**trainer_kwargs(total), callbacks=[exchange, timer])
            trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_sampler=sampler))
        finally:
            client.close()
        queue.put((index, "ok", {"starts": timer.starts, "exchange": client.calls, "compute": compute}))
    except BaseException as exc:  # reported to the parent, which fails the run with it
        queue.put((index, "error", f"board {index}: {type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------------------- distributed: the coordinator

async def distributed(steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    import torch

    from edgefleet.coordinator.exchange.server import ExchangeServer
    from edgefleet.coordinator.run.replica import Replica
    from edgefleet.protocol.codec import encode_value
    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import GlobalBatchPlan

    total = warmup + steps
    torch.manual_seed(SEED)
    per_epoch = GlobalBatchPlan(len(build_dataset(DATASET, "train", {})), [BATCH] * BOARDS, SEED).steps_per_epoch
    replica = Replica(build_model(MODEL, {}, input_shape=INPUT_SHAPE, num_classes=CLASSES),
                      batches_per_epoch=per_epoch, total_steps=total)

    def welcome_state() -> tuple[int, Any, Any]:
        step, model_state, optimizer_state = replica.wire_state()
        return step, encode_value(model_state), encode_value(optimizer_state)

    apply_times: list[float] = []

    def apply(avg: Any, result: Any) -> None:
        t0 = time.perf_counter()
        replica.apply(avg)
        apply_times.append(time.perf_counter() - t0)

    token = secrets.token_hex(16)
    server = ExchangeServer(job_id="bench", token=token, boards=[(f"board-{i}", BATCH) for i in range(BOARDS)],
                            param_count=replica.param_count, wire_dtype="float32", welcome_state=welcome_state)
    port = await server.start("127.0.0.1", 0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=board_main, args=(i, "127.0.0.1", port, token, total, queue), daemon=True,
                         name=f"efb-board-{i}") for i in range(BOARDS)]
    replies: dict[int, Any] = {}

    def check_failures() -> None:
        while not queue.empty():
            index, status, payload = queue.get_nowait()
            if status != "ok":
                raise BenchError(payload)
            replies[index] = payload

    try:
        for p in procs:
            p.start()
        waiter = asyncio.ensure_future(server.wait_for_boards(timeout, need={f"board-{i}" for i in range(BOARDS)}))
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.2)
            try:
                check_failures()
            except BenchError:
                waiter.cancel()
                raise
        waiter.result()
        wall: list[float] = []
        for step in range(total):
            server.finished = step == total - 1  # boards close their connection after the last step
            result = await server.run_step(step, apply=apply, minimum_deadline_s=timeout)
            if len(result.contributors) != BOARDS:
                check_failures()
                raise BenchError(f"step {step}: only {result.contributors} contributed "
                                 f"(late {result.late}, refused {result.refused})")
            wall.append(result.wall_s)
        deadline = time.monotonic() + timeout
        while len(replies) < BOARDS:
            if time.monotonic() > deadline:
                raise BenchError("the boards did not report within the timeout")
            check_failures()
            await asyncio.sleep(0.05)
    finally:
        await server.close()
        replica.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
    return {"boards": [replies[i] for i in range(BOARDS)], "apply": apply_times[warmup:], "server_wall": wall[warmup:]}


# ----------------------------------------------------------------------------- report

def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def report(plain: list[float], lightning: list[float], lightning_compute: list[float], dist_runs: list[dict[str, Any]],
           args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    w = args.warmup
    steps_ms, exchange_ms, compute_ms, shares, wait_ms, round_ms, apply_s = [], [], [], [], [], [], []
    for run in dist_runs:
        apply_s += run["apply"]
        calls = []
        for board in run["boards"]:
            steps = step_times(board["starts"], w)
            mine = board["exchange"][w:w + len(steps)]
            calls.append(mine)
            steps_ms.append(median_ms(steps))
            exchange_ms.append(median_ms([b - a for a, b in mine]))
            compute_ms.append(median_ms(board["compute"][w:w + len(steps)]))
            shares.append(sum(b - a for a, b in mine) / sum(steps))
        for per_step in zip(*calls):  # perf_counter is CLOCK_MONOTONIC: comparable across the processes
            last_start = max(a for a, _b in per_step)
            wait_ms.append(statistics.mean(last_start - a for a, _b in per_step))
            round_ms.append(max(b for _a, b in per_step) - last_start)
    dist, exch, comp = statistics.mean(steps_ms), statistics.mean(exchange_ms), statistics.mean(compute_ms)
    share = statistics.mean(shares)
    wait, rnd, app = median_ms(wait_ms), median_ms(round_ms), median_ms(apply_s)
    p, lt = median_ms(plain), median_ms(lightning)
    rows = [
        ("local plain step", f"{p:.2f}", "32", f"{32e3 / p:,.0f}", "1.00x", f"{p / lt:.2f}x", ""),
        ("local Lightning step", f"{lt:.2f}", "32", f"{32e3 / lt:,.0f}", f"{lt / p:.2f}x", "1.00x", ""),
        ("  local: forward + backward", f"{median_ms(lightning_compute):.2f}", "", "", "", "", ""),
        (f"distributed step, {BOARDS} boards x 32", f"{dist:.2f}", str(BOARDS * BATCH),
         f"{BOARDS * BATCH * 1e3 / dist:,.0f}", f"{dist / p:.2f}x", f"{dist / lt:.2f}x", "100 %"),
        ("  board: forward + backward", f"{comp:.2f}", "", "", "", "", f"{100 * comp / dist:.0f} %"),
        ("  board: in client.exchange", f"{exch:.2f}", "", "", "", "", f"{100 * share:.0f} %"),
        ("    waiting for the other board", f"{wait:.2f}", "", "", "", "", f"{100 * wait / dist:.0f} %"),
        ("    round after the last board sent", f"{rnd:.2f}", "", "", "", "", f"{100 * rnd / dist:.0f} %"),
        ("  coordinator: replica apply, beside the next step", f"{app:.2f}", "", "", "", "", f"{100 * app / dist:.0f} %"),
    ]
    headers = ("measure", "ms / step", "samples / step", "samples / s", "vs local plain", "vs local Lightning",
               "share of the distributed step")
    title = (f"LeNet-5 on digits, torch.set_num_threads(1) everywhere, {os.cpu_count()} CPUs: medians over "
             f"{args.passes} x {args.steps} timed steps after {args.warmup} warm-up steps")
    caption = ("Step = one batch start to the next (fetching the batch and the optimizer step included). Distributed: the "
               "real ExchangeServer and Replica in this process, 2 boards in their own processes (Lightning + "
               "GradientExchange + ExchangeClient), 127.0.0.1; boards and coordinator share the CPUs. Exchange share = "
               "time in client.exchange / step wall time (sums over the timed steps, mean of the boards). Waiting = "
               "last board's exchange start - this board's (mean of the boards); round = last board's start of "
               "exchange to the last board having the average. The coordinator's replica applies each average after "
               "sending it, while the boards compute: on this machine it shares the CPUs with them. Forward + "
               "backward: on_train_batch_start to the optimizer step (what GradientExchange reports as compute_s), "
               "locally and on the boards: the difference is CPU contention. " + args.cpu_note)
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    print()
    Console(width=max(150, shutil.get_terminal_size().columns)).print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A distributed LeNet-5 step (2 boards x batch 32, real ExchangeServer, Replica, GradientExchange and "
                    "ExchangeClient on 127.0.0.1) against the same step in one local process (plain loop and "
                    "Lightning), and the exchange's share of the step.",
        epilog="Everything listens on 127.0.0.1 only. Exit code 0 if the run completed, 2 if it could not be made.")
    parser.add_argument("--steps", type=int, default=300, metavar="K", help="timed steps per measure and pass (default 300)")
    parser.add_argument("--warmup", type=int, default=30, metavar="W", help="untimed steps first (default 30)")
    parser.add_argument("--passes", type=int, default=2, metavar="P", help="passes over the three measures (default 2)")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="S",
                        help="bound on the boards joining and on each step (default 180 s)")
    parser.add_argument("--max-seconds", type=float, default=900.0, metavar="S",
                        help="bound on the whole run; cleans up and exits 2 past it (default 900)")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.warmup < 1 or args.passes < 1:
        parser.error("--steps must be >= 10, --warmup and --passes >= 1")
    args.cpu_note = ""
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_signal(signum: int, frame: Any) -> None:
        raise BenchError(f"stopped by signal {signum}" if signum != signal.SIGALRM
                         else f"the run exceeded --max-seconds {args.max_seconds:.0f}")

    for sig in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, on_signal)
    signal.setitimer(signal.ITIMER_REAL, args.max_seconds)
    import psutil
    import torch

    torch.set_num_threads(1)
    quiet_lightning()
    plain: list[float] = []
    lightning: list[float] = []
    lightning_compute: list[float] = []
    dist_runs: list[dict[str, Any]] = []
    try:
        t0, own0 = psutil.cpu_times(), os.times()
        for p in range(args.passes):
            plain += local_plain(args.steps, args.warmup)
            steps, compute = local_lightning(args.steps, args.warmup)
            lightning += steps
            lightning_compute += compute
            dist_runs.append(asyncio.run(distributed(args.steps, args.warmup, args.timeout)))
            print(f"pass {p + 1}/{args.passes}: plain {median_ms(plain):.2f} ms, Lightning {median_ms(lightning):.2f} ms, "
                  f"distributed {median_ms(step_times(dist_runs[-1]['boards'][0]['starts'], args.warmup)):.2f} ms",
                  file=sys.stderr, flush=True)
        t1, own1 = psutil.cpu_times(), os.times()
        delta = {k: getattr(t1, k) - getattr(t0, k) for k in t1._fields}
        everything = sum(delta.values()) or 1.0
        busy = everything - delta.get("idle", 0.0) - delta.get("iowait", 0.0) - delta.get("steal", 0.0)
        ours = sum(own1[:4]) - sum(own0[:4])  # this process and its (joined) board processes
        args.cpu_note = (f"While it ran, other processes used {100 * max(0.0, busy - ours) / everything:.0f} % of the "
                         f"{os.cpu_count()} CPUs and the hypervisor stole {100 * delta.get('steal', 0.0) / everything:.0f} %.")
    except BenchError as exc:
        print(f"step_overhead: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("step_overhead: interrupted", file=sys.stderr)
        return 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    report(plain, lightning, lightning_compute, dist_runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
