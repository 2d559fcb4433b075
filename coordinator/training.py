"""The training driver: start the job on the boards, run every step through the exchange, keep
the replica, checkpoints and metrics, and end with a result the user can read and a model file.

Ctrl-C (or SIGTERM) stops at a step boundary: the boards are told to stop, the checkpoint holds the
last applied step, and ``edge-coordinator train --resume RUN_DIR`` continues from there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.board_channel import BoardChannel
from coordinator.checkpoints import (MetricsLog, atomic_torch_save, atomic_write_json, load_checkpoint,
                                     save_checkpoint)
from coordinator.exchange import ExchangeError, ExchangeServer, StepResult
from coordinator.replica import Replica
from protocol.codec import encode_value
from protocol.errors import ConfigError, EdgeTrainError
from protocol.jobs import StopCommand, TrainCommand
from protocol.settings import BrokerSettings

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 180.0  # a Raspberry Pi needs tens of seconds to import torch and Lightning


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Everything that defines a run; saved as ``config.json`` and reused by ``--resume``."""

    run_id: str
    boards: list[str]
    batch_sizes: list[int]
    model: str
    dataset: str
    total_steps: int
    steps_per_epoch: int
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    lr: float | None = None
    wire_dtype: str = "float32"
    data_mode: str = "global"
    threads: int = 0
    checkpoint_every: int = 50
    step_timeout_s: float = 10.0
    exchange_host: str = ""
    exchange_port: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"config.json has unknown keys {sorted(unknown)}: written by a newer edgefleet?")
        return cls(**data)


@dataclass
class StepView:
    """What the progress display shows after each step."""

    step: int
    total_steps: int
    loss: float | None
    val_accuracy: float | None
    samples_per_s: float
    board_compute_s: dict[str, float]
    late: list[str]
    refused: dict[str, str]


@dataclass
class TrainOutcome:
    run_dir: Path
    result: dict[str, Any]
    interrupted: bool


def exchange_host_for(broker: BrokerSettings) -> str:
    """The local address that reaches the broker; boards on the broker's network reach it too."""
    if broker.host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((broker.host, broker.port))  # UDP connect sends nothing; it picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "0.0.0.0"


