"""The board's side of ``edge-coordinator profile``: measure one model variant for the planner.

For each batch size, in ascending order, a fresh copy of the model trains ``warmup_steps +
timed_steps`` real steps with the same Trainer settings as a training job. A callback notes the
time of every ``on_train_batch_start``; the period between two of them is the whole step (data,
forward, backward, optimizer step, Lightning's overhead) and the median over the timed steps is
the step time. Once per batch size it reads the process's peak resident memory (reset at the
start of the job, so a kept worker's earlier jobs do not count; ascending order makes each
reading that batch size's peak) and the power drawn during the timed steps: the board's sensor
sampled in a thread, or, with no sensor, ``idle_w + (max_w - idle_w) x`` the share of the CPU
this board may use (its cgroup quota, else its cores) that the worker's CPU time filled.

Imported only by the worker (it needs torch and Lightning).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytorch_lightning as pl
import torch

from agent.sensors.cgroup_cpu import CgroupCpuSource
from agent.sensors.power import select_power_source
from protocol import __version__
from protocol.errors import ConfigError, EdgeTrainError
from protocol.framing import recv_frame, send_frame
from protocol.jobs import MAX_EVENT_BYTES, PROBE_VERSION, ProfileCommand

if TYPE_CHECKING:
    from agent.job_runner import WorkerContext
    from agent.worker import EventWriter

log = logging.getLogger(__name__)

IDLE_SAMPLE_S = 1.0       # a power sensor is read this long before the first batch size for the idle figure
SENSOR_PERIOD_S = 0.1     # how often a power sensor is read during the timed steps
PROBE_CONNECT_TIMEOUT_S = 30.0
PROBE_WAIT_S = 900.0      # for the coordinator to serve the boards before this one
_CHUNK = 1 << 20


class ProfileError(EdgeTrainError):
    """The profile cannot be measured here; the message says why and what to do."""


# --------------------------------------------------------------------------------------- memory

def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current RSS; False if Linux refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def cgroup_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup"),
                        proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v1 or v2), or None."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[tuple[Path, str, str]] = []  # (mount, group path, limit file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            mounts = [cgroup_root / "memory"]
            try:
                mounts += sorted(p for p in cgroup_root.iterdir() if "memory" in p.name.split(",") and p not in mounts)
            except OSError:
                pass
            candidates += [(m, parts[2], "memory.limit_in_bytes") for m in mounts]
        elif parts[1] == "":
            candidates += [(m, parts[2], "memory.max") for m in (cgroup_root, cgroup_root / "unified")]
    for mount, group, limit_file in candidates:
        if not (mount / limit_file).exists() and not (mount / group.lstrip("/") / limit_file).exists():
            continue
        directory = mount / group.lstrip("/")
        if not directory.is_dir():  # a cgroup namespace: our group is the mount's root
            directory = mount
        limits = []
        while True:
            try:
                text = (directory / limit_file).read_text().strip()
                if text != "max":
                    limits.append(int(text))
            except (OSError, ValueError):
                pass
            if directory == mount:
                break
            directory = directory.parent
        return min(limits) if limits else None
    return None


def memory_total_bytes() -> int:
    """What the worker may use: physical RAM, or its cgroup's memory limit if lower."""
    total = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit()
    return min(total, limit) if limit else total


# ---------------------------------------------------------------------------------------- power

