"""Where the deployment tools are, and running them with their output kept for the failure message."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
UNIT_FILE = REPO / "systemd" / "edge-agent.service"
INSTALL_HINT = "run 'bash .ci/install-deploy-tools' (as root) to install it"


def tool(name: str) -> str:
    """The path of a command-line tool, failing the test with the install hint if it is missing.

    pip puts Ansible's commands beside the interpreter, which need not be on PATH (pyenv shims).
    """
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if found is None:
        for sbin in ("/usr/sbin", "/sbin", "/usr/bin"):
            if Path(sbin, name).exists():
                return str(Path(sbin, name))
        pytest.fail(f"{name} is not installed: {INSTALL_HINT}")
    return found


def require_root() -> None:
    """Image builds need root (debootstrap, chroot, systemd-nspawn); CI runs as root."""
    import os

    if os.geteuid() != 0:
        pytest.skip("image builds need root (debootstrap, chroot, systemd-nspawn)")


def run(cmd: list[str], *, timeout_s: float, check: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output; on failure the assertion shows the command's output."""
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, **kwargs)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
