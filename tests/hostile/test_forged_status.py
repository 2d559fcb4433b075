"""A forged ``offline`` status for a board while it joins does not end the job: statuses are not signed, so
an offline status counts only once it stood a few seconds unanswered, and a running agent answers one on its
own topic at once with its real status. (A board whose agent really dies is still dropped within seconds:
tests/hostile/test_join_failures.py.) Real Mosquitto without an ACL, a real agent with its own key, a real
``edge-coordinator train --board-keys``."""

from __future__ import annotations

from pathlib import Path

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.topics import status_topic
from tests.board_watch import PREFIX, BoardWatch
from tests.conftest import AgentFactory
from tests.helpers import wait_boards_online, wait_until
from tests.hostile.board_keys import agent_config, finish, make_keys, start_train


def test_a_forged_offline_status_while_a_board_joins_does_not_end_the_job(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    board = "joining-2"
    keys = make_keys(tmp_path, [board])
    agent = agents.start(board, mosquitto.address, config=agent_config(board, keys, keys.own[board]))
    wait_boards_online(mosquitto.address, [board])
    watch = BoardWatch(mosquitto, board)
    proc = start_train(mosquitto, keys, tmp_path / "run", board)
    try:
        # The board took the job and its worker imports torch (seconds) before it joins: forge its death now.
        wait_until(lambda: any(e.phase == "accepted" for e in list(watch.events)) or proc.poll() is not None,
                   timeout_s=60, what="the board to accept the job")
        forged = BoardStatus(state="offline", reason="forged: connection lost").to_json()
        topic = status_topic(PREFIX, board)
        watch.c.publish(topic, forged, qos=1).wait_for_publish(5)
        watch.c.publish(topic, forged, qos=1, retain=True).wait_for_publish(5)
        code, out, err = finish(proc, 120)
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
    output = out + err
    assert code == 0, output[-3000:]
    assert "went offline" not in output and "forged: connection lost" not in output and "Traceback" not in output
    assert "an offline status for this board was published while it runs" in agent.log()
