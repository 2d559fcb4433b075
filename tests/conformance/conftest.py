"""The conformance suite's fleet: one broker and three boards for all its modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.transport.fleet_key import generate_key_hex
from tests.conftest import AgentFactory

BOARDS = ("c1", "c2", "c3")


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalBroker, Path]]:
    """A broker, a fleet key and three boards whose workers stay between jobs (torch imported once)."""
    tmp = tmp_path_factory.mktemp("conformance")
    key = tmp / "fleet.key"
    key.write_text(generate_key_hex() + "\n")
    key.chmod(0o600)
    factory = AgentFactory(tmp)
    with start_mosquitto() as broker:
        for board in BOARDS:
            factory.start(board, broker.address, config=(f'board_id = "{board}"\n[security]\nfleet_key_file = "{key}"\n'
                                                         '[power]\nsource = "estimated"\n[training]\nkeep_worker = true\n'))
        try:
            yield broker, key
        finally:
            factory.stop_all()


