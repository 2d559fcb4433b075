"""Boards without a key of their own: refused before any board starts, unless ``--allow-token-boards`` says so.

Without ``--board-keys`` an Ed25519 coordinator has no key to check a board's hello against, so it
would give each board a token in its signed command: anyone who reads the broker can read it, take
the board's place on the exchange and receive the model in the welcome. That is no longer the
silent default: the run is refused, naming the boards and the two ways on; with the flag it runs and
says so.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from edgefleet.brokers.local_broker import LocalBroker
from tests.conftest import AgentFactory
from tests.helpers import train_command, wait_boards_online
from tests.hostile.board_keys import agent_config, finish, make_keys

FAST_S = 60.0  # a refusal comes before any board is asked: seconds, not a join's timeout


def _train(broker: LocalBroker, fleet_key: Path, run_dir: Path, *extra: str) -> list[str]:
    return train_command(*extra, broker=broker, fleet_key=fleet_key, boards="tok-1", model="lenet5", dataset="digits",
                         steps=3, batch=8, threads=1, run_dir=run_dir)


def test_a_board_with_only_a_token_is_refused_unless_the_run_allows_it(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    keys = make_keys(tmp_path, ["tok-1"])
    agents.start("tok-1", mosquitto.address, config=agent_config("tok-1", keys, keys.own["tok-1"]))
    wait_boards_online(mosquitto.address, ["tok-1"])

    started = time.monotonic()
    refused = subprocess.run(_train(mosquitto, keys.fleet_key, tmp_path / "refused"), capture_output=True, text=True,
                             timeout=FAST_S)
    assert refused.returncode == 1 and time.monotonic() - started < FAST_S, refused.stderr[-3000:]
    assert "board(s) tok-1 have no key of their own here" in refused.stderr
    assert "--allow-token-boards" in refused.stderr and "--board-keys" in refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()

    proc = subprocess.Popen(_train(mosquitto, keys.fleet_key, tmp_path / "allowed", "--allow-token-boards"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc, 240)
    assert code == 0, (out + err)[-3000:]
    assert "--allow-token-boards: board(s) tok-1 join the exchange with a token" in out + err
