"""GPU, throttling and disk telemetry against recorded real outputs (tests/fixtures/telemetry/SOURCES.md),
the new sample fields on the wire, and job events' JSON copy from a real agent."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.agent.job_runner import MAX_EVENT_JSON_BYTES, ProgressLimiter, event_json
from edgefleet.agent.sensors import Sampler
from edgefleet.agent.sensors.disk import DiskSource
from edgefleet.agent.sensors.gpu_jetson import JetsonGpuSource, find_gpu_load_file, parse_gpu_load, parse_jtop_gpu
from edgefleet.agent.sensors.power_rpi5_pmic import parse_throttled
from edgefleet.agent.sensors.throttling import ThrottlingSource, throttle_fields
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import OMITTED_WHEN_NONE, TelemetrySample
from edgefleet.protocol.signing import sign_command
from edgefleet.protocol.topics import events_json_topic, parse_board_topic, telemetry_topic
from tests.board_watch import PREFIX, BoardWatch
from tests.conftest import AgentFactory
from tests.helpers import wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "telemetry"
JTOP_ORIN_NANO = json.loads((FIXTURES / "jtop_gpu_memory_orin_nano.json").read_text())
KIB = 1024

# Jetson Orin Nano, JetPack 6: the iGPU's devfreq entry and device (jtop's 4.8 % is this load of 48).
_ORIN_GPU = "devices/platform/bus@0/17000000.gpu"
ORIN_NANO_DEVFREQ = {
    f"{_ORIN_GPU}/of_node/name": "gpu\0",
    f"{_ORIN_GPU}/load": "48\n",
    f"{_ORIN_GPU}/railgate_enable": "1\n",
    "class/devfreq/17000000.gpu/cur_freq": "306000000\n",
    # Another devfreq device (the memory controller's) that is not a GPU.
    "devices/platform/bwmgr/of_node/name": "bwmgr\0",
    "devices/platform/bwmgr/load": "999\n",
}
_LINKS = {"class/devfreq/17000000.gpu/device": _ORIN_GPU, "class/devfreq/bwmgr/device": "devices/platform/bwmgr"}

# (fixture, throttled_bits, conditions now, conditions since boot)
THROTTLED = [
    ("get_throttled_rpi3bplus.txt", 0x50005, {"under_voltage", "throttled"}, {"under_voltage", "throttled"}),
    ("get_throttled_rpi5_weak_supply.txt", 0x50000, set(), {"under_voltage", "throttled"}),
    ("get_throttled_rpi5_hot.txt", 0xE0000, set(), {"freq_capped", "throttled", "soft_temp_limit"}),
    ("get_throttled_rpi5_cooled.txt", 0, set(), set()),
]
CONDITIONS = ("under_voltage", "freq_capped", "throttled", "soft_temp_limit")


def _tree(root: Path, files: dict[str, str], links: dict[str, str] | None = None) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for rel, target in (links or {}).items():
        link = root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / target, link.parent))  # relative, as sysfs links are
    return root


class _GenericInterface:
    """jtop's ``gpu``/``memory`` objects are dict-like (items/get/[]), not dicts: the parser must take either."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def items(self) -> Any:
        return self._data.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)


class _JtopClient:
    def __init__(self, gpu: Any, memory: Any) -> None:
        self.gpu, self.memory = gpu, memory


# --- Jetson GPU -----------------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", [dict, _GenericInterface], ids=["dict", "jtop-object"])
def test_jtop_gpu_and_memory_of_an_orin_nano(wrap: Any) -> None:
    fields = parse_jtop_gpu(wrap(JTOP_ORIN_NANO["gpu"]), wrap(JTOP_ORIN_NANO["memory"]))
    assert fields == {"gpu_load_percent": 4.8, "gpu_mem_used_bytes": 36904 * KIB, "gpu_mem_total_bytes": 3688892 * KIB}


