"""A real agent refuses strangers' commands and says why; a job it cannot run fails with the reason."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.coordinator.local_broker import LocalBroker
from edgefleet.protocol.jobs import JobEvent, TrainCommand
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.signing import sign_command
from edgefleet.protocol.topics import cmd_topic, events_topic, status_topic
from edgefleet.transport.fleet_key import generate_key_hex
from tests.conftest import AgentFactory
from tests.helpers import wait_until

PREFIX = "edgefleet/v1"


class Client:
    """A plain paho client: publishes commands, collects job events and the board's status."""

    def __init__(self, broker: LocalBroker, board: str) -> None:
        self.events: list[JobEvent] = []
        self.states: list[str] = []
        self.ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{board}-{time.monotonic_ns()}")
        self.c.on_connect = lambda c, *_: (c.subscribe([(events_topic(PREFIX, board), 1), (status_topic(PREFIX, board), 1)]),
                                           self.ready.set())
        self.c.on_message = self._message
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        assert self.ready.wait(10)

    def _message(self, c: mqtt.Client, userdata: object, m: mqtt.MQTTMessage) -> None:
        if m.topic.endswith("/status"):
            self.states.append(BoardStatus.from_json(m.payload).state)
        else:
            self.events.append(JobEvent.from_msgpack(m.payload))

    def wait_online(self) -> None:
        """Until the board's status says online: as a coordinator does before it sends a command."""
        wait_until(lambda: "online" in self.states, timeout_s=20, what="the board online")

    def publish(self, board: str, payload: bytes) -> None:
        self.c.publish(cmd_topic(PREFIX, board), payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _command(board: str, **over: object) -> dict:
    fields = dict(job_id="job-x", board_id=board, exchange_host="127.0.0.1", exchange_port=9, token="t",
                  model="lenet5", dataset="digits", board_index=0, batch_sizes=[8], seed=0, total_steps=5)
    fields.update(over)
    return TrainCommand(**fields).to_dict()  # type: ignore[arg-type]


def test_unsigned_forged_stale_and_replayed_commands_are_refused_with_reasons(tmp_path: Path, mosquitto: LocalBroker,
                                                                              agents: AgentFactory) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_text(generate_key_hex())
    key_file.chmod(0o600)
    key = bytes.fromhex(key_file.read_text())
    agent = agents.start("sec-1", mosquitto.address, config=f'board_id = "sec-1"\n[security]\nfleet_key_file = "{key_file}"\n')
    client = Client(mosquitto, "sec-1")
    try:
        client.wait_online()
        client.publish("sec-1", msgpack.packb(_command("sec-1")))                               # unsigned
        forged = bytearray(sign_command(_command("sec-1"), key=b"k" * 32))
        client.publish("sec-1", bytes(forged))                                                   # another key
        client.publish("sec-1", sign_command(_command("sec-1"), key=key, now=time.time() - 3600))  # stale
        signed = sign_command(_command("sec-1", exchange_port=9, model="no-such-model"), key=key)
        client.publish("sec-1", signed)                                                          # valid, once
        client.publish("sec-1", signed)                                                          # replayed
        client.publish("sec-1", sign_command(_command("other-board"), key=key))                  # not for us
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
    client = Client(mosquitto, "nokey-1")
    try:
        client.wait_online()
        assert "refuse every training command" in agent.log()
        client.publish("nokey-1", sign_command(_command("nokey-1"), key=b"k" * 32))
        wait_until(lambda: "no fleet key configured" in agent.log(), timeout_s=20, what="refusal")
    finally:
        client.close()
