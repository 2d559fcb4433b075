"""Real agents, a real Mosquitto and the real CLI: the fleet appears, stops and vanishes as promised."""

from __future__ import annotations

import os
import signal
import time

import psutil

from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import AgentFactory
from tests.helpers import status_json, wait_until

FAST = ("--interval", "0.2")
KEEPALIVE_S = 2


def _config(board_id: str) -> str:
    return f'board_id = "{board_id}"\n[broker]\nkeepalive_s = {KEEPALIVE_S}\n[power]\nsource = "estimated"\nidle_w = 2.0\nmax_w = 6.0\n'


def test_three_agents_appear_then_stop_and_die_as_promised(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    # Prepare: three real agent processes on one broker, each with its own id.
    ids = ["it-pi-1", "it-pi-2", "it-orin-1"]
    procs = {i: agents.start(i, mosquitto.address, config=_config(i), args=FAST) for i in ids}

    # Execute: the CLI's JSON snapshot until all three report samples.
    def all_online() -> dict | None:
        rows = status_json(mosquitto.address)
        ok = all(rows.get(i, {}).get("health") == "ok" for i in ids)
        return rows if ok else None

    rows = wait_until(all_online, timeout_s=30, what="three agents online with samples")

    # Assert: every board is online, with an estimated power figure labelled as such.
    for i in ids:
        assert rows[i]["state"] == "online"
        assert rows[i]["power_source"] == "estimated" and rows[i]["power_measured"] is False
        assert 2.0 <= rows[i]["power_w"] <= 6.0
        assert rows[i]["caps"]["cores"] == os.cpu_count()

    # kill -9: the broker publishes the last will within keepalive x 1.5.
    procs["it-pi-1"].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: status_json(mosquitto.address).get("it-pi-1", {}).get("state") == "offline",
               timeout_s=KEEPALIVE_S * 1.5 + 5, what="killed agent offline")
    assert time.monotonic() - killed_at <= KEEPALIVE_S * 1.5 + 3  # + the CLI's own start-up
    assert status_json(mosquitto.address)["it-pi-1"]["offline_reason"] == "connection lost"

    # SIGTERM: a clean stop publishes offline itself and exits 0 within 2 s.
    agent = procs["it-pi-2"]
    agent.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert agent.proc.wait(timeout=5) == 0, agent.log()
    assert time.monotonic() - started < 2.0
    row = status_json(mosquitto.address)["it-pi-2"]
    assert row["state"] == "offline" and row["offline_reason"] == "stopped"

    # The third is untouched.
    assert status_json(mosquitto.address)["it-orin-1"]["health"] == "ok"
    assert "Traceback" not in "".join(p.log() for p in procs.values())


def test_telemetry_agrees_with_psutil(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    agents.start("it-psutil", mosquitto.address, config=_config("it-psutil"), args=FAST)
    row = wait_until(lambda: status_json(mosquitto.address).get("it-psutil", {}).get("seq") and
                     status_json(mosquitto.address)["it-psutil"], timeout_s=30, what="a sample")
    vm = psutil.virtual_memory()
    assert row["mem_total_bytes"] == vm.total
    assert abs(row["mem_used_bytes"] - (vm.total - vm.available)) < 0.05 * vm.total
    assert row["caps"]["ram_bytes"] == vm.total
    assert 0.0 <= row["cpu_percent"] <= 100.0
    # estimated power follows the model from the CPU reading of the same sample
    expected_w = 2.0 + 4.0 * row["cpu_percent"] / 100
    assert row["power_w"] == round(expected_w, 3) or abs(row["power_w"] - expected_w) < 0.01
    assert row["net_rx_bytes_per_s"] >= 0 and row["net_tx_bytes_per_s"] >= 0


def test_status_watch_shows_the_fleet_until_ctrl_c(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    import os
    import pty
    import select
    import subprocess
    import sys

    agents.start("it-watch", mosquitto.address, config=_config("it-watch"), args=FAST)
    wait_until(lambda: status_json(mosquitto.address).get("it-watch", {}).get("health") == "ok", timeout_s=30,
               what="agent online")
    # A pseudo-terminal, so that the live view draws as it does for a person.
    master, slave = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", mosquitto.address, "status", "--watch"],
                             stdout=slave, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    screen = b""
    try:
        def drawn() -> bool:
            nonlocal screen
            # Never block on the terminal: the deadline must hold even while the view draws nothing.
            if select.select([master], [], [], 0.2)[0]:
                screen += os.read(master, 65536)
            return b"it-watch" in screen and b"estimated" in screen

        # Generous: on a host busy with the rest of the suite the CLI's start alone has taken over 10 s.
        try:
            wait_until(drawn, timeout_s=60, what="the live table with the board")
        except AssertionError as e:
            raise AssertionError(f"{e}; the terminal's last bytes: {screen[-600:]!r}") from None
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=15)
    finally:
        if watch.poll() is None:
            watch.kill()
        os.close(master)
    assert watch.returncode == 0, err
    assert b"online" in screen
    assert "Traceback" not in err