class TrainingRun:
    """One run, fresh or resumed."""

    def __init__(self, spec: TrainSpec, *, run_dir: Path, broker: BrokerSettings, fleet_key: bytes,
                 on_step: Callable[[StepView], None], on_note: Callable[[str], None], resume: bool = False) -> None:
        from workloads.registry import build_dataset, build_model

        self.spec, self.run_dir, self.broker, self.fleet_key = spec, run_dir, broker, fleet_key
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.on_step, self.on_note = on_step, on_note
        self.train_set = build_dataset(spec.dataset, "train", spec.dataset_options)
        self.val_set = build_dataset(spec.dataset, "val", spec.dataset_options)
        options = dict(spec.model_options) | ({"lr": spec.lr} if spec.lr is not None else {})
        torch.manual_seed(spec.seed)  # the replica's initial weights; boards receive them, never re-draw them
        model = build_model(spec.model, tuple(self.train_set.input_shape), int(self.train_set.num_classes), options)  # type: ignore[attr-defined]
        self.replica = Replica(model)
        self.history: list[dict[str, Any]] = []
        self.val_accuracy: float | None = None
        self.val_loss: float | None = None
        self.elapsed_before_s = 0.0
        if resume:
            state = load_checkpoint(run_dir)
            self.replica.load_state_dict(state["replica"])
            torch.set_rng_state(state["torch_rng"])
            self.val_accuracy, self.val_loss = state.get("val_accuracy"), state.get("val_loss")
            self.elapsed_before_s = float(state.get("elapsed_s", 0.0))
            MetricsLog.truncate_after(run_dir / "metrics.jsonl", self.replica.step)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / "config.json", spec.to_json())
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self._stop = asyncio.Event()
        self.flags: dict[str, list[str]] = {}

    def request_stop(self) -> None:
        self._stop.set()

    def _checkpoint(self, elapsed_s: float) -> None:
        save_checkpoint(self.run_dir, {"replica": self.replica.state_dict(), "torch_rng": torch.get_rng_state(),
                                       "val_accuracy": self.val_accuracy, "val_loss": self.val_loss,
                                       "elapsed_s": elapsed_s})

    def _welcome_state(self) -> tuple[int, Any, Any]:
        step, model_state, optimizer_state = self.replica.wire_state()
        return step, encode_value(model_state), encode_value(optimizer_state)

    def _commands(self, host: str, port: int, token: str) -> dict[str, dict[str, Any]]:
        s = self.spec
        return {board: TrainCommand(job_id=s.run_id, board_id=board, exchange_host=host, exchange_port=port, token=token,
                                    model=s.model, model_options=s.model_options, dataset=s.dataset,
                                    dataset_options=s.dataset_options, board_index=i, batch_sizes=s.batch_sizes,
                                    seed=s.seed, total_steps=s.total_steps, data_mode=s.data_mode, lr=s.lr,
                                    wire_dtype=s.wire_dtype, threads=s.threads).to_dict()
                for i, board in enumerate(s.boards)}

    async def run(self) -> TrainOutcome:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        channel = BoardChannel(self.broker, self.fleet_key, self.spec.boards)
        token = secrets.token_hex(16)  # shown only to the boards, inside signed commands
        exchange = ExchangeServer(job_id=self.spec.run_id, token=token,
                                  boards=list(zip(self.spec.boards, self.spec.batch_sizes)),
                                  param_count=self.replica.param_count, wire_dtype=self.spec.wire_dtype,
                                  welcome_state=self._welcome_state)
        await channel.open()
        try:
            await self._check_boards(channel)
            host = self.spec.exchange_host or exchange_host_for(self.broker)
            port = await exchange.start(host, self.spec.exchange_port)
            advertised = "127.0.0.1" if host == "0.0.0.0" else host
            for board, command in self._commands(advertised, port, token).items():
                channel.send(board, command)
            self.on_note(f"job {self.spec.run_id}: exchange on {advertised}:{port}; waiting for {len(self.spec.boards)} boards")
            await self._join(channel, exchange)
            return await self._steps(channel, exchange)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await exchange.close("job finished" if not self._stop.is_set() else "stopped by the coordinator")
            for board in self.spec.boards:
                channel.send(board, StopCommand(job_id=self.spec.run_id, board_id=board).to_dict(), wait_s=1.0)
            channel.close()
            self.metrics.close()

    async def _check_boards(self, channel: BoardChannel) -> None:
        await channel.wait_for_status()
        problems = []
        for board in self.spec.boards:
            status = channel.status.get(board)
            if status is None:
                problems.append(f"board {board} has never reported on this broker (is its agent running with this board id?)")
            elif status.state == "offline":
                problems.append(f"board {board} is offline ({status.reason or 'unknown reason'}); start its agent or leave it out of --boards")
            elif status.state == "busy":
                problems.append(f"board {board} is busy with another job; wait for it or leave it out of --boards")
            caps = channel.caps.get(board)
            if caps is not None and not caps.training_available:
                problems.append(f"board {board} has no torch/Lightning: pip install 'edgefleet[train]' there")
        if problems:
            raise EdgeTrainError("cannot start: " + "; ".join(problems))

    async def _join(self, channel: BoardChannel, exchange: ExchangeServer) -> None:
        need = set(self.spec.boards)
        waiter = asyncio.ensure_future(exchange.wait_for_boards(JOIN_TIMEOUT_S, need=need))
        while not waiter.done():
            event = await channel.next_event(0.2)
            if event is not None and event.job_id == self.spec.run_id and event.phase in ("rejected", "failed"):
                exchange.fail(event.board_id, event.message or event.phase)
            if self._stop.is_set():
                waiter.cancel()
                raise KeyboardInterrupt
        waiter.result()

    def _handle_events(self, channel: BoardChannel, exchange: ExchangeServer) -> None:
        for event in channel.drain_events():
            if event.job_id != self.spec.run_id:
                continue
            if event.phase == "failed":
                self.on_note(f"board {event.board_id} failed: {event.message}")
                exchange.fail(event.board_id, event.message)

    async def _steps(self, channel: BoardChannel, exchange: ExchangeServer) -> TrainOutcome:
        spec, started = self.spec, time.monotonic()
        samples = 0
        while self.replica.step < spec.total_steps and not self._stop.is_set():
            self._handle_events(channel, exchange)
            step = self.replica.step
            result = await exchange.run_step(step, apply=self.replica.apply, minimum_deadline_s=spec.step_timeout_s)
            samples += result.n_total
            elapsed = time.monotonic() - started
            epoch_end = (step + 1) % spec.steps_per_epoch == 0 or step + 1 == spec.total_steps
            if epoch_end:
                self.val_loss, self.val_accuracy = self.replica.evaluate(self.val_set)
            self._record(result, elapsed)
            self.on_step(StepView(step=step, total_steps=spec.total_steps, loss=result.loss, val_accuracy=self.val_accuracy,
                                  samples_per_s=samples / elapsed if elapsed > 0 else 0.0,
                                  board_compute_s=result.compute_s, late=result.late, refused=result.refused))
            if (step + 1) % spec.checkpoint_every == 0:
                self._checkpoint(self.elapsed_before_s + elapsed)
        elapsed = time.monotonic() - started
        exchange.finished = True
        self.flags = exchange.flags()
        self._checkpoint(self.elapsed_before_s + elapsed)
        interrupted = self.replica.step < spec.total_steps
        if not interrupted:
            atomic_torch_save(self.run_dir / "model.pt", self.replica.model.state_dict())
        result = self._result(elapsed, samples, exchange, interrupted)
        atomic_write_json(self.run_dir / "result.json", result)
        return TrainOutcome(self.run_dir, result, interrupted)

    def _record(self, r: StepResult, elapsed: float) -> None:
        record = {"step": r.step, "n": r.n_total, "loss": r.loss, "boards": r.contributors, "late": r.late,
                  "refused": r.refused, "compute_s": r.compute_s, "wall_s": round(r.wall_s, 6),
                  "elapsed_s": round(self.elapsed_before_s + elapsed, 3)}
        if self.val_accuracy is not None and ((r.step + 1) % self.spec.steps_per_epoch == 0 or r.step + 1 == self.spec.total_steps):
            record["val_accuracy"], record["val_loss"] = self.val_accuracy, self.val_loss
        self.metrics.write(record)
        self.history.append(record)

    def _result(self, elapsed: float, samples: int, exchange: ExchangeServer, interrupted: bool) -> dict[str, Any]:
        per_board: dict[str, Any] = {}
        for i, board in enumerate(self.spec.boards):
            times = [h["compute_s"][board] for h in self.history if board in h["compute_s"]]
            per_board[board] = {"batch_size": self.spec.batch_sizes[i], "steps_contributed": len(times),
                                "median_compute_s": statistics.median(times) if times else None,
                                "flags": self.flags.get(board, [])[:50]}
        return {"run_id": self.spec.run_id, "steps": self.replica.step, "total_steps": self.spec.total_steps,
                "interrupted": interrupted, "val_accuracy": self.val_accuracy, "val_loss": self.val_loss,
                "elapsed_s": round(self.elapsed_before_s + elapsed, 3),
                "samples_per_s": round(samples / elapsed, 2) if elapsed > 0 else None,
                "steps_with_dropped_boards": sum(1 for h in self.history if h["late"] or h["refused"]),
                "exchange_bytes_in": exchange.bytes_in, "exchange_bytes_out": exchange.bytes_out,
                "boards": per_board, "wire_dtype": self.spec.wire_dtype}


__all__ = ["ExchangeError", "StepView", "TrainOutcome", "TrainSpec", "TrainingRun", "exchange_host_for"]
