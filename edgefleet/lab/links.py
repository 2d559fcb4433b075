"""Network namespaces joined to one bridge by veth pairs, each side shaped with tc tbf.

Topology (all addresses in 198.18.0.0/24, nothing routed or NATed off the machine)::

    host: efl-br0 198.18.0.1 ── efl-v1 ═veth═ eth0 198.18.0.11  (netns efl-pi4-1)
                             ├─ efl-v2 ═veth═ eth0 198.18.0.12  (netns efl-pi5-1)
                             └─ efl-v0 ═veth═ eth0 198.18.0.2   (netns efl-_server, optional)

Why tbf on both ends of each veth: a qdisc shapes what leaves an interface, so the host side's
egress is the board's download and the board side's egress is its upload; both directions are
limited without an ifb device or ingress policing (which drops instead of queueing, and makes
TCP far slower than the set rate). netem is not needed and not available here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

from edgefleet.lab.naming import BOARD_IFNAME, BRIDGE, HOST_ADDRESS, PREFIX, SUBNET

log = logging.getLogger(__name__)

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
ETH_FRAME_BYTES = 1514


class LinkError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and its stderr."""


def run(cmd: list[str], *, check: bool = True, timeout_s: float = 15.0) -> str:
    """Run an iproute2 command; return stdout, raise LinkError with its stderr on failure."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and done.returncode != 0:
        raise LinkError(f"'{' '.join(cmd)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def tbf_parameters(rate_bps: int) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at ``rate_bps``.

    Burst: the bucket must hold at least one timer tick of traffic (4 ms at this kernel's HZ=250)
    or tbf can't reach its rate; much more would let a board exceed its link after every pause.
    5 ms worth, and at least four full frames, does both.

    Limit (the queue behind the bucket): 100 ms of traffic and at least 128 KiB. Linux TCP hands
    the qdisc 64 KB TSO bursts and keeps up to about 128 KB queued per socket; with a 25 ms queue
    tbf dropped a third of a 20 Mbit/s sender's packets, which no real board's link does. A
    100 ms queue is what a home router or a Wi-Fi access point holds under load, and it drops
    nothing at these rates (tests/lab/test_link_rates.py checks the goodput both ways).
    """
    rate_bytes = rate_bps / 8
    burst = max(int(rate_bytes * 0.005), 4 * ETH_FRAME_BYTES)
    limit = burst + max(int(rate_bytes * 0.1), 128 * 1024)
    return burst, limit


def shape(dev: str, rate_bps: int, *, netns: str | None = None) -> None:
    """Put (or replace) a tbf at ``rate_bps`` on ``dev``'s egress."""
    burst, limit = tbf_parameters(rate_bps)
    where = ["-n", netns] if netns else []
    run(["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
         "burst", str(burst), "limit", str(limit)])


def create_bridge() -> None:
    """The lab's switch, with the host's address on it; no IPv6 so nothing chatters on the links."""
    run(["ip", "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
    run(["ip", "link", "set", BRIDGE, "addrgenmode", "none"])
    run(["ip", "addr", "add", f"{HOST_ADDRESS}/{SUBNET.prefixlen}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def create_member(netns: str, *, host_if: str, peer_if: str, address: ipaddress.IPv4Address,
                  rate_up_bps: int, rate_down_bps: int) -> None:
    """A namespace with ``eth0`` at ``address``, joined to the bridge and shaped both ways."""
    run(["ip", "netns", "add", netns])
    run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if])
    run(["ip", "link", "set", peer_if, "netns", netns])
    run(["ip", "-n", netns, "link", "set", peer_if, "name", BOARD_IFNAME])
    run(["ip", "-n", netns, "link", "set", BOARD_IFNAME, "addrgenmode", "none"])
    run(["ip", "link", "set", host_if, "addrgenmode", "none"])
    run(["ip", "-n", netns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", BOARD_IFNAME])
    run(["ip", "-n", netns, "link", "set", "lo", "up"])
    run(["ip", "-n", netns, "link", "set", BOARD_IFNAME, "up"])
    run(["ip", "link", "set", host_if, "master", BRIDGE])
    run(["ip", "link", "set", host_if, "up"])
    shape(host_if, rate_down_bps)                    # towards the board: its download
    shape(BOARD_IFNAME, rate_up_bps, netns=netns)    # from the board: its upload
    log.debug("%s: %s on %s, up %d bit/s, down %d bit/s", netns, address, host_if, rate_up_bps, rate_down_bps)


def set_link_up(netns: str, up: bool) -> None:
    """Unplug (``up=False``) or replug a member's cable: its eth0 goes down or up."""
    run(["ip", "-n", netns, "link", "set", BOARD_IFNAME, "up" if up else "down"])


def qdisc_rate_bps(dev: str, *, netns: str | None = None) -> int | None:
    """The tbf rate currently set on ``dev`` (what the kernel holds, not what we asked)."""
    where = ["-n", netns] if netns else []
    out = run(["tc", "-j", *where, "qdisc", "show", "dev", dev])
    for qdisc in json.loads(out or "[]"):
        if qdisc.get("kind") == "tbf":
            rate = qdisc.get("options", {}).get("rate")
            return int(rate) * 8 if isinstance(rate, int) else None
    return None


def list_netns(prefix: str = PREFIX) -> list[str]:
    out = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def list_links(prefix: str = PREFIX) -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def netns_pids(netns: str) -> list[int]:
    out = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def delete_netns(netns: str) -> None:
    run(["ip", "netns", "del", netns], check=False)


def delete_link(name: str) -> None:
    run(["ip", "link", "del", name], check=False)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def call_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` in a thread that has joined ``netns``.

    Why a thread: a network namespace belongs to a thread, not to the process, so the caller's
    own threads stay where they are; sockets opened and processes started by ``fn`` (a child
    inherits the namespace of the thread that forked it) live in ``netns``.
    """
    values: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            values.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"in-{netns}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return values[0]


__all__ = ["LinkError", "call_in_netns", "create_bridge", "create_member", "delete_link", "delete_netns", "list_links",
           "list_netns", "netns_pids", "qdisc_rate_bps", "run", "set_link_up", "shape", "tbf_parameters"]