def allowed_cores() -> float:
    """The CPU this board may use: its cgroup's quota if it has one, else the cores it may run on."""
    cgroup = CgroupCpuSource()
    if cgroup.available():
        return cgroup.allowed_cores()
    return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class PowerMeter:
    """Average power over a window, from the agent's power source.

    A sensor is read every ``SENSOR_PERIOD_S`` in a thread. Without one (``estimated``, ``none``,
    or ``auto`` finding nothing) the estimate is ``idle_w + (max_w - idle_w) x u`` where ``u`` is
    this process's CPU time over the window divided by the window and ``allowed_cores()``.
    """

    def __init__(self, context: WorkerContext) -> None:
        self.idle_model_w, self.max_model_w = context.idle_w, context.max_w
        self.cores = allowed_cores()
        self.sensor: Any = None
        self.label = "estimated"
        if context.power_source not in ("estimated", "none"):
            try:
                source = select_power_source(context.power_source, sysfs_root=Path(context.sysfs_root),
                                             idle_w=context.idle_w, max_w=context.max_w, cpu_percent=lambda: None)
            except ConfigError as exc:
                log.warning("power sensor unavailable in the worker (%s); estimating", exc)
                source = None
            if source is not None and source.name not in ("estimated", "none"):
                self.sensor = source
        self._failed = False  # the sensor gave nothing once: every figure of this job is estimated
        self._readings: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = self._cpu0 = 0.0

    def _read_sensor(self) -> float | None:
        try:
            reading = self.sensor.read()
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("power sensor read failed: %s", exc)
            return None
        watts = reading.get("power_w")
        if watts is None:
            return None
        self.label = str(reading.get("power_source") or self.sensor.name)
        return float(watts)

    def _sample(self) -> None:
        while not self._stop.wait(SENSOR_PERIOD_S):
            watts = self._read_sensor()
            if watts is not None:
                self._readings.append(watts)

    def start(self) -> None:
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()
        if self.sensor is not None and not self._failed:
            self._readings = []
            self._read_sensor()  # primes sensors that report the average since their last read (RAPL)
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="power-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> float:
        """Watts over the window since ``start()``."""
        wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._cpu0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            last = self._read_sensor()
            readings = self._readings + ([last] if last is not None else [])
            if readings:
                return statistics.fmean(readings)
            log.warning("the power sensor gave no reading during the timed steps; estimating from CPU time")
            self._failed = True
        self.label = "estimated"
        utilisation = min(1.0, cpu / (wall * self.cores)) if wall > 0 else 0.0
        return self.idle_model_w + (self.max_model_w - self.idle_model_w) * utilisation

    def idle_w(self) -> float:
        """Idle draw: the sensor read for ``IDLE_SAMPLE_S`` while the worker waits, else ``idle_w``."""
        if self.sensor is None or self._failed:
            return self.idle_model_w
        self._read_sensor()
        readings = []
        deadline = time.monotonic() + IDLE_SAMPLE_S
        while time.monotonic() < deadline:
            time.sleep(SENSOR_PERIOD_S)
            watts = self._read_sensor()
            if watts is not None:
                readings.append(watts)
        return statistics.fmean(readings) if readings else self.idle_model_w

    def close(self) -> None:
        close = getattr(self.sensor, "close", None)
        if callable(close):
            close()


# ----------------------------------------------------------------------------------------- link

@dataclass(frozen=True, slots=True)
class LinkFigures:
    up_bytes_per_s: float      # board -> coordinator, this board alone
    down_bytes_per_s: float    # coordinator -> board, this board alone


def _recv_discard(sock: socket.socket, nbytes: int) -> None:
    buffer = bytearray(min(_CHUNK, max(nbytes, 1)))
    view, left = memoryview(buffer), nbytes
    while left:
        got = sock.recv_into(view[:min(left, len(buffer))])
        if not got:
            raise ConnectionError("the coordinator closed the probe connection")
        left -= got


def _send_zeros(sock: socket.socket, nbytes: int) -> None:
    chunk = bytes(min(_CHUNK, nbytes))
    left = nbytes
    while left:
        n = min(left, len(chunk))
        sock.sendall(memoryview(chunk)[:n])
        left -= n


def _expect(sock: socket.socket, kind: str) -> dict[str, Any]:
    frame = recv_frame(sock, max_bytes=64 * 1024)
    if frame["type"] == "error":
        raise ProfileError(f"the coordinator refused the link probe: {frame.get('message')}")
    if frame["type"] != kind:
        raise ProfileError(f"link probe: expected {kind!r} from the coordinator, got {frame['type']!r}")
    return frame


