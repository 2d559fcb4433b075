"""Fixtures for the deployment tests: the cached Debian root (the wheel is tests/conftest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.rootfs import cached_base_root
from tests.deploy.tools import require_root


@pytest.fixture(scope="session")
def base_root() -> Path:
    """A minimal Debian root from debootstrap, cached across runs (see rootfs.cached_base_root)."""
    require_root()
    return cached_base_root()
