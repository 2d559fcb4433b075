"""The edge-agent's footprint at 1 Hz: resident memory and CPU per telemetry sample.

What runs (all on 127.0.0.1, all stopped and removed at the end):

* a real Mosquitto on a free loopback port (``brokers.local_broker.start_mosquitto``);
* a real agent, ``python -m agent --config TMP --id bench-1 --broker 127.0.0.1:PORT --interval 1``,
  where the temporary config file sets ``[power] source = "estimated"`` so the run does not depend
  on which power sensors this machine has;
* the baseline, measured in the same run: an idle ``python -c`` process that imports the agent's
  runtime dependencies (paho-mqtt, psutil, msgpack) and sleeps. It is what any Python program with
  those libraries costs; the agent's RSS is printed as a ratio to it.

How it is measured: this script subscribes to the agent's telemetry topic and waits until the agent
publishes (no fixed sleeps). The window opens right after one sample arrives and closes right after
the ``--seconds``-th sample after it arrives, so it holds exactly that many samples' work. During the
window psutil reads both processes' RSS every ``--rss-every`` seconds (max and at the end are
reported); the agent's CPU time (user + system, threads included) consumed in the window is divided
by the samples published in it (ms per sample) and by the window's wall time (% of one core).

It also checks that torch was never imported by the agent (the idle agent must stay light): no
file of the torch package (libtorch*, libc10*, ``…/torch/…``) may be mapped in /proc/PID/maps. The
check is proven able to fail on a control process that does import torch (skip with
``--no-torch-control``; reported as skipped when torch is not installed).

Targets (README, "Benchmarks"): agent RSS <= 40 MB (1 MB = 10^6 bytes) and agent CPU <= 0.5 % of one
core at 1 Hz. PASS/FAIL is printed per target; the table of figures comes last. Exit code: 0 if
every target and check passed, 1 otherwise, 2 if the run could not be made.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

from _harness import BenchError  # bench/ is the script's folder, first on sys.path
from _table import print_table

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.protocol.errors import BrokerError, DecodeError
from edgefleet.protocol.messages import TelemetrySample
from edgefleet.protocol.topics import DEFAULT_PREFIX, telemetry_topic
from edgefleet.transport.mqtt_link import MqttLink
from edgefleet.transport.settings import BrokerSettings

BOARD_ID = "bench-1"
INTERVAL_S = 1.0
RSS_TARGET_BYTES = 40_000_000       # 40 MB
CPU_TARGET_PERCENT = 0.5            # of one core
MB = 1_000_000
# Anything of the torch package mapped into a process: its shared libraries or its extension modules.
TORCH_MAPPING = re.compile(r"(^|/)(torch|functorch)/|/libtorch[^/]*\.so|/libc10[^/]*\.so")
BASELINE_CODE = ("import sys, time, paho.mqtt.client, psutil, msgpack; "
                 "print('ready', flush=True); time.sleep(float(sys.argv[1]))")
TORCH_CONTROL_CODE = "import sys, time, torch; print('ready', flush=True); time.sleep(float(sys.argv[1]))"


# ----------------------------------------------------------------------------- processes

def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EDGEFLEET_BROKER"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def stop_process(proc: subprocess.Popen[bytes], *, timeout_s: float = 5.0) -> int | None:
    """SIGTERM, wait, then SIGKILL; returns the exit code (None if it could not be reaped)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None
    return proc.returncode