def probe_link(*, host: str, port: int, token: str, job_id: str, board_id: str, nbytes: int) -> LinkFigures:
    """Upload then download ``nbytes`` to the coordinator's probe endpoint and time both.

    Raises:
        ProfileError: the endpoint cannot be reached, refused this board, or broke the exchange.
    """
    try:
        sock = socket.create_connection((host, port), timeout=PROBE_CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ProfileError(f"cannot reach the coordinator's link probe at {host}:{port} ({exc.strerror or exc}); "
                           "check the coordinator's address towards the boards and the firewall") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, {"type": "probe-hello", "v": PROBE_VERSION, "job_id": job_id, "board_id": board_id,
                          "token": token, "bytes": nbytes})
        sock.settimeout(PROBE_WAIT_S)
        _expect(sock, "go")
        sock.settimeout(PROBE_CONNECT_TIMEOUT_S + nbytes / 10_000)  # at least 10 kB/s
        started = time.perf_counter()
        _send_zeros(sock, nbytes)
        _expect(sock, "got")
        up_s = time.perf_counter() - started
        started = time.perf_counter()
        send_frame(sock, {"type": "down"})
        _recv_discard(sock, nbytes)
        down_s = time.perf_counter() - started
        sock.settimeout(PROBE_WAIT_S)
        if _next(sock) == "aggregate":
            _send_zeros(sock, nbytes)
            _expect(sock, "got")
            _expect(sock, "done")
        return LinkFigures(nbytes / max(up_s, 1e-9), nbytes / max(down_s, 1e-9))
    except (OSError, EdgeTrainError) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"the link probe with the coordinator at {host}:{port} failed: {exc}") from None
    finally:
        sock.close()


def _next(sock: socket.socket) -> str:
    frame = recv_frame(sock, max_bytes=64 * 1024)
    if frame["type"] not in ("aggregate", "done"):
        raise ProfileError(f"link probe: unexpected {frame['type']!r} from the coordinator")
    return str(frame["type"])


# ---------------------------------------------------------------------------------------- steps

class _Measured(Exception):
    """Raised at the first batch after the timed steps: the measurement is complete."""


class StepClock(pl.Callback):
    """Notes every ``on_train_batch_start``; runs the power meter over the timed steps."""

    def __init__(self, warmup_steps: int, timed_steps: int, meter: PowerMeter) -> None:
        self.warmup, self.timed, self.meter = warmup_steps, timed_steps, meter
        self.starts: list[float] = []
        self.power_w: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        if len(self.starts) == self.warmup + 1:
            self.meter.start()
        if len(self.starts) == self.warmup + self.timed + 1:
            self.power_w = self.meter.stop()
            raise _Measured

    @property
    def periods_s(self) -> list[float]:
        """The timed steps' periods (start of a step to the start of the next)."""
        return [b - a for a, b in zip(self.starts[self.warmup:], self.starts[self.warmup + 1:])]


