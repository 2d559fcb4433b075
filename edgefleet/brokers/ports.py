"""Loopback ports for the development brokers: a free one, and waiting until one takes connections."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from edgefleet.protocol.errors import BrokerError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, *, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                  log_path: Path | None = None) -> None:
    """Poll until a TCP connect succeeds; raise BrokerError if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            err = log_path.read_text(errors="replace") if log_path is not None and log_path.exists() else ""
            raise BrokerError(f"mosquitto exited with code {proc.returncode} before listening on {host}:{port}: {err.strip()[-400:]}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"nothing listened on {host}:{port} within {timeout_s:.0f} s")


__all__ = ["free_port", "wait_for_port"]