@pytest.mark.parametrize("gpu, memory, total", [
    (None, None, None), ({}, {}, None), ({"gpu": {"type": "integrated", "status": {"load": "x"}}}, {"RAM": {}}, None),
    ({"gpu": {"type": "integrated", "status": {"load": 250.0}}}, {"RAM": {"tot": 10, "shared": 20}}, 10 * KIB),  # used > total
])
def test_jtop_gpu_garbage_gives_none_never_raises(gpu: Any, memory: Any, total: int | None) -> None:
    assert parse_jtop_gpu(gpu, memory) == {"gpu_load_percent": None, "gpu_mem_used_bytes": None, "gpu_mem_total_bytes": total}


def test_sysfs_gpu_load_of_an_orin_nano_is_found_as_jtop_finds_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, ORIN_NANO_DEVFREQ, _LINKS)
    load_file = find_gpu_load_file(root)
    assert load_file is not None and load_file.resolve() == (root / _ORIN_GPU / "load").resolve()
    source = JetsonGpuSource(root)
    assert source.available()
    assert source.read() == {"gpu_load_percent": 4.8, "gpu_mem_used_bytes": None, "gpu_mem_total_bytes": None}


def test_sysfs_gpu_load_on_the_older_nano_path(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"devices/gpu.0/load": "48\n"})
    source = JetsonGpuSource(root)
    assert source.available() and source.read()["gpu_load_percent"] == 4.8


def test_jtop_client_wins_and_sysfs_fills_a_missing_load(tmp_path: Path) -> None:
    root = _tree(tmp_path, ORIN_NANO_DEVFREQ, _LINKS)
    client = _JtopClient(_GenericInterface(JTOP_ORIN_NANO["gpu"]), _GenericInterface(JTOP_ORIN_NANO["memory"]))
    assert JetsonGpuSource(root, jtop_client=lambda: client).read()["gpu_mem_used_bytes"] == 36904 * KIB
    no_load = _JtopClient({}, JTOP_ORIN_NANO["memory"])
    source = JetsonGpuSource(root, jtop_client=lambda: no_load)
    assert source.available()
    assert source.read() == {"gpu_load_percent": 4.8, "gpu_mem_used_bytes": 36904 * KIB, "gpu_mem_total_bytes": 3688892 * KIB}


def test_no_gpu_means_no_source_and_a_vanished_file_means_none(tmp_path: Path) -> None:
    assert not JetsonGpuSource(_tree(tmp_path / "x86", {"class/devfreq/.keep": ""})).available()
    root = _tree(tmp_path / "orin", ORIN_NANO_DEVFREQ, _LINKS)
    source = JetsonGpuSource(root)
    assert source.available()
    (root / _ORIN_GPU / "load").unlink()  # a GPU driver unloaded under us
    assert source.read()["gpu_load_percent"] is None


@pytest.mark.parametrize("text, percent", [("48\n", 4.8), ("0", 0.0), ("1000", 100.0), ("1001", None), ("-1", None), ("", None)])
def test_gpu_load_file_is_tenths_of_a_percent(text: str, percent: float | None) -> None:
    assert parse_gpu_load(text) == percent


# --- Raspberry Pi throttling ----------------------------------------------------------------------

@pytest.mark.parametrize("fixture, bits, now, since_boot", THROTTLED, ids=[t[0] for t in THROTTLED])
def test_throttled_flags_of_real_pis(fixture: str, bits: int, now: set[str], since_boot: set[str]) -> None:
    text = (FIXTURES / fixture).read_text()
    fields = throttle_fields(parse_throttled(text))
    assert fields["throttled_bits"] == bits
    assert {c for c in CONDITIONS if fields[f"{c}_now"]} == now
    assert {c for c in CONDITIONS if fields[f"{c}_since_boot"]} == since_boot
    TelemetrySample(board_id="pi", ts=1.0, seq=1, interval_s=1.0, **fields)  # every field is a sample field


