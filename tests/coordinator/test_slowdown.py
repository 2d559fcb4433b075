"""Why a board slowed: the cause named from its telemetry and caps, never a bare "thermal?"."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.coordinator.control.board_channel import BoardChannel
from edgefleet.coordinator.run.rebalance import Rebalancer
from edgefleet.coordinator.run.slowdown import slowdown_cause
from edgefleet.protocol.messages import BoardCaps, TelemetrySample
from edgefleet.transport.settings import BrokerSettings
from tests.conftest import AgentFactory


def _caps(board: str, host: str, *, cores: int = 4, threads: int = 4) -> BoardCaps:
    return BoardCaps(board_id=board, hostname=host, model="test board", machine="aarch64", cores=cores,
                     ram_bytes=4 << 30, train_threads=threads)


def _sample(board: str, **fields: Any) -> TelemetrySample:
    return TelemetrySample(board_id=board, ts=1.0, seq=1, interval_s=1.0, **fields)


def test_the_demos_local_boards_name_the_shared_cpu_not_heat() -> None:
    caps = {b: _caps(b, "vm", cores=2, threads=1) for b in ("demo-pi4", "demo-pi5", "demo-nano")}
    telemetry = {"demo-pi5": _sample("demo-pi5", cpu_percent=97.4, temp_c=52.0, load_avg_1m=3.1)}
    cause = slowdown_cause("demo-pi5", telemetry=telemetry, caps=caps, this_host="vm")
    assert cause == "CPU shared: vm's 2 cores also run 2 other boards and the coordinator, 97% busy"
    assert "thermal" not in cause


def test_firmware_throttling_and_heat_come_first() -> None:
    caps = {"pi-1": _caps("pi-1", "pi-1")}
    throttled = _sample("pi-1", temp_c=83.2, throttled_bits=0x50005, throttled_now=True, soft_temp_limit_now=True,
                        freq_capped_now=False, under_voltage_now=False)
    assert slowdown_cause("pi-1", telemetry={"pi-1": throttled}, caps=caps, this_host="laptop") == \
        "throttled by its firmware: throttled, soft temperature limit, 83 °C"
    hot = _sample("pi-1", temp_c=86.0)
    assert slowdown_cause("pi-1", telemetry={"pi-1": hot}, caps=caps, this_host="laptop") == "hot: 86 °C"
    volts = _sample("pi-1", temp_c=50.0, under_voltage_now=True)
    assert slowdown_cause("pi-1", telemetry={"pi-1": volts}, caps=caps, this_host="laptop").startswith(
        "throttled by its firmware: under-voltage")


def test_other_processes_and_the_unknown() -> None:
    caps = {"x86-1": _caps("x86-1", "x86-1", cores=4, threads=2)}
    loaded = _sample("x86-1", temp_c=55.0, load_avg_1m=6.5, cpu_percent=100.0)
    assert slowdown_cause("x86-1", telemetry={"x86-1": loaded}, caps=caps, this_host="laptop") == \
        "other processes: load 6.5 on 4 cores, training uses 2, 55 °C"
    cool = _sample("x86-1", temp_c=55.0, load_avg_1m=2.2, cpu_percent=60.0, throttled_bits=0)
    assert slowdown_cause("x86-1", telemetry={"x86-1": cool}, caps=caps, this_host="laptop") == \
        "cause unknown, 55 °C, no throttling flag, CPU 60% busy"
    assert slowdown_cause("x86-1", telemetry={}, caps={}, this_host="laptop") == "cause unknown: no telemetry from it"


def test_the_rebalancers_message_carries_the_cause() -> None:
    per_sample = {"a": 0.02, "b": 0.02}
    asked: list[str] = []

    def explain(board: str) -> str:
        asked.append(board)
        return "CPU shared: vm's 2 cores also run 1 other board and the coordinator, 99% busy"

    rebalancer = Rebalancer({"a": 16, "b": 16}, threshold=0.15, window=5, explain=explain)
    decision = None
    for step in range(60):
        speeds = per_sample if step < 15 else {"a": 0.04, "b": 0.02}
        decision = decision or rebalancer.observe({b: n * speeds[b] for b, n in rebalancer.batch_sizes.items()}, step=step)
    assert decision is not None and asked == ["a"]
    assert decision.message.startswith("a slowed 100% (CPU shared: vm's 2 cores also run 1 other board and the "
                                       "coordinator, 99% busy): batches 16,16 -> ")
    plain = Rebalancer({"a": 16, "b": 16}, threshold=0.15, window=5)
    for step in range(60):
        speeds = per_sample if step < 15 else {"a": 0.04, "b": 0.02}
        found = plain.observe({b: n * speeds[b] for b, n in plain.batch_sizes.items()}, step=step)
        if found is not None:
            assert found.message.startswith("a slowed 100%: batches") and "thermal" not in found.message
            break
    else:
        raise AssertionError("no decision without explain")
    assert np.isfinite(decision.predicted_step_s)


def test_the_training_channel_keeps_each_boards_latest_telemetry(mosquitto: LocalBroker, agents: AgentFactory,
                                                                 fleet_key: Path) -> None:
    """A real agent on this machine: the channel train uses holds its caps and telemetry, and the cause names
    this machine's shared CPU (the demo's case)."""
    agents.start("slow-1", mosquitto.address, args=("--interval", "0.2"))

    async def watch() -> str:
        channel = BoardChannel(BrokerSettings(host=mosquitto.host, port=mosquitto.port), fleet_key.read_bytes(), ["slow-1"])
        await channel.open()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not ("slow-1" in channel.telemetry and "slow-1" in channel.caps):
                await asyncio.sleep(0.1)
            assert "slow-1" in channel.telemetry, "no telemetry reached the channel"
            return slowdown_cause("slow-1", telemetry=channel.telemetry, caps=channel.caps)
        finally:
            channel.close()

    cause = asyncio.run(watch())
    assert cause.startswith(f"CPU shared: {socket.gethostname()}'s ") and "also run the coordinator" in cause, cause


def test_the_channel_waits_for_each_boards_capabilities_as_well_as_its_status(mosquitto: LocalBroker,
                                                                              fleet_key: Path) -> None:
    """The broker sends each topic's retained message on its own: a board's status can reach a new channel before
    its capabilities, whose address a pipeline's command needs (seen when a revised pipeline's run started)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from edgefleet.protocol.messages import BoardStatus
    from edgefleet.protocol.topics import DEFAULT_PREFIX, caps_topic, status_topic

    board = "late-1"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"late-board-{time.monotonic_ns()}")
    client.connect(mosquitto.host, mosquitto.port)
    client.loop_start()

    async def wait() -> bool:
        channel = BoardChannel(BrokerSettings(host=mosquitto.host, port=mosquitto.port), fleet_key.read_bytes(), [board])
        await channel.open()
        try:
            status = BoardStatus(state="online", ts=time.time()).to_json()
            client.publish(status_topic(DEFAULT_PREFIX, board), status, qos=1, retain=True).wait_for_publish(5)
            deadline = time.monotonic() + 10
            while board not in channel.status and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert board in channel.status and board not in channel.caps
            waiting = asyncio.create_task(channel.wait_for_status(timeout_s=10))
            await asyncio.sleep(0)  # the wait has looked once: the status is there, the capabilities not yet
            caps = _caps(board, "late-host").to_json()
            client.publish(caps_topic(DEFAULT_PREFIX, board), caps, qos=1, retain=True).wait_for_publish(5)
            await waiting
            return board in channel.caps
        finally:
            channel.close()

    try:
        assert asyncio.run(wait())
    finally:
        for topic in (status_topic(DEFAULT_PREFIX, board), caps_topic(DEFAULT_PREFIX, board)):
            client.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
        client.disconnect()
        client.loop_stop()
