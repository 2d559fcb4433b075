"""A plain paho client for tests: publishes commands to one board and collects its job events and states."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.topics import cmd_topic, events_topic, status_topic
from tests.helpers import wait_until

PREFIX = "edgefleet/v1"


class BoardWatch:
    """Subscribes to one board's events and status; publishes on its command topic."""

    def __init__(self, broker: LocalBroker, board: str) -> None:
        self.board = board
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

    def phases(self, job_id: str) -> list[str]:
        return [e.phase for e in list(self.events) if e.job_id == job_id]

    def wait_state(self, state: str) -> None:
        """Until the board's status says ``state`` (e.g. online: as a coordinator waits before it sends a command)."""
        wait_until(lambda: state in self.states, timeout_s=30, what=f"board {self.board} {state}")

    def publish(self, payload: bytes) -> None:
        self.c.publish(cmd_topic(PREFIX, self.board), payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()
