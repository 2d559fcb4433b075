"""The board's side of profiling: memory limits, the link probe against the real probe server, a
real profile of LeNet-5, and a worker process that runs several jobs in a row."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgefleet.agent.board_resources import PowerMeter, cgroup_memory_limit
from edgefleet.agent.job_runner import JobRunner, WorkerContext, job_line
from edgefleet.agent.link_probe import ProfileError, probe_link
from edgefleet.agent.profile_worker import run_profile
from edgefleet.agent.worker_events import EventWriter
from edgefleet.coordinator.planning.link_probe import LinkProbeServer
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.jobs import JobEvent, ProfileCommand
from edgefleet.protocol.profile_report import PROFILE_REPORT_VERSION, ProfileReport
from tests.helpers import wait_until

TOKEN = "s" * 32


class Events(EventWriter):
    """The worker's own event writer, over a buffer instead of the pipe to the agent: the JSON lines it wrote."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        super().__init__(self.buffer)

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines()]


def _job(**over: Any) -> ProfileCommand:
    fields: dict[str, Any] = {"job_id": "p-0", "board_id": "b1", "model": "lenet5", "dataset": "digits",
                              "batch_sizes": [8, 4], "warmup_steps": 1, "timed_steps": 3, "threads": 1,
                              "probe_host": "127.0.0.1", "probe_port": 9, "probe_token": TOKEN, "probe_bytes": 0}
    fields.update(over)
    return ProfileCommand(**fields)


def _cgroup_tree(tmp_path: Path, table: dict[str, str], proc_line: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, value in table.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_line)
    return root, proc


@pytest.mark.parametrize("table, proc_line, expected", [
    ({"memory/memory.limit_in_bytes": "9223372036854771712",
      "memory/lab/memory.limit_in_bytes": "1073741824",
      "memory/lab/pi-1/memory.limit_in_bytes": "9223372036854771712"},
     "4:memory:/lab/pi-1\n0::/\n", 1 << 30),                                   # v1: a parent's limit counts
    ({"cgroup.controllers": "cpu memory", "lab/pi-2/memory.max": "536870912", "lab/memory.max": "max"},
     "0::/lab/pi-2\n", 512 << 20),                                              # v2
    ({"cgroup.controllers": "cpu memory", "a/memory.max": "max"}, "0::/a\n", None),  # no limit anywhere
    ({"memory/memory.limit_in_bytes": "2147483648"}, "4:memory:/not/here\n", 2 << 30),  # namespaced: the mount root
])
def test_the_memory_limit_is_the_tightest_of_the_group_and_its_parents(tmp_path: Path, table: dict[str, str],
                                                                       proc_line: str, expected: int | None) -> None:
    root, proc = _cgroup_tree(tmp_path, table, proc_line)
    assert cgroup_memory_limit(root, proc) == expected


def test_the_estimated_power_follows_this_process_cpu_time() -> None:
    meter = PowerMeter(WorkerContext(power_source="estimated", idle_w=2.0, max_w=6.0), cpu_seconds=time.process_time)
    meter.cores = 1.0
    assert meter.idle_w() == 2.0 and meter.label == "estimated"
    meter.start()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # one core busy
        pass
    busy = meter.stop()
    meter.start()
    time.sleep(0.2)  # idling is what is measured here, not a synchronisation
    idle = meter.stop()
    assert 2.0 <= idle < 2.5 and 3.0 < busy <= 6.0  # (a loaded test machine may give the loop less than a core)


def test_the_estimated_power_counts_the_whole_cgroup_of_the_agent(tmp_path: Path, monkeypatch) -> None:
    """The board's telemetry estimates from its cgroup's CPU: the kernel's network work, the agent's
    own threads. The profile's meter reads the same counter (a cgroup v1 tree laid out here)."""
    group = tmp_path / "cpu,cpuacct" / "board"
    group.mkdir(parents=True)
    (group / "cpuacct.usage").write_text("0\n")
    (group / "cpu.cfs_quota_us").write_text("50000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu,cpuacct:/board\n")
    from edgefleet.agent.sensors import cgroup_cpu

    real = cgroup_cpu.CgroupCpuSource
    monkeypatch.setattr("edgefleet.agent.board_resources.CgroupCpuSource",
                        lambda: real(cgroup_root=tmp_path, proc_self_cgroup=proc, cpu_count=2))
    meter = PowerMeter(WorkerContext(power_source="estimated", idle_w=2.0, max_w=6.0))
    assert meter.cores == 0.5  # the group's quota
    meter.start()
    started = time.perf_counter()
    (group / "cpuacct.usage").write_text(f"{int(0.25 * 1e9)}\n")  # the group used 0.25 s of CPU ...
    time.sleep(0.5)  # ... over about half a second: the window the meter measures, not a synchronisation
    watts, wall = meter.stop(), time.perf_counter() - started
    assert watts == pytest.approx(2.0 + 4.0 * min(1.0, 0.25 / (wall * 0.5)), rel=0.05)
    assert watts > 5.0  # about the whole quota, though this process spent none of its CPU


