"""The agent tells systemd it is ready and alive on $NOTIFY_SOCKET, with no extra dependency."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from edgefleet.agent.sdnotify import sd_notify
from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import AgentFactory


def test_ready_watchdog_and_stopping_reach_the_notify_socket(tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(15)
        agent = agents.start("sd-1", mosquitto.address, args=("--interval", "0.1"), env={"NOTIFY_SOCKET": str(path)})
        received: list[str] = []
        while not (any("READY=1" in m for m in received) and sum("WATCHDOG=1" in m for m in received) >= 3):
            received.append(sock.recv(4096).decode())
        assert received[0].startswith("READY=1")  # ready comes first, then the watchdog pings
        assert "STATUS=board sd-1" in received[0]
        agent.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not any("STOPPING=1" in m for m in received) and time.monotonic() < deadline:
            received.append(sock.recv(4096).decode())
        assert any("STOPPING=1" in m for m in received)
        assert agent.proc.wait(timeout=5) == 0


def test_abstract_socket_address(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0edgefleet-test-notify")
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@edgefleet-test-notify")
        assert sd_notify("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")  # not under systemd: a no-op
