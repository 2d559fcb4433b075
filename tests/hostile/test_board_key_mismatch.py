"""A board whose own key the coordinator does not hold (made anew when the board was reinstalled, or none at
all) fails the join within seconds, naming the board and the reason, instead of the coordinator dropping
its events as forgeries, waiting the 180 s join timeout and then blaming the network. Real Mosquitto, real
agents, a real ``edge-coordinator train --board-keys``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import AgentFactory
from tests.helpers import wait_boards_online
from tests.hostile.board_keys import agent_config, finish, make_keys, new_key, start_train

FAST_S = 45.0  # far below the 180 s join timeout


@pytest.mark.parametrize(("board", "expected"), [
    ("rekeyed-1", "its job events are signed with another key than the one this coordinator holds for it in"),
    ("unkeyed-1", "its job events are unsigned"),
])
def test_a_board_whose_events_do_not_verify_fails_the_join_at_once_naming_it(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory, board: str, expected: str) -> None:
    keys = make_keys(tmp_path, [board])
    own = new_key(tmp_path / "reinstalled.key") if board == "rekeyed-1" else None  # not the key the coordinator holds
    agents.start(board, mosquitto.address, config=agent_config(board, keys, own))
    wait_boards_online(mosquitto.address, [board])
    started = time.monotonic()
    code, out, err = finish(start_train(mosquitto, keys, tmp_path / "run", board), FAST_S)
    output = out + err
    assert code != 0 and f"board {board}: {expected}" in output, output[-3000:]
    assert f"{keys.board_keys}/{board}.pub" in output and "python -m edgefleet.transport.fleet_key --public" in output
    assert "did not connect to the exchange within" not in output  # not blamed on the network
    assert "Traceback" not in output and time.monotonic() - started < FAST_S
