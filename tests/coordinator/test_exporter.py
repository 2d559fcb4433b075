"""``edge-coordinator exporter`` and ``train --metrics-listen``: the fleet and a run as Prometheus metrics.

The end-to-end test publishes telemetry as agents do on a real Mosquitto, runs the real CLI, and
has a real Prometheus (Debian's ``prometheus`` package) scrape it and answer through its query API.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from edgefleet.brokers.local_broker import LocalBroker, free_port
from edgefleet.coordinator.cli.train import served_metrics
from edgefleet.coordinator.cli.train_progress import TrainProgress
from edgefleet.coordinator.control.fleet import FleetView
from edgefleet.coordinator.exporter.fleet_collector import counting_collector
from edgefleet.coordinator.exporter.metrics_server import serve_fleet_metrics, serve_metrics
from edgefleet.coordinator.exporter.telemetry_metrics import NAMED_FIELDS, sample_values
from edgefleet.coordinator.exporter.training_metrics import TrainingMetrics
from edgefleet.coordinator.run.job_spec import JobSpec
from edgefleet.coordinator.run.training import StepView
from edgefleet.protocol.address import HostPort
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.topics import caps_topic, status_topic, telemetry_topic
from edgefleet.transport.settings import BrokerSettings
from tests.helpers import wait_until

Samples = dict[str, list[tuple[dict[str, str], float]]]  # metric name -> [(labels, value)]

# (board id, power source, watts, state): a measured Pi, a Jetson, and an x86 box whose power is modelled.
BOARDS = (("pi-1", "rpi5-pmic", 4.25, "online"), ("orin-1", "jtop", 11.5, "busy"), ("nuc-1", "estimated", 17.0, "online"))


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    found = [v for got, v in samples.get(metric, []) if all(got.get(k) == w for k, w in labels.items())]
    assert len(found) <= 1, f"{metric}{labels}: {found}"
    return found[0] if found else None


def sample(board_id: str, power_source: str, power_w: float, *, interval_s: float = 60.0, seq: int = 1) -> TelemetrySample:
    return TelemetrySample(board_id=board_id, ts=time.time(), seq=seq, interval_s=interval_s, cpu_percent=37.5,
                           mem_total_bytes=8 << 30, mem_used_bytes=2 << 30, mem_percent=25.0, net_rx_bytes_per_s=1250.0,
                           net_tx_bytes_per_s=300.0, temp_c=51.5, temps_c={"cpu-thermal": 51.5, "gpu-thermal": 48.0},
                           power_w=power_w, power_source=power_source, power_rails_w={"VDD_IN": power_w})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_collector_renders_the_fresh_boards_of_a_snapshot() -> None:
    # Prepare: three fresh boards, one that went stale, one offline.
    clock, prefix = Clock(), "edgefleet/v1"
    view = FleetView(prefix, clock=clock)
    registry = CollectorRegistry()
    registry.register(counting_collector(view))  # its counters follow the samples from here on
    extra = {"pi-1": {"under_voltage_now": True, "throttled_now": False}, "orin-1": {"gpu_load_percent": 40.0}}
    for board_id, source, watts, state in BOARDS:
        view.ingest(status_topic(prefix, board_id), BoardStatus(state=state, interval_s=60.0).to_json(), True)
        reading = dataclasses.replace(sample(board_id, source, watts), **extra.get(board_id, {}))
        view.ingest(telemetry_topic(prefix, board_id), reading.to_json())
    view.ingest(caps_topic(prefix, "pi-1"), BoardCaps(board_id="pi-1", hostname="pi-1", model="Raspberry Pi 5 Model B",
                                                      machine="aarch64", cores=4, ram_bytes=8 << 30).to_json(), True)
    view.ingest(telemetry_topic(prefix, "pi-stale"), sample("pi-stale", "rpi5-pmic", 3.0, interval_s=1.0).to_json())
    view.ingest(status_topic(prefix, "pi-off"), BoardStatus(state="offline", reason="connection lost").to_json(), True)
    clock.now += 3.5  # pi-stale's sample is older than 3 of its 1 s intervals; the others' interval is 60 s

    # Execute
    got = parse(generate_latest(registry).decode())

    # Assert: the fresh boards with every figure, in Prometheus' base units; the others only counted.
    for board_id, source, watts, state in BOARDS:
        labels = {"board_id": board_id}
        assert value(got, "edgefleet_board_power_watts", **labels) == watts
        assert value(got, "edgefleet_board_power_info", **labels, power_source=source) == 1.0
        measured = source != "estimated"
        assert value(got, "edgefleet_board_power_measured", **labels) == (1.0 if measured else 0.0)
        assert value(got, "edgefleet_board_state", **labels, state=state) == 1.0
        assert value(got, "edgefleet_board_state", **labels, state="online" if state == "busy" else "busy") == 0.0
        # Rates are counters: a board's first sample counts one interval (60 s).
        busy = value(got, "edgefleet_board_cpu_seconds_total", **labels, mode="busy")
        idle = value(got, "edgefleet_board_cpu_seconds_total", **labels, mode="idle")
        assert busy is not None and idle is not None and busy / (busy + idle) == pytest.approx(0.375)
        assert value(got, "edgefleet_board_network_receive_bytes_total", **labels) == pytest.approx(1250.0 * 60)
        assert value(got, "edgefleet_board_network_transmit_bytes_total", **labels) == pytest.approx(300.0 * 60)
        assert value(got, "edgefleet_board_energy_joules_total", **labels,
                     source="measured" if measured else "estimated") == pytest.approx(watts * 60)
        assert value(got, "edgefleet_board_energy_joules_total", **labels, source="estimated" if measured else "measured") is None
        assert value(got, "edgefleet_board_memory_used_bytes", **labels) == 2 << 30
        assert value(got, "edgefleet_board_temperature_celsius", **labels) == 51.5
        assert value(got, "edgefleet_board_sensor_temperature_celsius", **labels, sensor="gpu-thermal") == 48.0
        assert value(got, "edgefleet_board_sample_age_seconds", **labels) == pytest.approx(3.5)
    assert value(got, "edgefleet_board_info", board_id="pi-1", model="Raspberry Pi 5 Model B", machine="aarch64") == 1.0
    assert value(got, "edgefleet_board_under_voltage_now", board_id="pi-1") == 1.0
    assert value(got, "edgefleet_board_throttled_now", board_id="pi-1") == 0.0
    assert value(got, "edgefleet_board_gpu_utilization_ratio", board_id="orin-1") == pytest.approx(0.4)
    assert [labels["board_id"] for labels, _ in got["edgefleet_board_gpu_utilization_ratio"]] == ["orin-1"]  # None: no series
    for gone in ("pi-stale", "pi-off"):
        assert not [s for series in got.values() for s in series if s[0].get("board_id") == gone]
    assert value(got, "edgefleet_fleet_boards", health="ok") == 3
    assert value(got, "edgefleet_fleet_boards", health="stale") == 1
    assert value(got, "edgefleet_fleet_boards", health="offline") == 1
    assert value(got, "edgefleet_fleet_messages_total") == 9
    # Rates are not gauges, and power_source labels one series per board, not every series.
    assert not [name for name in got if name.endswith("_per_second") or name.startswith("edgefleet_board_cpu_utilization")]
    assert {name for name, series in got.items() for labels, _ in series if "power_source" in labels} == \
        {"edgefleet_board_power_info"}


@dataclass(frozen=True)
class FutureSample:
    """Telemetry with fields the agent does not send yet: they must be exported without a code change."""

    board_id: str = "orin-1"
    npu_load_percent: float | None = 62.0
    npu_mem_used_bytes: int | None = 1 << 30
    npu_freq_mhz: float | None = None          # not reported by this board: no series at all
    fan_stalled: bool = True
    lid_open: bool = False
    disk_used_bytes: dict[str, int] = field(default_factory=lambda: {"/var/lib/edge-agent": 4096})
    throttle_flags: list[str] = field(default_factory=lambda: ["soft-temp-limit"])  # not numeric: skipped
    power_w: float | None = 9.5


def test_new_optional_telemetry_fields_are_exported_by_their_unit_suffix() -> None:
    got = {(v.metric.name, v.key): v.value for v in sample_values(FutureSample())}
    assert got == {("edgefleet_board_npu_load_ratio", None): pytest.approx(0.62),
                   ("edgefleet_board_npu_mem_used_bytes", None): 1 << 30,
                   ("edgefleet_board_fan_stalled", None): 1.0,
                   ("edgefleet_board_lid_open", None): 0.0,
                   ("edgefleet_board_disk_used_bytes", "/var/lib/edge-agent"): 4096,
                   ("edgefleet_board_power_watts", None): 9.5}


def test_every_named_field_is_a_telemetry_field() -> None:
    # A renamed field would otherwise lose its name and help text silently (it would still be exported, derived).
    assert set(NAMED_FIELDS) <= {f.name for f in dataclasses.fields(TelemetrySample)}


def test_training_figures_follow_the_progress_display() -> None:
    # Prepare: the display the train command uses, with the metrics attached as --metrics-listen does.
    clock = Clock()
    metrics = TrainingMetrics(clock=clock)
    display = TrainProgress(Console(file=io.StringIO()), metrics=metrics)
    registry = CollectorRegistry()
    registry.register(metrics)
    spec = JobSpec(model="mlp", dataset="synthetic", run_id="mlp-synthetic-1", total_steps=20)

    # Execute: two steps 0.25 s apart, pi-2 late in the second.
    display.started(spec, Path("runs/x"), 0)
    for step, late in ((0, []), (1, ["pi-2"])):
        clock.now += 0.25
        display.step(StepView(step=step, total_steps=20, loss=0.5 - 0.1 * step, val_accuracy=None, samples_per_s=640.0,
                              board_compute_s={"pi-1": 0.08, "pi-2": 0.2}, late=late, refused={},
                              batch_sizes={"pi-1": 32, "pi-2": 16}, shown={"train_acc": 0.7}))
    display.stopped()
    got = parse(generate_latest(registry).decode())

    # Assert: counters for what accumulates, histograms for times (the first step's, with the boards' start, left out).
    run = {"run_id": "mlp-synthetic-1"}
    assert value(got, "edgefleet_train_completed_steps_total", **run) == 2
    assert value(got, "edgefleet_train_step_seconds_count", **run) == 1
    assert value(got, "edgefleet_train_step_seconds_sum", **run) == pytest.approx(0.25)
    assert value(got, "edgefleet_train_step_seconds_bucket", **run, le="0.25") == 1
    assert value(got, "edgefleet_train_step_seconds_bucket", **run, le="0.1") == 0
    assert value(got, "edgefleet_train_samples_per_second", **run) == 640.0
    assert value(got, "edgefleet_train_loss", **run) == pytest.approx(0.4)
    assert value(got, "edgefleet_train_board_compute_seconds_count", **run, board_id="pi-2") == 2
    assert value(got, "edgefleet_train_board_compute_seconds_sum", **run, board_id="pi-2") == pytest.approx(0.4)
    assert value(got, "edgefleet_train_board_batch_size", **run, board_id="pi-1") == 32
    assert value(got, "edgefleet_train_board_late_steps_total", **run, board_id="pi-2") == 1
    assert value(got, "edgefleet_train_board_late_steps_total", **run, board_id="pi-1") == 0
    assert value(got, "edgefleet_train_late_steps_total", **run) == 1
    assert value(got, "edgefleet_train_dropped_steps_total", **run) == 1
    assert value(got, "edgefleet_train_logged_value", **run, name="train_acc") == 0.7
    assert value(got, "edgefleet_train_running", **run) == 0.0
    assert value(got, "edgefleet_train_validation_accuracy_ratio", **run) is None  # no evaluation yet


class Agents:
    """Publishes status, caps and telemetry for boards as edge-agent does (retained status and caps)."""

    def __init__(self, broker: LocalBroker, prefix: str) -> None:
        self.prefix = prefix
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-agents-{uuid.uuid4().hex[:8]}")
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def online(self, board_id: str, source: str, *, state: str = "online") -> None:
        caps = BoardCaps(board_id=board_id, hostname=board_id, model="test board", machine="aarch64", cores=4,
                         ram_bytes=8 << 30, power_source=source)
        self.publish(status_topic(self.prefix, board_id), BoardStatus(state=state, ts=time.time(), interval_s=60.0).to_json())
        self.publish(caps_topic(self.prefix, board_id), caps.to_json())

    def telemetry(self, board_id: str, source: str, watts: float, *, interval_s: float = 60.0) -> None:
        self.publish(telemetry_topic(self.prefix, board_id), sample(board_id, source, watts, interval_s=interval_s).to_json(),
                     retain=False)

    def offline(self, board_id: str) -> None:
        self.publish(status_topic(self.prefix, board_id), BoardStatus(state="offline", reason="stopped").to_json())

    def publish(self, topic: str, payload: bytes, *, retain: bool = True) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def prefix() -> str:
    """A topic prefix of this test's own: the session broker's retained boards of other tests stay out of view."""
    return f"exptest-{uuid.uuid4().hex[:8]}/v1"


@pytest.fixture
def agents(mosquitto: LocalBroker, prefix: str) -> Iterator[Agents]:
    publisher = Agents(mosquitto, prefix)
    try:
        yield publisher
    finally:
        publisher.close()


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as response:
        return parse(response.read().decode())


def get_json(url: str) -> dict[str, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return dict(json.loads(response.read()))
    except OSError:
        return {}


@dataclass
class Prometheus:
    """A real Prometheus server scraping one target every second."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        data = answer.get("data")
        return list(data.get("result", [])) if answer.get("status") == "success" and isinstance(data, dict) else []


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[list[Prometheus]]:
    """Started by the test once it knows its target; always stopped."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.fail("prometheus is not installed: apt-get install prometheus (or run .ci/run)")
    started: list[Prometheus] = []
    yield started
    for server in started:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=5)


def start_prometheus(started: list[Prometheus], tmp_path: Path, target: str) -> Prometheus:
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"scrape_configs:\n  - job_name: edgefleet\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([shutil.which("prometheus") or "/usr/bin/prometheus", f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log_file, stderr=subprocess.STDOUT, cwd=tmp_path)
    server = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    started.append(server)
    return server


def test_a_real_prometheus_scrapes_every_boards_power(mosquitto: LocalBroker, agents: Agents, prefix: str, tmp_path: Path,
                                                     prometheus_for: list[Prometheus]) -> None:
    # Prepare: three boards on the broker, and the exporter as the systemd unit runs it.
    for board_id, source, _, state in BOARDS:
        agents.online(board_id, source, state=state)
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[broker]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\ntopic_prefix = "{prefix}"\n')
    port = free_port()
    # Prometheus first: it takes up to 5 s to start scraping a new target, while the exporter starts.
    server = start_prometheus(prometheus_for, tmp_path, f"127.0.0.1:{port}")
    exporter = subprocess.Popen([sys.executable, "-m", "edgefleet.coordinator.cli", "--config", str(config), "exporter",
                                 "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics_url = f"http://127.0.0.1:{port}/metrics"

        def exporter_shows_every_board() -> bool:  # telemetry is not retained: the boards send it every interval
            assert exporter.poll() is None, exporter.communicate()
            for board_id, source, watts, _ in BOARDS:
                agents.telemetry(board_id, source, watts)
            try:
                got = scrape(metrics_url)
            except OSError:
                return False
            return all(value(got, "edgefleet_board_power_watts", board_id=b) is not None for b, *_ in BOARDS)

        wait_until(exporter_shows_every_board, timeout_s=10, what="the exporter to show every board")

        # Execute: Prometheus scrapes the exporter every second; ask its query API.
        def every_power_queried() -> list[dict[str, Any]]:
            assert server.proc.poll() is None, server.log_path.read_text()
            result = server.query('edgefleet_board_power_watts{job="edgefleet"}')
            return result if len(result) == len(BOARDS) else []

        result = wait_until(every_power_queried, timeout_s=15, interval_s=0.2, what="Prometheus to return every board's power")

        # Assert: each board's power with its board_id, and where the reading came from joined in from the info metric.
        got = {r["metric"]["board_id"]: float(r["value"][1]) for r in result}
        assert got == {board_id: watts for board_id, _, watts, _ in BOARDS}
        joined = server.query("edgefleet_board_power_watts * on(board_id) group_left(power_source) edgefleet_board_power_info")
        sources = {r["metric"]["board_id"]: r["metric"]["power_source"] for r in joined}
        assert sources == {board_id: source for board_id, source, _, _ in BOARDS}
        measured = {r["metric"]["board_id"]: r["value"][1] for r in server.query("edgefleet_board_power_measured")}
        assert measured == {"pi-1": "1", "orin-1": "1", "nuc-1": "0"}
    finally:
        exporter.send_signal(signal.SIGTERM)
        out, err = exporter.communicate(timeout=10)
    assert exporter.returncode == 0, err  # SIGTERM is a clean stop
    assert f"serving {metrics_url}" in out and "Traceback" not in err


def test_stale_and_offline_boards_drop_out_of_the_page(mosquitto: LocalBroker, agents: Agents, prefix: str) -> None:
    # Prepare: the exporter in-process, one board that stays, one that stops, one that goes quiet.
    settings = BrokerSettings(host=mosquitto.host, port=mosquitto.port, topic_prefix=prefix)
    agents.online("pi-1", "rpi5-pmic")
    agents.online("pi-2", "rpi5-pmic")
    with serve_fleet_metrics(settings, HostPort("127.0.0.1", 0)) as endpoint:
        def shown() -> set[str]:
            return {labels["board_id"] for labels, _ in scrape(endpoint.url).get("edgefleet_board_power_watts", [])}

        def quiet_board_seen() -> bool:  # pi-quiet's sample is stale 0.6 s after it is sent: send until one is seen fresh
            agents.telemetry("pi-1", "rpi5-pmic", 4.0)
            agents.telemetry("pi-2", "rpi5-pmic", 4.5)
            agents.telemetry("pi-quiet", "estimated", 2.0, interval_s=0.2)
            return shown() == {"pi-1", "pi-2", "pi-quiet"}

        wait_until(quiet_board_seen, timeout_s=10, what="three boards on the page")

        # Execute: pi-2 stops; pi-quiet sends nothing more.
        agents.offline("pi-2")

        # Assert
        wait_until(lambda: shown() == {"pi-1"}, timeout_s=10, what="pi-2 (offline) and pi-quiet (stale) to drop out")
        counts = scrape(endpoint.url)
        assert value(counts, "edgefleet_fleet_boards", health="offline") == 1
        assert value(counts, "edgefleet_fleet_boards", health="stale") == 1


def test_train_metrics_listen_serves_the_fleet_and_the_run(mosquitto: LocalBroker, prefix: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the flags `train --metrics-listen 127.0.0.1:0 --metrics-grace 20` give, with a config file naming the broker.
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[broker]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\ntopic_prefix = "{prefix}"\n')
    args = argparse.Namespace(config=config, broker=None, fleet_key=None, metrics_listen=HostPort("127.0.0.1", 0),
                              metrics_grace=20.0)
    spec = JobSpec(model="mlp", dataset="synthetic", run_id="mlp-synthetic-2", total_steps=5)
    seen_after: list[float] = []  # edgefleet_train_running as a scraper saw it once the run was over

    def scrape_until_closed(url: str) -> None:  # a Prometheus that scrapes as often as it can
        def closed() -> bool:
            try:
                running = value(scrape(url), "edgefleet_train_running", run_id="mlp-synthetic-2")
            except OSError:
                return True
            if running == 0.0:
                seen_after.append(running)
            return False

        wait_until(closed, timeout_s=30, interval_s=0.05, what="the page to close")

    # Execute: the run starts, a scraper follows it, the run ends.
    with served_metrics(args) as metrics:
        assert metrics is not None
        metrics.started(spec, tmp_path / "run", 0)
        url = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", capsys.readouterr().out)
        assert url, "train prints where its metrics are"
        got = scrape(url[1])
        scraper = threading.Thread(target=scrape_until_closed, args=(url[1],))
        scraper.start()
        metrics.stopped()
        ended = time.monotonic()
    lingered_s = time.monotonic() - ended
    scraper.join(timeout=30)

    # Assert: the run and the fleet on one page; the final state (running 0) stayed until two scrapes read it,
    # well before the 20 s grace was over.
    assert value(got, "edgefleet_train_running", run_id="mlp-synthetic-2") == 1.0
    assert value(got, "edgefleet_train_late_steps_total", run_id="mlp-synthetic-2") == 0  # there from the start
    assert value(got, "edgefleet_train_completed_steps_total", run_id="mlp-synthetic-2") == 0
    assert value(got, "edgefleet_fleet_boards", health="ok") == 0
    assert seen_after == [0.0, 0.0]
    assert lingered_s < 10


def test_the_final_state_is_served_for_the_grace_period_when_nobody_scrapes() -> None:
    metrics = TrainingMetrics()
    metrics.started(JobSpec(model="mlp", dataset="synthetic", run_id="r", total_steps=5), Path("runs/r"), 0)
    started = time.monotonic()
    assert metrics.linger(0.3) is False
    assert 0.3 <= time.monotonic() - started < 5
    assert TrainingMetrics().linger(30) is True  # no run, nothing to show: no wait


def test_an_address_in_use_is_one_clear_error() -> None:
    registry = CollectorRegistry()
    with serve_metrics(registry, HostPort("127.0.0.1", 0)) as taken:
        with pytest.raises(ConfigError, match=r"cannot serve metrics on 127\.0\.0\.1:\d+: .*in use.*choose another"):
            with serve_metrics(registry, HostPort("127.0.0.1", taken.port)):
                pass
