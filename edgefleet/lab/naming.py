"""Every name and address the lab gives to the objects it creates, in one place.

Why one module: ``down`` must find whatever a crashed lab left behind with nothing but these
rules, so every namespace, link, bridge, cgroup and directory starts with ``PREFIX`` and every
address sits in 198.18.0.0/24 (RFC 2544's benchmarking range: never on a real LAN).
"""

from __future__ import annotations

import ipaddress
import tempfile
from pathlib import Path

PREFIX = "efl-"
BRIDGE = f"{PREFIX}br0"
CGROUP_PARENT = f"{PREFIX}lab"           # /sys/fs/cgroup/<controller>/efl-lab/<member>
# Member names that no board id can take (a board id starts with a letter or a digit):
SERVER = "_server"                        # the broker/coordinator namespace and cgroup
BROKER_MEMBER = "_broker"                 # the host-side broker's (tracking-only) cgroup

SUBNET = ipaddress.IPv4Network("198.18.0.0/24")
HOST_ADDRESS = ipaddress.IPv4Address("198.18.0.1")     # the bridge, on the host
SERVER_ADDRESS = ipaddress.IPv4Address("198.18.0.2")   # the server namespace, when the fleet has one
FIRST_BOARD_HOST = 11                                  # boards are .11, .12, ...

BOARD_IFNAME = "eth0"                      # the board's side of its veth, inside its namespace


def workdir() -> Path:
    """Where the lab keeps its state file, agent configs and logs (removed by ``down``)."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}lab"


def netns_name(member: str) -> str:
    """``pi4-1`` -> ``efl-pi4-1``: the namespace of a board (or of the server)."""
    return f"{PREFIX}{member}"


def cgroup_name(member: str) -> str:
    """The cgroup of a board (or of the server/broker), relative to a controller's mount."""
    return f"{CGROUP_PARENT}/{PREFIX}{member}"


def host_ifname(index: int) -> str:
    """The host side of board ``index``'s veth (index 0 is the server); at most 15 characters."""
    return f"{PREFIX}v{index}"


def peer_ifname(index: int) -> str:
    """The board side before it moves into the namespace and becomes ``eth0``."""
    return f"{PREFIX}p{index}"


def board_address(index: int) -> ipaddress.IPv4Address:
    """Board ``index`` (1-based) -> 198.18.0.(10 + index)."""
    return SUBNET.network_address + FIRST_BOARD_HOST - 1 + index


__all__ = ["BOARD_IFNAME", "BRIDGE", "CGROUP_PARENT", "HOST_ADDRESS", "PREFIX", "SERVER", "SERVER_ADDRESS", "SUBNET",
           "board_address", "cgroup_name", "host_ifname", "netns_name", "peer_ifname", "workdir"]