def test_throttling_source_runs_vcgencmd_at_most_once_a_second() -> None:
    calls: list[tuple[str, ...]] = []
    now = [100.0]

    def vcgencmd(*args: str) -> str:
        calls.append(args)
        return (FIXTURES / "get_throttled_rpi3bplus.txt").read_text()

    source = ThrottlingSource(run=vcgencmd, clock=lambda: now[0])
    assert source.available()
    for _ in range(5):  # a 0.05 s telemetry interval must not fork vcgencmd 20 times a second
        assert source.read()["under_voltage_now"] is True
    assert calls == [("get_throttled",)]
    now[0] += 1.0
    source.read()
    assert len(calls) == 2


@pytest.mark.parametrize("answer", [None, 'error=1 error_msg="Command not registered"'])
def test_no_vcgencmd_means_no_throttling_source(answer: str | None) -> None:
    assert not ThrottlingSource(run=lambda *_: answer).available()
    assert throttle_fields(None) == dict.fromkeys(throttle_fields(None), None)


# --- disks ----------------------------------------------------------------------------------------

def test_disk_usage_of_the_data_and_run_folders(tmp_path: Path) -> None:
    fields = DiskSource({"data": tmp_path, "run": Path.cwd()}).read()
    usage = shutil.disk_usage(tmp_path)
    assert fields["disk_data_total_bytes"] == usage.total
    assert 0 < fields["disk_data_used_bytes"] <= fields["disk_data_total_bytes"]
    assert fields["disk_run_total_bytes"] == shutil.disk_usage(Path.cwd()).total


def test_a_missing_folder_gives_none_and_no_folder_no_source(tmp_path: Path) -> None:
    assert DiskSource({"data": tmp_path / "gone"}).read() == {"disk_data_used_bytes": None, "disk_data_total_bytes": None}
    assert not DiskSource({}).available()
    with pytest.raises(ValueError, match="unknown disk folders"):
        DiskSource({"cache": tmp_path})


def test_the_sampler_reports_a_jetson_gpu_and_the_disks(tmp_path: Path) -> None:
    root = _tree(tmp_path / "sys", ORIN_NANO_DEVFREQ, _LINKS)
    sampler = Sampler(board_id="orin-1", interval_s=1.0, sysfs_root=root, net_interfaces=(), power_kind="none",
                      idle_w=2.7, max_w=6.4, disk_folders={"data": tmp_path, "run": tmp_path})
    sample = sampler.read()
    assert sample.gpu_load_percent == 4.8
    assert sample.disk_data_total_bytes == shutil.disk_usage(tmp_path).total
    assert TelemetrySample.from_json(sample.to_json()) == sample


# --- the sample on the wire -----------------------------------------------------------------------

def _sample(**fields: Any) -> TelemetrySample:
    return TelemetrySample(board_id="pi-1", ts=1_700_000_000.0, seq=3, interval_s=1.0, **fields)


def test_new_fields_round_trip_and_are_left_out_when_none() -> None:
    rich = _sample(gpu_load_percent=4.8, gpu_mem_used_bytes=1, gpu_mem_total_bytes=2, disk_run_used_bytes=5,
                   disk_run_total_bytes=9, **throttle_fields(parse_throttled("throttled=0x50005")))
    assert TelemetrySample.from_json(rich.to_json()) == rich
    plain = json.loads(_sample().to_json())
    assert not set(OMITTED_WHEN_NONE) & set(plain)
    assert "power_w" in plain  # the first release's fields stay, null or not


@pytest.mark.parametrize("field, value, fragment", [
    ("gpu_load_percent", 100.5, "outside what a board can report"),
    ("throttled_bits", -1, "outside what a board can report"),
    ("throttled_bits", 1 << 32, "outside what a board can report"),
    ("under_voltage_now", 1, "should be bool"),
    ("disk_data_used_bytes", 1 << 61, "outside what a board can report"),
])
def test_impossible_new_values_are_refused_naming_the_field(field: str, value: Any, fragment: str) -> None:
    payload = json.loads(_sample().to_json()) | {field: value}
    with pytest.raises(DecodeError, match=field) as info:
        TelemetrySample.from_json(json.dumps(payload))
    assert fragment in str(info.value)


