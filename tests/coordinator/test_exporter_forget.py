"""``edge-coordinator forget`` while the exporter runs: the empty retained payloads that clear a board's
topics mean the board was forgotten, not that someone sent malformed data. A real Mosquitto, the real
exporter and the real ``forget`` command, each as its own process."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgefleet.brokers.local_broker import LocalBroker, free_port
from tests.coordinator.test_exporter import Agents, scrape, value
from tests.helpers import coordinator, wait_until


@pytest.fixture
def prefix() -> str:
    return f"forget-{uuid.uuid4().hex[:8]}/v1"


@pytest.fixture
def agents(mosquitto: LocalBroker, prefix: str) -> Iterator[Agents]:
    publisher = Agents(mosquitto, prefix)
    try:
        yield publisher
    finally:
        publisher.close()


def test_a_forgotten_board_drops_out_with_no_warning_and_no_bad_message(mosquitto: LocalBroker, agents: Agents,
                                                                         prefix: str, tmp_path: Path) -> None:
    # Prepare: pi-1 and pi-2 on the page of a running exporter; then pi-1's agent stops (offline, retained).
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[broker]\nhost = "{mosquitto.host}"\nport = {mosquitto.port}\ntopic_prefix = "{prefix}"\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    for board in ("pi-1", "pi-2"):
        agents.online(board, "rpi5-pmic")
    exporter = subprocess.Popen([sys.executable, "-m", "edgefleet.coordinator.cli", "--config", str(config), "exporter",
                                 "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def both_shown() -> bool:
            assert exporter.poll() is None, exporter.communicate()
            for board in ("pi-1", "pi-2"):
                agents.telemetry(board, "rpi5-pmic", 4.0)
            try:
                got = scrape(url)
            except OSError:
                return False
            return all(value(got, "edgefleet_board_power_watts", board_id=b) is not None for b in ("pi-1", "pi-2"))

        wait_until(both_shown, timeout_s=15, what="pi-1 and pi-2 on the exporter's page")
        agents.offline("pi-1")
        wait_until(lambda: value(scrape(url), "edgefleet_fleet_boards", health="offline") == 1, timeout_s=10,
                   what="pi-1 offline on the page")

        # Execute: the operator retires pi-1.
        forgot = coordinator("--config", str(config), "forget", "pi-1", "--yes")
        assert forgot.returncode == 0, forgot.stdout + forgot.stderr

        # Assert: pi-1 is gone from the exporter's view (no longer counted), pi-2 stays, nothing counted as bad.
        wait_until(lambda: value(scrape(url), "edgefleet_fleet_boards", health="offline") == 0, timeout_s=10,
                   what="pi-1 to drop out of the exporter's view")
        got = scrape(url)
        assert sum(v for _, v in got["edgefleet_fleet_boards"]) == 1
        assert value(got, "edgefleet_fleet_bad_messages_total") == 0
        assert not [labels for series in got.values() for labels, _ in series if labels.get("board_id") == "pi-1"]
        assert value(got, "edgefleet_board_power_watts", board_id="pi-2") is not None
    finally:
        exporter.send_signal(signal.SIGTERM)
        _, err = exporter.communicate(timeout=10)
    assert "malformed" not in err and "who else publishes" not in err, err
    assert exporter.returncode == 0, err
