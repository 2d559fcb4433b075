"""Home Assistant's view of a board that trains: its state sensor goes idle -> training -> idle and its
progress sensor counts the job's steps, read from what a real agent publishes during a real ``train``."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.agent.home_assistant import ENTITIES, entity_config
from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.messages import BoardCaps, BoardStatus, TelemetrySample
from edgefleet.protocol.topics import status_topic, telemetry_topic
from tests.agent.test_home_assistant import render
from tests.board_watch import PREFIX
from tests.helpers import wait_until

BOARD = "ha-trainer-1"
STEPS = 150


class Recorder:
    """Every payload published on some topics, in order of arrival (one paho client)."""

    def __init__(self, broker: LocalBroker, *topics: str) -> None:
        self.lock = threading.Lock()
        self.payloads: dict[str, list[bytes]] = {t: [] for t in topics}
        ready = threading.Event()

        def on_connect(client: mqtt.Client, *_: object) -> None:
            client.subscribe([(t, 1) for t in topics])
            ready.set()

        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"recorder-{uuid.uuid4().hex[:8]}")
        self.client.on_connect = on_connect
        self.client.on_message = self._message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert ready.wait(10)

    def _message(self, client: mqtt.Client, userdata: object, m: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.payloads[m.topic].append(bytes(m.payload))

    def of(self, topic: str) -> list[bytes]:
        with self.lock:
            return list(self.payloads[topic])

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _configs() -> dict[str, dict[str, Any]]:
    caps = BoardCaps(board_id=BOARD, hostname="h", model="m", machine="x86_64", cores=1, ram_bytes=1 << 30)
    return {e.object_id: entity_config(e, caps=caps, topic_prefix=PREFIX, interval_s=0.2) for e in ENTITIES}


def test_a_training_board_shows_training_and_its_steps_then_idle_again(make_fleet: Any, tmp_path: Path) -> None:
    fleet = make_fleet((BOARD,), config_extra="[telemetry]\ninterval_s = 0.2\nhome_assistant = true\n", wait="online")
    status, telemetry = status_topic(PREFIX, BOARD), telemetry_topic(PREFIX, BOARD)
    recorder = Recorder(fleet.broker, status, telemetry)
    configs = _configs()
    try:
        done = fleet.train(boards=BOARD, model="lenet5", model_options="optimizer=sgd,lr=0.05", dataset="digits", seed=3,
                           threads=1, steps=STEPS, run_dir=tmp_path / "run", timeout_s=300)
        assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
        # Back to idle: the last status is online again, and a sample after it has no job in it.
        wait_until(lambda: BoardStatus.from_json(recorder.of(status)[-1]).state == "online", timeout_s=30, what="online again")
        idle_from = len(recorder.of(telemetry))
        wait_until(lambda: len(recorder.of(telemetry)) > idle_from + 1, timeout_s=10, what="a sample after the job")

        shown = [render(configs["state"]["value_template"], p) for p in recorder.of(status)]
        assert "training" in shown and shown[-1] == "idle", shown
        assert all(s in configs["state"]["options"] for s in shown)
        samples = [TelemetrySample.from_json(p) for p in recorder.of(telemetry)]
        during = [s for s in samples if s.job_total_steps is not None]
        assert during and {s.job_total_steps for s in during} == {STEPS}
        steps = [s.job_steps_done for s in during if s.job_steps_done is not None]
        assert steps and steps == sorted(steps) and 1 <= steps[0] and steps[-1] <= STEPS
        percents = [float(render(configs["job_progress_percent"]["value_template"], p)) for p in recorder.of(telemetry)
                    if json.loads(p).get("job_total_steps")]
        assert percents and 0 <= min(percents) and max(percents) <= 100
        last = recorder.of(telemetry)[-1]
        assert render(configs["job_progress_percent"]["value_template"], last) == "None"  # idle: unknown
        energy = [s.energy_wh for s in samples if s.energy_wh is not None]
        assert len(energy) == len(samples) and energy == sorted(energy)  # total_increasing: never down
    finally:
        recorder.close()
