"""systemd readiness and watchdog notifications, without extra dependencies (sd_notify(3))."""

from __future__ import annotations

import os
import socket


def sd_notify(*lines: str) -> bool:
    """Send ``READY=1``, ``WATCHDOG=1``, ``STATUS=…`` or ``STOPPING=1`` to ``$NOTIFY_SOCKET``.

    Returns False when not running under systemd (no socket) or when the socket is gone.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
    except OSError:
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds: how often to ping, or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    return int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