def _batches(n: int, batch_size: int, count: int, seed: int) -> list[list[int]]:
    """``count`` batches of random sample indices (drawn with replacement: a batch may exceed the dataset)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(n, (count, batch_size), generator=generator).tolist()


def _measure(job: ProfileCommand, dataset: Any, batch_size: int, meter: PowerMeter) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from workloads.registry import build_model

    torch.manual_seed(job.seed)
    model = build_model(job.model, tuple(dataset.input_shape), int(dataset.num_classes), job.model_options)
    clock = StepClock(job.warmup_steps, job.timed_steps, meter)
    batches = _batches(len(dataset), batch_size, job.warmup_steps + job.timed_steps + 1, job.seed)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, use_distributed_sampler=False, callbacks=[clock])
    try:
        trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_sampler=batches))
    except _Measured:
        pass
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, MemoryError) or "alloc" in str(exc).lower():
            raise ProfileError(f"out of memory at batch size {batch_size} ({type(exc).__name__}: {str(exc)[:200]}); "
                               "profile smaller batch sizes (--batch)") from None
        raise
    periods = clock.periods_s
    if clock.power_w is None or len(periods) < job.timed_steps:
        raise ProfileError(f"the model trained only {len(clock.starts)} of {len(batches)} steps at batch size "
                           f"{batch_size}; does its training_step skip batches?")
    median = statistics.median(periods)
    return {"batch_size": batch_size, "step_time_s": median, "step_time_min_s": min(periods),
            "step_time_max_s": max(periods), "samples_per_s": batch_size / median,
            "peak_memory_bytes": peak_rss_bytes(), "power_w": clock.power_w}


def run_profile(job: ProfileCommand, events: EventWriter, context: WorkerContext) -> int:
    """Measure ``job`` and report one ``finished`` event with the figures in ``data``.

    Raises:
        EdgeTrainError: unknown model or dataset, out of memory, the probe endpoint unreachable.
    """
    from workloads.params import param_count, single_optimizer, trainable_params
    from workloads.registry import build_dataset_cached, build_model

    if job.threads:
        torch.set_num_threads(job.threads)
    if not reset_peak_rss():
        log.warning("cannot reset the peak RSS (/proc/self/clear_refs); memory figures include earlier jobs")
    pid = os.getpid()
    dataset = build_dataset_cached(job.dataset, "train", job.dataset_options)
    model = build_model(job.model, tuple(dataset.input_shape), int(dataset.num_classes), job.model_options)
    count = param_count(trainable_params(single_optimizer(model.configure_optimizers())))
    del model
    events.emit("running", f"profiling {job.model} (worker pid {pid})", data={"worker_pid": pid})
    meter = PowerMeter(context)
    try:
        idle_w = meter.idle_w()
        points = []
        for batch_size in sorted(set(job.batch_sizes)):
            point = _measure(job, dataset, batch_size, meter)
            points.append(point)
            events.emit("progress", f"batch {batch_size}: {point['step_time_s'] * 1000:.1f} ms/step, "
                                    f"{point['samples_per_s']:.0f} samples/s, peak {point['peak_memory_bytes'] / 1e6:.0f} MB, "
                                    f"{point['power_w']:.2f} W ({meter.label})")
    finally:
        meter.close()
    link = None
    if job.probe_bytes:  # after the steps: another board's probe traffic must not slow this board's timing
        link = probe_link(host=job.probe_host, port=job.probe_port, token=job.probe_token, job_id=job.job_id,
                          board_id=job.board_id, nbytes=job.probe_bytes)
        events.emit("progress", f"link up {link.up_bytes_per_s * 8e-6:.1f} Mbit/s, "
                                f"down {link.down_bytes_per_s * 8e-6:.1f} Mbit/s")
    windows = [p["step_time_s"] * job.timed_steps for p in points]
    active_w = sum(p["power_w"] * w for p, w in zip(points, windows)) / sum(windows)
    data = {"agent_version": __version__, "worker_pid": pid, "torch_threads": torch.get_num_threads(),
            "param_count": count, "points": points, "active_power_w": active_w, "idle_power_w": idle_w,
            "power_source": meter.label, "memory_total_bytes": memory_total_bytes(),
            "link": None if link is None else {"up_bytes_per_s": link.up_bytes_per_s,
                                               "down_bytes_per_s": link.down_bytes_per_s, "bytes": job.probe_bytes}}
    try:
        size = len(json.dumps(data, allow_nan=False))  # the coordinator refuses non-finite numbers
    except ValueError:
        raise ProfileError("a profile figure is not a finite number (a clock or sensor misbehaved); profile again") from None
    if size > MAX_EVENT_BYTES // 2:
        raise ProfileError(f"the profile result is {size} bytes, over {MAX_EVENT_BYTES // 2}; profile fewer batch sizes")
    events.emit("finished", f"profiled {len(points)} batch sizes", data=data)
    return 0


__all__ = ["LinkFigures", "PowerMeter", "ProfileError", "StepClock", "cgroup_memory_limit", "memory_total_bytes",
           "peak_rss_bytes", "probe_link", "reset_peak_rss", "run_profile"]
