"""The Grafana dashboards in grafana/: every panel's query returns data from a real Prometheus that scrapes a
real ``edge-coordinator exporter`` (fed by real agents) and a real ``train --metrics-listen``; and the run's
end (``edgefleet_train_running`` 0) reaches Prometheus, thanks to the page's grace after the run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from edgefleet.brokers.local_broker import free_port
from tests.conftest import REPO, Fleet
from tests.coordinator.test_exporter import Prometheus, prometheus_for  # noqa: F401 (prometheus_for: a fixture)
from tests.helpers import wait_until

DASHBOARDS = sorted((REPO / "grafana").glob("*.json"))
# What Grafana puts in place of its variables before it sends a query; $job is the exporter's scrape job.
VARIABLES = {"$__rate_interval": "5s", "$__range": "1m", "$job": "edgefleet", "$board_id": ".*", "$run_id": ".*"}
BOARDS = ("gd-1", "gd-2")


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield from panel.get("panels", [])  # a collapsed row's panels
        if panel["type"] != "row":
            yield panel


def targets() -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, expr) of every query of every panel."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in panels(dashboard):
            out += [(dashboard["title"], panel["title"], target["expr"]) for target in panel["targets"]]
    return out


def substituted(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def test_the_dashboards_are_provisionable_and_every_panel_queries_the_chosen_prometheus() -> None:
    assert [p.name for p in DASHBOARDS] == ["edgefleet-fleet.json", "edgefleet-training.json"]
    uids = set()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        uids.add(dashboard["uid"])
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert "datasource" in variables
        for panel in panels(dashboard):
            assert panel["targets"], f"{path.name}: {panel['title']} has no query"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            for target in panel["targets"]:
                used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__range"}
                assert used <= variables, f"{path.name}: {panel['title']} uses undefined {used - variables}"
    assert len(uids) == len(DASHBOARDS)


def fake_sysfs(root: Path) -> Path:
    """A thermal zone as a board's kernel shows it (the test machine may have none)."""
    zone = root / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("cpu-thermal\n")
    (zone / "temp").write_text("48250\n")
    return root


def test_every_panel_returns_data_from_a_real_prometheus(make_fleet: Callable[..., Fleet], tmp_path: Path,
                                                         prometheus_for: list[Prometheus]) -> None:  # noqa: F811
    # Prepare: two agents sampling every 0.5 s, the exporter, and a Prometheus that scrapes it and the run every second.
    sysfs = fake_sysfs(tmp_path / "sys")
    telemetry = f'[telemetry]\ninterval_s = 0.5\nsysfs_root = "{sysfs}"\n'
    fleet = make_fleet(BOARDS, config_extra=telemetry)
    exporter_port, train_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: edgefleet\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n"
                      f"  - job_name: edgefleet-train\n    static_configs:\n      - targets: ['127.0.0.1:{train_port}']\n")
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log_file:
        proc = subprocess.Popen(["/usr/bin/prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log_file, stderr=subprocess.STDOUT,
                                cwd=tmp_path)
    server = Prometheus(proc, f"http://127.0.0.1:{port}", tmp_path / "prometheus.log")
    prometheus_for.append(server)
    exporter = subprocess.Popen([sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", fleet.broker.address,
                                 "exporter", "--listen", f"127.0.0.1:{exporter_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # A run far longer than the test: it is stopped (Ctrl-C) once every panel has data.
    train = subprocess.Popen(fleet.train_command("--metrics-listen", f"127.0.0.1:{train_port}", "--metrics-grace", "20",
                                                 boards=",".join(BOARDS), steps=100_000, model="lenet5", dataset="digits",
                                                 threads=1, run_dir=tmp_path / "run"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        queries = targets()
        missing: list[str] = []

        def every_panel_has_data() -> bool:
            assert exporter.poll() is None, exporter.communicate()[1]
            assert train.poll() is None, train.communicate()
            assert server.proc.poll() is None, server.log_path.read_text()
            missing[:] = [f"{board} / {panel}: {expr}" for board, panel, expr in queries
                          if not server.query(substituted(expr))]
            return not missing

        # Execute: ask Prometheus each query as Grafana would, until all answer (the run needs its boards to join).
        try:
            wait_until(every_panel_has_data, timeout_s=150, interval_s=0.5, what="every panel's query to return data")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; no data for:\n" + "\n".join(missing)) from None

        # The run is stopped: Prometheus still sees it end, as the page stays until it was scraped twice.
        train.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        wait_until(lambda: server.query('edgefleet_train_running{job="edgefleet-train"} == 0'), timeout_s=30,
                   interval_s=0.2, what="Prometheus to see edgefleet_train_running 0")
        _, err = train.communicate(timeout=60)
        ended_s = time.monotonic() - stopped
    finally:
        for proc_ in (train, exporter):
            if proc_.poll() is None:
                proc_.send_signal(signal.SIGTERM if proc_ is exporter else signal.SIGKILL)
                proc_.communicate(timeout=30)

    # Assert: the run went, and lingered no longer than it had to (two 1 s scrapes, well inside the 20 s grace).
    assert "Traceback" not in err, err
    assert ended_s < 20, f"train took {ended_s:.1f} s to exit after Ctrl-C"