@pytest.mark.parametrize("used, total", [("gpu_mem_used_bytes", "gpu_mem_total_bytes"), ("disk_run_used_bytes", "disk_run_total_bytes")])
def test_used_above_total_is_refused(used: str, total: str) -> None:
    payload = json.loads(_sample().to_json()) | {used: 10, total: 5}
    with pytest.raises(DecodeError, match=f"{used}.*more than {total}"):
        TelemetrySample.from_json(json.dumps(payload))


# --- job events as JSON ---------------------------------------------------------------------------

def test_event_json_is_strict_json_and_bounded() -> None:
    event = JobEvent(job_id="j", board_id="pi-1", phase="progress", step=7, loss=math.nan, ts=1.5)
    assert json.loads(event_json(event)) == {"job_id": "j", "board_id": "pi-1", "phase": "progress", "message": "",
                                             "step": 7, "loss": None, "compute_s": None, "ts": 1.5, "data": None,
                                             "schema_version": 1}
    big = JobEvent(job_id="j", board_id="pi-1", phase="finished", data={"x": ["y" * 100] * 400})
    decoded = json.loads(event_json(big))
    assert len(event_json(big)) <= MAX_EVENT_JSON_BYTES and decoded["data"] is None and decoded["data_omitted"] is True


def test_progress_is_rate_limited_per_job_and_other_phases_never() -> None:
    now = [0.0]
    limiter = ProgressLimiter(interval_s=1.0, clock=lambda: now[0])

    def event(job: str, phase: str = "progress") -> JobEvent:
        return JobEvent(job_id=job, board_id="b", phase=phase)

    assert [limiter.allow(event("a")) for _ in range(3)] == [True, False, False]
    assert limiter.allow(event("a", "finished")) and limiter.allow(event("b"))  # a new job's first progress passes
    now[0] = 1.0
    assert limiter.allow(event("b"))


def test_a_real_agent_publishes_events_as_json_and_disk_telemetry(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    board = "jsonev-1"
    got: dict[str, list[bytes]] = {"events": [], "telemetry": [], "discovery": []}
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="test-json-events")
    sub.on_connect = lambda c, *_: c.subscribe([(events_json_topic(PREFIX, board), 1), (telemetry_topic(PREFIX, board), 0),
                                                (f"homeassistant/+/{board}/#", 1)])
    sub.on_message = lambda c, u, m: got[("discovery" if m.topic.startswith("homeassistant/") else
                                          "events" if m.topic.endswith("/json") else "telemetry")].append(m.payload)
    sub.connect(mosquitto.host, mosquitto.port)
    sub.loop_start()
    agents.start(board, mosquitto.address, config=f'board_id = "{board}"\n[telemetry]\ninterval_s = 0.2\n')
    watch = BoardWatch(mosquitto, board)
    try:
        watch.wait_state("online")
        # A command this board (no fleet key) must refuse: it answers with a "rejected" event.
        watch.publish(sign_command({"kind": "stop", "job_id": "job-j1", "board_id": board}, key=b"k" * 32))
        wait_until(lambda: watch.events and got["events"], timeout_s=20, what="the event and its JSON copy")
        copy = json.loads(got["events"][0])
        assert (copy["phase"], copy["job_id"], copy["board_id"]) == ("rejected", "job-j1", board)
        assert copy["message"] == watch.events[0].message and "fleet key" in copy["message"]
        assert parse_board_topic(PREFIX, events_json_topic(PREFIX, board)) is None  # never mistaken for a board kind
        sample = TelemetrySample.from_json(wait_until(lambda: got["telemetry"][-1:], timeout_s=10, what="telemetry")[0])
        assert sample.disk_run_total_bytes == shutil.disk_usage(Path.cwd()).total  # the agent runs in the test's cwd
        assert got["discovery"] == []  # Home Assistant discovery is opt-in
    finally:
        watch.close()
        sub.disconnect()
        sub.loop_stop()