@contextmanager
def python_sleeper(code: str, *, lifetime_s: float, ready_timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """A ``python -c CODE LIFETIME`` process that prints 'ready' once set up; it ends by itself after LIFETIME."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(lifetime_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env())
    try:
        assert proc.stdout is not None and proc.stderr is not None
        readable, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
        line = proc.stdout.readline() if readable else b""
        if line.strip() != b"ready":
            stop_process(proc)
            raise BenchError(f"`python -c {code!r}` did not get ready within {ready_timeout_s:.0f} s: "
                             f"{proc.stderr.read().decode(errors='replace').strip()[-300:]}")
        yield proc
    finally:
        stop_process(proc)


def torch_mappings(pid: int) -> list[str]:
    """Files of the torch package mapped into process ``pid`` (empty if torch was never imported)."""
    found: set[str] = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and TORCH_MAPPING.search(parts[5]):
                found.add(parts[5].strip())
    return sorted(found)


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM: the process's peak RSS over its whole life (start-up included)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- telemetry watcher

@dataclass
class TelemetryWatch:
    """Counts the agent's samples as they arrive (on the MQTT thread) and lets the main thread wait for them."""

    received: int = 0
    last_seq: int = 0
    bad: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        try:
            seq = TelemetrySample.from_json(payload).seq
        except DecodeError as exc:
            with self.cond:
                self.bad.append(str(exc))
            return
        with self.cond:
            self.received += 1
            self.last_seq = seq
            self.cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` samples have arrived in total."""
        with self.cond:
            return self.cond.wait_for(lambda: self.received >= count, timeout=timeout_s)


# ----------------------------------------------------------------------------- measurement

@dataclass
class Footprint:
    rss_max: int = 0
    rss_end: int = 0
    rss_samples: int = 0

    def read(self, proc: psutil.Process) -> int:
        rss = int(proc.memory_info().rss)
        self.rss_max = max(self.rss_max, rss)
        self.rss_end = rss
        self.rss_samples += 1
        return rss


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU time from /proc/PID/stat: all threads, but in clock ticks (10 ms on most kernels)."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on CPU per live thread (/proc/PID/task/TID/schedstat); empty if the kernel has no schedstat.

    A 60 s window of a 1 Hz agent holds tens of ms of CPU, so the tick-based figure alone would be off by
    up to 10 ms (~15 %); this one is exact for threads alive at the end of the window.
    """
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_ns_delta(start: dict[int, int], end: dict[int, int]) -> int:
    """CPU used between two ``thread_cpu_ns`` readings; a thread born in between counts from zero."""
    return sum(ns - start.get(tid, 0) for tid, ns in end.items())


@dataclass
class Result:
    seconds_requested: int
    window_s: float = 0.0
    samples: int = 0
    received: int = 0
    agent: Footprint = field(default_factory=Footprint)
    baseline: Footprint = field(default_factory=Footprint)
    agent_cpu_s: float = 0.0            # schedstat (ns) when available, else ticks
    agent_cpu_ticks_s: float = 0.0      # the same from /proc/PID/stat, for a cross-check
    baseline_cpu_s: float = 0.0
    agent_uss_end: int | None = None
    agent_peak_rss_life: int | None = None
    torch_maps: list[str] = field(default_factory=list)
    torch_control: str = "not run"      # "detected", "MISSED", "skipped (...)"
    agent_exit_code: int | None = None

    @property
    def cpu_ms_per_sample(self) -> float:
        return 1000.0 * self.agent_cpu_s / self.samples if self.samples else float("nan")

    @property
    def cpu_percent(self) -> float:
        return 100.0 * self.agent_cpu_s / self.window_s if self.window_s else float("nan")

    @property
    def baseline_cpu_percent(self) -> float:
        return 100.0 * self.baseline_cpu_s / self.window_s if self.window_s else float("nan")


def run(args: argparse.Namespace, stack: ExitStack) -> Result:
    result = Result(seconds_requested=args.seconds)
    lifetime = args.seconds * INTERVAL_S + 120  # the sleepers end by themselves even if this script is killed
    broker: LocalBroker = stack.enter_context(start_mosquitto(host="127.0.0.1"))
    print(f"mosquitto on {broker.address}", flush=True)

    watch = TelemetryWatch()
    link = MqttLink(BrokerSettings(host=broker.host, port=broker.port), client_id=f"bench-footprint-{os.getpid()}",
                    on_connect=lambda lk: lk.subscribe(telemetry_topic(DEFAULT_PREFIX, BOARD_ID), qos=0),
                    on_message=watch.on_message)
    link.start()
    stack.callback(link.close)
    if not link.wait_connected(10):
        raise BenchError(f"the benchmark's own subscriber could not connect to {broker.address}")

    baseline_proc = stack.enter_context(python_sleeper(BASELINE_CODE, lifetime_s=lifetime, ready_timeout_s=30))
    baseline = psutil.Process(baseline_proc.pid)

    workdir = Path(tempfile.mkdtemp(prefix="edgefleet-bench-agent-"))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    config = workdir / "agent.toml"
    config.write_text('[power]\nsource = "estimated"\n', encoding="utf-8")
    agent_log = workdir / "agent.log"
    cmd = [sys.executable, "-m", "edgefleet.agent", "--config", str(config), "--id", BOARD_ID,
           "--broker", broker.address, "--interval", f"{INTERVAL_S:g}"]
    with agent_log.open("wb") as out:
        agent_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=workdir)

    def stop_agent() -> None:
        result.agent_exit_code = stop_process(agent_proc)
    stack.callback(stop_agent)
    agent = psutil.Process(agent_proc.pid)
    print(f"agent pid {agent_proc.pid}: {' '.join(cmd[1:])}", flush=True)

    def agent_log_tail() -> str:
        return agent_log.read_text(errors="replace").strip()[-600:]

    # Wait for the first sample, then open the window right after the next one arrives.
    first_deadline = time.monotonic() + 30
    while not watch.wait_for(1, timeout_s=0.2):
        if agent_proc.poll() is not None:
            raise BenchError(f"the agent exited with code {agent_proc.returncode} before publishing; its log:\n{agent_log_tail()}")
        if time.monotonic() > first_deadline:
            raise BenchError(f"the agent published nothing within 30 s; its log:\n{agent_log_tail()}")
    if not watch.wait_for(2, timeout_s=10 * INTERVAL_S):
        raise BenchError(f"the agent stopped publishing after its first sample; its log:\n{agent_log_tail()}")
    with watch.cond:
        start_count, start_seq = watch.received, watch.last_seq
    t0 = time.monotonic()
    agent_cpu0, agent_ns0 = cpu_seconds(agent), thread_cpu_ns(agent.pid)
    baseline_cpu0, baseline_ns0 = cpu_seconds(baseline), thread_cpu_ns(baseline.pid)
    result.agent.read(agent)
    result.baseline.read(baseline)
    print(f"agent publishing (seq {start_seq}); measuring {args.seconds} samples at {1 / INTERVAL_S:g} Hz", flush=True)

    target = start_count + args.seconds
    deadline = t0 + args.seconds * INTERVAL_S + 10 * INTERVAL_S + 5
    next_progress = t0 + 10
    while not watch.wait_for(target, timeout_s=args.rss_every):
        if agent_proc.poll() is not None:
            raise BenchError(f"the agent exited with code {agent_proc.returncode} during the window; its log:\n{agent_log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"only {watch.received - start_count} of {args.seconds} samples arrived in time; the agent's "
                             f"log:\n{agent_log_tail()}")
        result.agent.read(agent)
        result.baseline.read(baseline)
        if time.monotonic() >= next_progress:
            next_progress += 10
            print(f"  {watch.received - start_count:4d}/{args.seconds} samples, agent RSS {result.agent.rss_end / MB:.1f} MB", flush=True)
    agent_ns1 = thread_cpu_ns(agent.pid)
    result.agent_cpu_ticks_s = cpu_seconds(agent) - agent_cpu0
    result.agent_cpu_s = cpu_ns_delta(agent_ns0, agent_ns1) / 1e9 if agent_ns0 and agent_ns1 else result.agent_cpu_ticks_s
    baseline_ns1 = thread_cpu_ns(baseline.pid)
    result.baseline_cpu_s = (cpu_ns_delta(baseline_ns0, baseline_ns1) / 1e9 if baseline_ns0 and baseline_ns1
                             else cpu_seconds(baseline) - baseline_cpu0)
    result.window_s = time.monotonic() - t0
    result.agent.read(agent)
    result.baseline.read(baseline)
    with watch.cond:
        result.samples = watch.last_seq - start_seq        # what the agent published in the window
        result.received = watch.received - start_count     # what reached the subscriber
        if watch.bad:
            raise BenchError(f"the agent published {len(watch.bad)} invalid samples, e.g. {watch.bad[0]}")
    try:
        result.agent_uss_end = int(agent.memory_full_info().uss)
    except (psutil.AccessDenied, AttributeError):
        result.agent_uss_end = None
    result.agent_peak_rss_life = peak_rss_bytes(agent_proc.pid)
    result.torch_maps = torch_mappings(agent_proc.pid)
    stop_agent()  # the agent is measured: stop it now (SIGTERM), before the torch control loads ~GBs of libraries

    if args.no_torch_control:
        result.torch_control = "skipped (--no-torch-control)"
    elif subprocess.run([sys.executable, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"],
                        env=child_env(), check=False).returncode != 0:
        result.torch_control = "skipped (torch is not installed)"
    else:
        print("control: a process that imports torch (the check must see it)", flush=True)
        with python_sleeper(TORCH_CONTROL_CODE, lifetime_s=120, ready_timeout_s=120) as control:
            result.torch_control = "detected" if torch_mappings(control.pid) else "MISSED"
    return result


# ----------------------------------------------------------------------------- report

def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(result: Result) -> bool:
    rss_ok = result.agent.rss_max <= RSS_TARGET_BYTES
    cpu_ok = result.cpu_percent <= CPU_TARGET_PERCENT
    torch_ok = not result.torch_maps
    control_ok = result.torch_control != "MISSED"
    complete = result.samples == result.seconds_requested and result.received == result.samples
    clean_exit = result.agent_exit_code == 0
    ratio_max = result.agent.rss_max / result.baseline.rss_max if result.baseline.rss_max else float("nan")
    ratio_end = result.agent.rss_end / result.baseline.rss_end if result.baseline.rss_end else float("nan")
    rows: list[tuple[str, str, str, str, str, str]] = [
        # metric, agent, baseline, agent / baseline, target, result
        ("RSS max in window", f"{result.agent.rss_max / MB:.1f} MB", f"{result.baseline.rss_max / MB:.1f} MB",
         f"{ratio_max:.2f}x", f"<= {RSS_TARGET_BYTES / MB:.0f} MB", verdict(rss_ok)),
        ("RSS at end", f"{result.agent.rss_end / MB:.1f} MB", f"{result.baseline.rss_end / MB:.1f} MB",
         f"{ratio_end:.2f}x", "", ""),
        ("USS at end", "-" if result.agent_uss_end is None else f"{result.agent_uss_end / MB:.1f} MB", "", "", "", ""),
        ("peak RSS over life (VmHWM)", "-" if result.agent_peak_rss_life is None else f"{result.agent_peak_rss_life / MB:.1f} MB",
         "", "", "", ""),
        ("CPU, % of one core", f"{result.cpu_percent:.3f} %", f"{result.baseline_cpu_percent:.3f} %", "",
         f"<= {CPU_TARGET_PERCENT} %", verdict(cpu_ok)),
        ("CPU per sample", f"{result.cpu_ms_per_sample:.2f} ms", "", "", "", ""),
        ("CPU time in window", f"{result.agent_cpu_s * 1000:.1f} ms", f"{result.baseline_cpu_s * 1000:.1f} ms", "", "", ""),
        ("  same, in 10 ms ticks (stat)", f"{result.agent_cpu_ticks_s * 1000:.0f} ms", "", "", "", ""),
        ("samples published / received", f"{result.samples} / {result.received}", "", "",
         f"{result.seconds_requested} / {result.seconds_requested}", verdict(complete)),
        ("window", f"{result.window_s:.1f} s", "", "", "", ""),
        ("torch mapped in agent", "no" if torch_ok else f"YES: {', '.join(Path(p).name for p in result.torch_maps[:3])}",
         "", "", "never", verdict(torch_ok)),
        ("torch check on an importing control", result.torch_control, "", "", "detected", verdict(control_ok)),
        ("agent exit on SIGTERM", str(result.agent_exit_code), "", "", "0", verdict(clean_exit)),
    ]
    title = (f"edge-agent at {1 / INTERVAL_S:g} Hz, {result.samples} samples; "
             f"baseline: idle python with paho-mqtt, psutil, msgpack")
    headers = ("metric", "agent", "baseline", "agent / baseline", "target", "result")
    print_table(title, headers, rows)
    return rss_ok and cpu_ok and torch_ok and control_ok and complete


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure the edge-agent's RSS and CPU per sample at 1 Hz against an idle Python baseline "
                    "(targets: RSS <= 40 MB, CPU <= 0.5% of one core).",
        epilog="Starts its own Mosquitto on 127.0.0.1; needs mosquitto installed. Exit code 0 if every target passed.")
    parser.add_argument("--seconds", type=int, default=60, metavar="N",
                        help="measurement window: N samples at 1 Hz, about N seconds (default 60)")
    parser.add_argument("--rss-every", type=float, default=0.2, metavar="S",
                        help="seconds between RSS readings in the window (default 0.2)")
    parser.add_argument("--no-torch-control", action="store_true",
                        help="skip the control process that imports torch (it proves the torch check can fail)")
    args = parser.parse_args(argv)
    if args.seconds < 1:
        parser.error("--seconds must be at least 1")
    if not 0.01 <= args.rss_every <= 5:
        parser.error("--rss-every must be within 0.01-5 seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that a SIGTERM still cleans up
    with ExitStack() as stack:
        try:
            result = run(args, stack)
        except (BenchError, BrokerError) as exc:
            print(f"agent_footprint: {exc}", file=sys.stderr)
            return 2
    return 0 if report(result) else 1


if __name__ == "__main__":
    sys.exit(main())