@pytest.fixture
def probe_server() -> Iterator[tuple[LinkProbeServer, int, asyncio.AbstractEventLoop]]:
    """The coordinator's real probe server on its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[LinkProbeServer, int]:
        server = LinkProbeServer(job_id="p-0", token=TOKEN, boards=["b1", "b2"])
        return server, await server.start("127.0.0.1")

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    try:
        yield server, port, loop
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_two_boards_probe_their_links_one_at_a_time_then_together(probe_server) -> None:
    server, port, _ = probe_server
    results: dict[str, Any] = {}

    def board(board_id: str) -> None:
        meter = PowerMeter(WorkerContext(power_source="estimated", idle_w=2.0, max_w=10.0)) if board_id == "b1" else None
        results[board_id] = probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-0", board_id=board_id,
                                       nbytes=2_000_000, round_bytes=250_000, rounds=6, meter=meter)

    threads = [threading.Thread(target=board, args=(b,)) for b in ("b1", "b2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == {"b1", "b2"}
    for probed in results.values():
        assert probed.bulk.up_bytes_per_s > 1e6 and probed.bulk.down_bytes_per_s > 1e6  # loopback: well above 1 MB/s
        assert probed.rounds.round_bytes == 250_000 and probed.rounds.rounds == 5  # the first round is not timed
        assert 0 < probed.rounds.round_s < 1.0
    assert server.aggregate_bytes_per_s is not None and server.aggregate_bytes_per_s > 1e6
    # b1's meter ran over its own transfers only: moving bytes costs CPU, so above idle
    assert 2.0 < results["b1"].bulk.power_w <= 10.0 and results["b2"].bulk.power_w is None
    assert 2.0 < results["b1"].rounds.power_w <= 10.0 and results["b2"].rounds.power_w is None


def test_a_later_variant_times_only_its_own_gradient_and_stops_early_on_a_slow_link(probe_server, monkeypatch) -> None:
    server, port, _ = probe_server
    server.drop("b2")
    first = probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-0", board_id="b1", nbytes=100_000,
                       round_bytes=1000, rounds=3)
    assert first.bulk is not None and first.rounds is not None and first.rounds.rounds == 2
    monkeypatch.setattr("edgefleet.agent.link_probe.ROUND_BUDGET_S", 0.0)  # every round is "slow": stop at the minimum
    later = probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-1", board_id="b1", nbytes=0,
                       round_bytes=40_000, rounds=50)
    assert later.bulk is None and later.rounds is not None
    assert later.rounds.round_bytes == 40_000 and later.rounds.rounds == 4  # MIN_TIMED_ROUNDS


def test_a_wrong_token_or_an_unreachable_endpoint_is_a_clear_error(probe_server) -> None:
    _, port, _ = probe_server
    with pytest.raises(ProfileError, match="refused the link probe: wrong profile job or token"):
        probe_link(host="127.0.0.1", port=port, token="x" * 32, job_id="p-0", board_id="b1", nbytes=1000)
    with pytest.raises(ProfileError, match="not part of this profile"):
        probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-0", board_id="stranger", nbytes=1000)
    with pytest.raises(ProfileError, match="cannot reach the coordinator's link probe at 127.0.0.1:9"):
        probe_link(host="127.0.0.1", port=9, token=TOKEN, job_id="p-0", board_id="b1", nbytes=1000)
    with pytest.raises(ProfileError, match="wrong profile job or token"):  # another profile's job
        probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="q-1", board_id="b1", nbytes=1000)
    with pytest.raises(ProfileError, match="more than 0 exactly when round_bytes is"):
        probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-0", board_id="b1", nbytes=1000, rounds=3)
    with pytest.raises(ProfileError, match="1 round times nothing"):
        probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-1", board_id="b1", nbytes=0, round_bytes=10,
                   rounds=1)
    with pytest.raises(ProfileError, match="nothing to measure"):
        probe_link(host="127.0.0.1", port=port, token=TOKEN, job_id="p-1", board_id="b1", nbytes=0)


def test_a_real_profile_reports_every_figure_in_one_finished_event() -> None:
    events = Events()
    assert run_profile(_job(), events, WorkerContext(power_source="estimated", idle_w=2.7, max_w=6.4)) == 0
    phases = [e["phase"] for e in events.lines]
    assert phases[0] == "running" and phases[-1] == "finished" and phases.count("progress") == 3
    assert events.lines[3]["message"].startswith("per-layer timing: 12 pipeline units at batch sizes 4 and 8 in ")
    data = events.lines[-1]["data"]
    report = ProfileReport.from_wire(JobEvent.from_msgpack(JobEvent(job_id="p-0", board_id="b1", phase="finished",
                                                                    data=data).to_msgpack()).data)
    assert report.to_wire() == data and report.v == PROFILE_REPORT_VERSION
    assert [p.batch_size for p in report.points] == [4, 8]  # ascending
    for point in report.points:
        assert 0 < point.step_time_min_s <= point.step_time_s <= point.step_time_max_s
        assert 0 <= point.step_time_spread_s <= point.step_time_max_s - point.step_time_min_s
        assert point.peak_memory_bytes > 10_000_000 and 2.7 <= point.power_w <= 6.4
    assert report.power_source == "estimated" and report.idle_power_w == 2.7
    assert report.memory_total_bytes > 0 and report.link is None and report.worker_pid == os.getpid()
    assert report.torch_threads == 1 and report.param_count > 0 and report.agent_version
    # LeNet-5's twelve pipeline units, their parameters adding up to the model's
    assert [u.name for u in report.units] == [f"net.{i}" for i in range(12)]
    assert sum(u.param_bytes for u in report.units) == 4 * report.param_count
    assert len(json.dumps(data)) < 12_000


@pytest.mark.parametrize("timed_steps, budget_s, timed", [
    (20, 1e-6, 5),   # a budget spent at once: the fewest steps a budget allows
    (3, 1e-6, 3),    # fewer steps asked than that fewest: all of them
    (6, 3600.0, 6),  # a budget never reached: every step asked for
])
def test_a_timed_budget_ends_each_batch_size_after_the_fewest_steps_it_allows(timed_steps: int, budget_s: float,
                                                                             timed: int) -> None:
    events = Events()
    job = _job(timed_steps=timed_steps, timed_budget_s=budget_s)
    assert run_profile(job, events, WorkerContext(power_source="estimated", idle_w=2.7, max_w=6.4)) == 0
    batches = [e["message"] for e in events.lines if e["message"].startswith("batch ")]
    assert len(batches) == 2
    for message in batches:
        assert (f"({timed} of {timed_steps} steps timed: {budget_s:g} s budget)" in message) == (timed < timed_steps)
    report = ProfileReport.from_wire(events.lines[-1]["data"])
    assert all(0 < p.step_time_s and 2.7 <= p.power_w <= 6.4 for p in report.points)


def test_an_unknown_model_is_a_config_error_naming_what_exists() -> None:
    with pytest.raises(ConfigError, match="no-such-model.*lenet5"):
        run_profile(_job(model="no-such-model"), Events(), WorkerContext())


def test_one_worker_process_runs_jobs_until_its_input_ends() -> None:
    context = WorkerContext(power_source="estimated")
    worker = subprocess.Popen([sys.executable, "-m", "edgefleet.agent.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        assert worker.stdin is not None and worker.stdout is not None
        finished = []
        for job_id in ("p-0", "p-1"):
            worker.stdin.write(job_line(_job(job_id=job_id, batch_sizes=[2, 4], timed_steps=2), context))
            worker.stdin.flush()
            for line in worker.stdout:  # blocks until the job's last event
                event = json.loads(line)
                if event["phase"] in ("finished", "failed"):
                    finished.append(event)
                    break
        assert [e["phase"] for e in finished] == ["finished", "finished"], finished
        assert finished[0]["data"]["worker_pid"] == finished[1]["data"]["worker_pid"] == worker.pid
        worker.stdin.write(job_line(_job(job_id="p-2", model="no-such-model"), context))
        worker.stdin.close()
        events = [json.loads(line) for line in worker.stdout]
        assert events[-1]["phase"] == "failed" and "no-such-model" in events[-1]["message"]
        assert worker.wait(timeout=30) == 3  # a failed job ends the worker: the next one gets a fresh process
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_job_sent_while_the_last_worker_exits_starts_when_it_has_exited() -> None:
    events: list[Any] = []
    busy: list[bool] = []
    runner = JobRunner(board_id="b1", verify=json.loads, publish_event=events.append,
                       set_busy=busy.append)
    try:
        runner.handle(json.dumps(_job(job_id="j-0", batch_sizes=[2, 4], timed_steps=2).to_dict()).encode())
        wait_until(lambda: any(e.phase == "finished" for e in events), timeout_s=60, what="the first job to finish")
        runner.handle(json.dumps(_job(job_id="j-1", batch_sizes=[2, 4], timed_steps=2).to_dict()).encode())
        wait_until(lambda: [e for e in events if e.job_id == "j-1" and e.phase in ("finished", "failed")],
                   timeout_s=60, what="the second job to end")
        wait_until(lambda: not runner.busy, timeout_s=30, what="the runner to be idle")
    finally:
        runner.stop()
    phases = [(e.job_id, e.phase) for e in events if e.phase in ("accepted", "rejected", "finished", "failed")]
    assert phases == [("j-0", "accepted"), ("j-0", "finished"), ("j-1", "accepted"), ("j-1", "finished")]
    pids = [e.data["worker_pid"] for e in events if e.phase == "finished"]
    assert pids[0] != pids[1]  # one worker per job by default
    assert busy[0] is True and busy[-1] is False
