"""The lab's fixtures (``lab``, ``lab8``, ``lab_manager``, ``no_lab``), from ``edgefleet.lab.fixtures``.

Other test directories load them with ``pytest_plugins = ["edgefleet.lab.fixtures"]`` in their
conftest.py. Here, the shared lab is also torn down when the last test of this package ends, so
the rest of the suite runs on a quiet machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edgefleet.lab.fixtures import LabManager, lab, lab8, lab_manager, no_lab  # noqa: F401 - fixtures


@pytest.fixture(scope="package", autouse=True)
def _lab_down_after_this_package(lab_manager: LabManager) -> Iterator[None]:  # noqa: F811 - the fixture
    yield
    lab_manager.release()
