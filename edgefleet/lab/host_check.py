"""Can this machine run the lab? One sentence saying why not, for pytest's skip and for the CLI.

Why a probe and not only a uid check: root inside an unprivileged container usually lacks
CAP_NET_ADMIN or sees cgroups read-only, and the kernel may miss tbf; creating and deleting a
throw-away namespace with a shaped veth is the only answer that can't be wrong.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from edgefleet.lab.cgroups import CONTROLLERS, find_controller_mounts
from edgefleet.lab.naming import PREFIX

log = logging.getLogger(__name__)

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
TOOLS = ("ip", "tc", "nsenter")


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _probe_network() -> str | None:
    """Create a namespace and a veth with tbf on it, then remove both; None if that worked."""
    netns, host_if, peer_if = f"{PREFIX}probe", f"{PREFIX}probe0", f"{PREFIX}probe1"
    steps = [
        ["ip", "netns", "add", netns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if],
        ["ip", "link", "set", peer_if, "netns", netns],
        ["tc", "qdisc", "add", "dev", host_if, "root", "tbf", "rate", "10mbit", "burst", "16kb", "latency", "20ms"],
    ]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
            if done.returncode != 0:
                return f"'{' '.join(cmd)}' failed: {done.stderr.strip() or done.returncode}"
        return None
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10, check=False)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10, check=False)


def lab_unavailable_reason() -> str | None:
    """None if the lab can run here, else why not (and what would fix it)."""
    if os.name != "posix" or not Path("/proc/self/status").exists():
        return "the lab needs Linux (network namespaces, cgroup v1, tc)"
    if os.geteuid() != 0:
        return "the lab needs root (CAP_NET_ADMIN for namespaces and tc, write access to cgroup v1); run the lab tests as root"
    caps = _effective_caps()
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps & (1 << bit):
            return f"the lab needs {name} (root in an unprivileged container lacks it); run on the host or a privileged container"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the lab needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    mounts = find_controller_mounts()
    for controller in CONTROLLERS:
        mount = mounts.get(controller)
        if mount is None:
            return (f"the lab needs cgroup v1 with the {controller} controller mounted (found none under /proc/self/mounts; "
                    "a cgroup-v2-only host needs systemd.unified_cgroup_hierarchy=0)")
        if not os.access(mount, os.W_OK):
            return f"the lab needs write access to {mount} (cgroup v1 {controller}), which is read-only here"
    problem = _probe_network()
    if problem:
        return f"network namespaces or tc tbf do not work here: {problem}"
    return None


__all__ = ["lab_unavailable_reason"]
