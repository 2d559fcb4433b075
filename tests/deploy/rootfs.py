"""Debian roots for the image-baking tests: built once with debootstrap, cached, copied per run.

An SD-card image is baked the same way: debootstrap (or the vendor's image) into a folder, the
roles applied over Ansible's chroot connection, then the folder written to a card. Here the folder
is also booted with systemd-nspawn to see the services run.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.deploy.tools import run, tool
from tests.helpers import wait_until

CACHE_DIR = Path(os.environ.get("EDGEFLEET_DEPLOY_CACHE", "/var/tmp/edgefleet-deploy-cache"))
SUITE = "bookworm"  # the release the roles are checked against (Raspberry Pi OS 12 is bookworm too)
# Just enough for Ansible to reach the root (python3), to boot it (systemd) and for pip to trust
# PyPI (ca-certificates). Everything else is the roles' job, so their apt tasks really run.
BASE_PACKAGES = ("python3", "systemd", "ca-certificates")
CACHE_FORMAT = 1  # bump when the way the root is built changes


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses (or $EDGEFLEET_DEBIAN_MIRROR)."""
    if os.environ.get("EDGEFLEET_DEBIAN_MIRROR"):
        return os.environ["EDGEFLEET_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        text = path.read_text(errors="replace") if path.is_file() else ""
        # deb822 stanzas: URIs plus Suites holding the plain release name.
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.MULTILINE)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.MULTILINE)
            if uris and suites and re.search(r"(^|\s)[a-z]+(\s|$)", suites.group(1)) and "/debian" in uris.group(1) \
                    and "security" not in uris.group(1):
                return uris.group(1)
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "/debian" in parts[1] and "security" not in parts[1]:
                return parts[1]
    raise AssertionError("no Debian mirror in /etc/apt/sources.list*: set EDGEFLEET_DEBIAN_MIRROR=http://…/debian")


def _cache_key(mirror: str) -> str:
    spec = {"format": CACHE_FORMAT, "suite": SUITE, "variant": "minbase", "packages": sorted(BASE_PACKAGES),
            "mirror": mirror, "arch": os.uname().machine}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def cached_base_root() -> Path:
    """A minimal Debian root, built by debootstrap the first time and reused while its inputs match.

    A lock keeps two test runs from building it at once; a marker file written last keeps a
    half-built root (an interrupted run) from being used.
    """
    mirror = debian_mirror()
    key = _cache_key(mirror)
    entry = CACHE_DIR / key
    root, done = entry / "root", entry / "complete"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return root
        for stale in CACHE_DIR.iterdir():  # other keys: roots of an older package list
            if stale.is_dir():
                shutil.rmtree(stale)
        entry.mkdir()
        run([tool("debootstrap"), "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root), mirror],
            timeout_s=1200)
        run(["chroot", str(root), "apt-get", "clean"], timeout_s=60)  # the .debs: 50 MB nobody needs again
        done.write_text(json.dumps({"mirror": mirror, "suite": SUITE, "packages": BASE_PACKAGES}))
    return root


def copy_root(base: Path, dest: Path) -> Path:
    """A private copy of the cached root for one test run (seconds on the same file system)."""
    run(["cp", "-a", "--reflink=auto", str(base), str(dest)], timeout_s=300)
    return dest


def prepare_for_build(root: Path) -> None:
    """What an image build does before running the roles in a chroot.

    - policy-rc.d forbids starting services: without it a package's postinst would start its
      daemon (Mosquitto) on the build host, through the init script.
    - the host's resolver, so apt and pip inside can resolve names.
    - the host's site-local CA certificates (a TLS-inspecting proxy's, for one), so pip inside can
      reach PyPI wherever the host can.
    """
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# image build: never start services\nexit 101\n")
    policy.chmod(0o755)
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    shutil.copyfile("/etc/resolv.conf", resolv)
    local_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if local_cas:
        for ca in local_cas:
            shutil.copyfile(ca, root / "usr/local/share/ca-certificates" / ca.name)
        run(["chroot", str(root), "update-ca-certificates"], timeout_s=120)


def chroot_env() -> dict[str, str]:
    """The environment for ansible-playbook: the chroot connection hands it to every command inside.

    The host's pip settings that name host paths (find-links, constraints, config files) would break
    pip in the root, so only those that mean the same inside are kept; PIP_CERT names the CA bundle,
    which the root has at the same path once prepare_for_build() added the host's CAs.
    """
    keep = {"PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_RETRIES"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    for url_var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        value = os.environ.get(url_var, "")
        if value.startswith(("http://", "https://")):
            env[url_var] = value
    env.update({"ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_RETRY_FILES_ENABLED": "0",
                "ANSIBLE_PIPELINING": "1", "PYTHONUNBUFFERED": "1"})
    return env


_BOOTS = itertools.count()


class BootedImage:
    """A root booted with systemd-nspawn (its own PID 1 and journal, the host's network)."""

    def __init__(self, root: Path, log_path: Path) -> None:
        self.root = root
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.init_pid = 0
        # Unique, so that test runs side by side do not share nspawn's per-machine state in /run.
        self.machine = f"edgefleet-{os.getpid()}-{next(_BOOTS)}"

    def run(self, *cmd: str, timeout_s: float = 60, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command inside the booted system (its mount, PID and IPC namespaces)."""
        return run(["nsenter", "-t", str(self.init_pid), "-a", *cmd], timeout_s=timeout_s, check=check)

    def _find_init(self) -> int:
        """The container's PID 1 (a child of nspawn), 0 while it is not there yet."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}: {self.log_path.read_text(errors='replace')}")
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        for pid in children.read_text().split() if children.exists() else []:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
            except OSError:
                continue
        return 0

    def start(self, *, timeout_s: float = 90) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [tool("systemd-nspawn"), "--boot", "--quiet", "--register=no", "--keep-unit", "--console=passive",
                 f"--machine={self.machine}", "--directory", str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.init_pid = wait_until(self._find_init, timeout_s=30, what=f"systemd to start in the container (log: {self.log_path})")
        # is-system-running --wait blocks until the boot transaction is done, once systemd answers at
        # all (right after exec it has no socket yet). "degraded" is fine: the tests check their units.
        def booted_state() -> str:
            state = self.run("systemctl", "is-system-running", "--wait", timeout_s=timeout_s).stdout.strip()
            return state if state in ("running", "degraded") else ""

        wait_until(booted_state, timeout_s=timeout_s, interval_s=0.2, what=f"the image to boot (log: {self.log_path})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # nspawn asks the container's systemd to power off
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextmanager
def booted(root: Path, log_path: Path) -> Iterator[BootedImage]:
    image = BootedImage(root, log_path)
    try:
        image.start()
        yield image
    finally:
        image.stop()
