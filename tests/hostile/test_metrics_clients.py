"""Clients of the metrics page that connect and send nothing (a slowloris on the boards' network): each
is closed after the client timeout, they never hold more than MAX_CLIENTS threads, and Prometheus's
scrape gets through once they are gone."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge

from edgefleet.coordinator.exporter import http_server
from edgefleet.coordinator.exporter.metrics_server import serve_metrics
from edgefleet.protocol.address import HostPort
from tests.helpers import wait_until

IDLE = 60  # more than MAX_CLIENTS


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def test_idle_clients_are_closed_and_cannot_hold_more_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server, "CLIENT_TIMEOUT_S", 1.0)
    registry = CollectorRegistry()
    Gauge("edgefleet_probe", "a value to find on the page", registry=registry).set(7)
    before = threading.active_count()
    with serve_metrics(registry, HostPort("127.0.0.1", 0)) as endpoint:
        idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) for _ in range(IDLE)]
        try:
            for sock in idle:
                sock.settimeout(0.05)
            threads = [0]

            def all_closed() -> bool:
                threads[0] = max(threads[0], threading.active_count() - before - 1)  # less the server's own thread
                return all(_closed_by_server(s) for s in idle)

            # Every idle client is closed by the server (the ones over the bound at once, the rest at the timeout).
            wait_until(all_closed, timeout_s=10, what="the server closing every idle client")
            assert threads[0] <= http_server.MAX_CLIENTS, f"{threads[0]} threads for {IDLE} idle clients"
            page = wait_until(lambda: _scrape(endpoint.url), timeout_s=5, what="a scrape after the idle clients")
        finally:
            for sock in idle:
                sock.close()
    assert "edgefleet_probe 7.0" in page


def test_a_scrape_is_served_while_a_few_clients_sit_idle() -> None:
    registry = CollectorRegistry()
    Gauge("edgefleet_probe", "a value to find on the page", registry=registry).set(3)
    with serve_metrics(registry, HostPort("127.0.0.1", 0)) as endpoint:
        idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) for _ in range(5)]
        try:
            started = time.monotonic()
            page = _scrape(endpoint.url)
            assert page is not None and "edgefleet_probe 3.0" in page
            assert time.monotonic() - started < http_server.CLIENT_TIMEOUT_S  # not queued behind the idle ones
        finally:
            for sock in idle:
                sock.close()
