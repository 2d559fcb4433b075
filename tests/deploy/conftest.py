"""Fixtures for the deployment tests: the wheel the playbook installs, and the cached Debian root."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.deploy.rootfs import cached_base_root
from tests.deploy.tools import REPO, require_root, run


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as a user builds it before a rollout."""
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)], timeout_s=600)
    (built,) = out.glob("edgefleet-*.whl")
    return built


@pytest.fixture(scope="session")
def base_root() -> Path:
    """A minimal Debian root from debootstrap, cached across runs (see rootfs.cached_base_root)."""
    require_root()
    return cached_base_root()
