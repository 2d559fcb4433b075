"""The conformance suite's fleet: three boards for all its modules, on the session's broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import Fleet, start_fleet

BOARDS = ("c1", "c2", "c3")


@pytest.fixture(scope="package")
def fleet(mosquitto: LocalBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet key and three boards whose workers stay between jobs (torch imported once), for the whole package."""
    with start_fleet(tmp_path_factory.mktemp("conformance"), mosquitto, BOARDS, keep_worker=True) as shared:
        yield shared
