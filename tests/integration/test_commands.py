"""A real agent refuses strangers' commands and says why; a job it cannot run fails with the reason."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.jobs import TrainCommand
from edgefleet.protocol.signing import sign_command
from tests.board_watch import BoardWatch
from tests.conftest import AgentFactory, Fleet
from tests.helpers import wait_until


def _command(board: str, **over: object) -> dict:
    fields = dict(job_id="job-x", board_id=board, exchange_host="127.0.0.1", exchange_port=9, token="t",
                  model="lenet5", dataset="digits", board_index=0, batch_sizes=[8], seed=0, total_steps=5)
    fields.update(over)
    return TrainCommand(**fields).to_dict()  # type: ignore[arg-type]


def test_unsigned_forged_stale_and_replayed_commands_are_refused_with_reasons(mosquitto: LocalBroker,
                                                                              make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(["sec-1"], power=None)  # the agent's own power source: this test runs no job
    key = bytes.fromhex(fleet.key.read_text())
    agent = fleet.agent("sec-1")
    client = BoardWatch(mosquitto, "sec-1")
    try:
        client.wait_state("online")
        client.publish(msgpack.packb(_command("sec-1")))                               # unsigned
        forged = bytearray(sign_command(_command("sec-1"), key=b"k" * 32))
        client.publish(bytes(forged))                                                   # another key
        client.publish(sign_command(_command("sec-1"), key=key, now=time.time() - 3600))  # stale
        signed = sign_command(_command("sec-1", exchange_port=9, model="no-such-model"), key=key)
        client.publish(signed)                                                          # valid, once
        client.publish(signed)                                                          # replayed
        client.publish(sign_command(_command("other-board"), key=key))                  # not for us
        wait_until(lambda: agent.log().count("refused a command") >= 5, timeout_s=20, what="five refusals")
        log = agent.log()
        assert "not a signed command" in log
        assert "bad signature" in log
        assert "stale" in log
        assert "replayed" in log
        assert "'other-board'" in log
        # The valid command ran, and failed before training with the reason and what exists.
        failed = wait_until(lambda: [e for e in client.events if e.phase == "failed"], timeout_s=60, what="failed event")
        assert "no-such-model" in failed[0].message and "lenet5" in failed[0].message
        # The forged one was answered (its job would otherwise wait for this board), once for job-x
        # (the stale one, same job, is not told again); the replay and the unsigned one were not.
        rejected = [e for e in client.events if e.phase == "rejected"]
        assert len(rejected) == 1 and "bad signature" in rejected[0].message and "fleet key differs" in rejected[0].message
        assert next(e.phase for e in client.events if e.phase != "rejected") == "accepted"
        assert "Traceback" not in log
    finally:
        client.close()


def test_without_a_fleet_key_every_command_is_refused(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    agent = agents.start("nokey-1", mosquitto.address)
    client = BoardWatch(mosquitto, "nokey-1")
    try:
        client.wait_state("online")
        assert "refuse every training command" in agent.log()
        client.publish(sign_command(_command("nokey-1"), key=b"k" * 32))
        wait_until(lambda: "no fleet key configured" in agent.log(), timeout_s=20, what="refusal")
    finally:
        client.close()
