"""Job events signed by the board's own key: a forged "failed" no longer drops a healthy board.

A real `edge-coordinator train --board-keys DIR` checks every event against the board's public key;
forged events on the board's topic (unsigned, or signed with another key) are dropped with one
warning naming the board, and the job finishes. A board with no key in DIR is refused before the
job starts. The demo makes every key itself and checks events end to end. Real Mosquitto, real
agents, a real coordinator process.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.jobs import JobEvent, TrainCommand
from edgefleet.protocol.signing import CoordinatorKeys, EventSigner, generate_ed25519_seed
from edgefleet.protocol.topics import events_topic
from tests.conftest import AgentFactory
from tests.helpers import train_command, wait_boards_online, wait_until
from tests.hostile.board_keys import make_keys

PREFIX = "edgefleet/v1"
FAST_S = 45.0


def _keys(tmp_path: Path, boards: list[str]) -> tuple[Path, Path, dict[str, Path], Path]:
    """The coordinator's key, the boards' public copy of it, each board's own key, and the --board-keys directory."""
    keys = make_keys(tmp_path, boards)
    return keys.fleet_key, keys.fleet_pub, keys.own, keys.board_keys


def _config(board: str, fleet_pub: Path, own: Path | None) -> str:
    board_key = f'board_key_file = "{own}"\n' if own is not None else ""
    return f'board_id = "{board}"\n[power]\nsource = "estimated"\n[security]\nfleet_key_file = "{fleet_pub}"\n{board_key}'


def _train(broker: LocalBroker, key: Path, board_keys: Path, run_dir: Path, boards: str) -> subprocess.Popen[str]:
    cmd = train_command("--board-keys", str(board_keys), broker=broker, fleet_key=key, boards=boards, model="lenet5",
                        dataset="digits", steps=12, batch=8, threads=1, run_dir=run_dir)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Forger:
    """Someone on the broker: watches a board's events and publishes forged ones on its topic."""

    def __init__(self, broker: LocalBroker, board: str) -> None:
        self.topic = events_topic(PREFIX, board)
        self.events: list[JobEvent] = []
        ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"forger-{board}-{time.monotonic_ns()}")
        self.c.on_connect = lambda c, *_: (c.subscribe(self.topic, 1), ready.set())
        self.c.on_message = lambda c, u, m: self.events.append(JobEvent.from_msgpack(m.payload))
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        assert ready.wait(10)

    def publish(self, payload: bytes) -> None:
        self.c.publish(self.topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_forged_failed_events_are_dropped_and_the_job_finishes(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    fleet_key, fleet_pub, own, board_keys = _keys(tmp_path, ["sig-1"])
    agents.start("sig-1", mosquitto.address, config=_config("sig-1", fleet_pub, own["sig-1"]))
    wait_boards_online(mosquitto.address, ["sig-1"])
    forger = Forger(mosquitto, "sig-1")
    proc = _train(mosquitto, fleet_key, board_keys, tmp_path / "run", "sig-1")
    try:
        accepted = wait_until(lambda: [e for e in forger.events if e.phase == "accepted"] or proc.poll() is not None,
                              timeout_s=90, what="the board to accept the job")
        assert isinstance(accepted, list), "train ended before the board accepted"
        forged = JobEvent(job_id=accepted[0].job_id, board_id="sig-1", phase="failed", message="forged: out of memory",
                          ts=time.time())
        forger.publish(forged.to_msgpack())                                         # unsigned
        forger.publish(forged.to_msgpack(EventSigner(generate_ed25519_seed())))    # signed with another key
        forger.publish(forged.to_msgpack(EventSigner(generate_ed25519_seed())))
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        forger.close()
    output = out + err
    assert proc.returncode == 0, output[-3000:]
    assert "forged: out of memory" not in output and "board sig-1 failed" not in output
    warnings = [line for line in err.splitlines() if "dropped a job event on board sig-1's topic" in line]
    assert len(warnings) == 1, err[-3000:]  # once a minute per board, however many forgeries
    assert "unsigned event" in warnings[0] or "bad event signature" in warnings[0]
    assert "shared HMAC" not in output and "Traceback" not in output


def test_a_board_without_a_key_is_refused_before_the_job_starts(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    fleet_key, fleet_pub, _, board_keys = _keys(tmp_path, ["keyed-2"])
    agents.start("keyless-2", mosquitto.address, config=_config("keyless-2", fleet_pub, None))
    wait_boards_online(mosquitto.address, ["keyless-2"])
    started = time.monotonic()
    proc = _train(mosquitto, fleet_key, board_keys, tmp_path / "run", "keyless-2")
    try:
        out, err = proc.communicate(timeout=FAST_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and time.monotonic() - started < FAST_S, (out + err)[-3000:]
    assert f"--board-keys {board_keys}: no public key for board(s) keyless-2" in err
    assert "keyless-2.pub" in err and "Traceback" not in out + err


def test_the_demo_fleet_signs_commands_and_events_with_fresh_ed25519_keys() -> None:
    from edgefleet.coordinator.control.board_channel import BoardChannel
    from edgefleet.coordinator.run.demo import demo_fleet, wait_online

    with demo_fleet(2) as fleet:
        keys = CoordinatorKeys.from_bytes(fleet.fleet_key)
        assert keys.algorithm == "ed25519" and set(keys.board_keys or {}) == set(fleet.boards)
        wait_online(fleet)
        board = fleet.boards[0]

        async def one_job() -> list[str]:
            channel = BoardChannel(fleet.broker, fleet.fleet_key, [board])
            await channel.open()
            try:
                channel.send(board, TrainCommand(
                    job_id="demo-check", board_id=board, exchange_host="127.0.0.1", exchange_port=9, token="t",
                    model="no-such-model", dataset="digits", board_index=0, batch_sizes=[8], seed=0,
                    total_steps=1).to_dict())
                phases: list[str] = []
                while not {"accepted", "failed"} <= set(phases):
                    event = await channel.next_event(60)
                    assert event is not None, f"no event from {board} (its events must pass the signature check)"
                    phases.append(event.phase)
                return phases
            finally:
                channel.close()

        phases = asyncio.run(one_job())
        assert phases[0] == "accepted" and "failed" in phases
