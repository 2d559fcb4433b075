"""What a board is: model, cores, memory, accelerator, where other boards reach it. Read once at start, published
retained (the address on every connect to the broker: it is the local end of that connection unless configured)."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import platform
import socket
from pathlib import Path

import psutil

from edgefleet import __version__
from edgefleet.agent.cpu_threads import fitting_threads, usable_cores
from edgefleet.protocol.messages import BoardCaps


def read_board_model(sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> str:
    """``Raspberry Pi 5 Model B Rev 1.0`` from the device tree, a DMI product name, or the CPU type."""
    candidates = [proc_root / "device-tree" / "model", sysfs_root / "firmware" / "devicetree" / "base" / "model",
                  sysfs_root / "class" / "dmi" / "id" / "product_name"]
    for path in candidates:
        try:
            text = path.read_bytes().rstrip(b"\0\n ").decode(errors="replace").strip()
        except OSError:
            continue
        if text:
            return text
    return platform.processor() or platform.machine() or "unknown"


def detect_accelerator(etc_root: Path = Path("/etc")) -> str:
    """``jetson-igpu`` on a Jetson (its L4T release file), else empty."""
    return "jetson-igpu" if (etc_root / "nv_tegra_release").exists() else ""


def training_available() -> bool:
    """True if torch and Lightning are installed (found, not imported: the idle agent stays light)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "pytorch_lightning"))


def read_caps(board_id: str, power_source: str, sysfs_root: Path) -> BoardCaps:
    cores = usable_cores()
    return BoardCaps(
        board_id=board_id,
        hostname=socket.gethostname(),
        model=read_board_model(sysfs_root),
        machine=platform.machine(),
        cores=os.cpu_count() or 1,
        ram_bytes=int(psutil.virtual_memory().total),
        accelerator=detect_accelerator(),
        power_source=power_source,
        agent_version=__version__,
        python_version=platform.python_version(),
        training_available=training_available(),
        cpu_cores=round(cores, 3),
        train_threads=fitting_threads(cores),
    )


def reachable_address(configured: str, connection_local: str) -> str:
    """The address other boards reach this one at, for ``BoardCaps.address``.

    Args:
        configured: the agent config's ``[training] address`` ("" when not set), which wins: a board behind NAT,
            or one whose broker is on its own loopback, knows better than its socket.
        connection_local: the local address of the board's broker connection (``MqttLink.local_address``): the
            network routes the broker's traffic to it, so the fleet's other boards can usually reach it too.
    """
    if configured:
        return configured
    try:
        mapped = ipaddress.ip_address(connection_local)
    except ValueError:
        return connection_local
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:  # a dual-stack socket's IPv4 peer
        return str(mapped.ipv4_mapped)
    return connection_local
