"""Hostile MQTT input against a real Mosquitto, real paho publishers, real agents and the real coordinator.

Each test has a topic prefix of its own, so its retained junk stays its own. "Alive" is always shown
the same way: after the junk, a good message is published and the test waits (condition and timeout,
never a sleep) until the view or the CLI shows it, which only a surviving network thread can do.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.coordinator.control.fleet import BoardRow, FleetView
from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.topics import caps_topic, cmd_topic, status_topic, telemetry_topic
from edgefleet.transport.mqtt_link import DROP_LOG_BURST, MqttLink
from edgefleet.transport.settings import BrokerSettings
from tests.conftest import AgentFactory, AgentProcess
from tests.helpers import coordinator, wait_until
from tests.hostile.mqtt_payloads import CLOSING_TAG, HUGE_INT, MARKUP, NESTED_100K, NESTED_OBJECTS, NESTED_VALID_60K, telemetry

Message = tuple[str, bytes, bool]  # topic, payload, retained


def _publish(broker: LocalBroker, messages: Iterable[Message]) -> None:
    """Publish with a real paho client at QoS 1 and wait until the broker has acknowledged each one."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"hostile-{uuid.uuid4().hex[:8]}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1, retain=retained) for topic, payload, retained in messages]
        for info in infos:
            info.wait_for_publish(timeout=30)
            assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def _settings(broker: LocalBroker, prefix: str) -> BrokerSettings:
    return BrokerSettings(host=broker.host, port=broker.port, topic_prefix=prefix)


def _config(tmp_path: Path, prefix: str) -> Path:
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[broker]\ntopic_prefix = "{prefix}"\n')
    return config


def _start_agent(agents: AgentFactory, broker: LocalBroker, board_id: str, prefix: str) -> AgentProcess:
    config = (f'board_id = "{board_id}"\n[broker]\ntopic_prefix = "{prefix}"\n'
              '[power]\nsource = "estimated"\nidle_w = 2.0\nmax_w = 6.0\n')
    return agents.start(board_id, broker.address, config=config, args=("--interval", "0.2"))


def _status(broker: LocalBroker, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``edge-coordinator status`` as a user runs it; never a traceback, whatever the broker holds."""
    done = coordinator("--broker", broker.address, "--config", str(config), "status", *args)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    return done


def _status_rows(broker: LocalBroker, config: Path, *args: str) -> dict[str, dict[str, Any]]:
    return {row["board_id"]: row for row in json.loads(_status(broker, config, "--json", *args).stdout)}


def _wait_healthy(broker: LocalBroker, config: Path, board_id: str) -> dict[str, dict[str, Any]]:
    """``status --json`` rows, once ``board_id`` (a real agent) shows as healthy in them."""
    found: dict[str, dict[str, Any]] = {}

    def healthy() -> bool:
        found.clear()
        found.update(_status_rows(broker, config))
        return found.get(board_id, {}).get("health") == "ok"

    wait_until(healthy, timeout_s=30, what=f"the real agent {board_id} healthy in `status --json`")
    return found


def _row(view: FleetView, board_id: str) -> BoardRow | None:
    return next((r for r in view.rows() if r.board_id == board_id), None)


def _wait_for_seq(view: FleetView, board_id: str, seq: int) -> None:
    wait_until(lambda: (row := _row(view, board_id)) is not None and row.sample is not None and row.sample.seq == seq
               and row.health == "ok", timeout_s=10, what=f"{board_id}'s sample {seq} in the live view")


def test_nested_json_on_a_boards_own_topics_cannot_stop_the_live_view(mosquitto: LocalBroker) -> None:
    # Prepare: the live view that `status --watch` and `train --auto` use, and a healthy board in it.
    prefix = "hostile-nested/v1"
    with monitor_fleet(_settings(mosquitto, prefix)) as view:
        assert view.replayed.wait(10)
        _publish(mosquitto, [(telemetry_topic(prefix, "good-1"), telemetry("good-1", seq=1), False)])
        _wait_for_seq(view, "good-1", 1)

        # Execute: what the shipped ACL lets a board write on its own topics, live and retained.
        _publish(mosquitto, [
            (telemetry_topic(prefix, "evil-1"), NESTED_100K, False),
            (status_topic(prefix, "evil-1"), NESTED_VALID_60K, True),
            (caps_topic(prefix, "evil-2"), NESTED_OBJECTS, True),
            (telemetry_topic(prefix, "good-1"), telemetry("good-1", seq=2), False),
        ])

        # Assert: the network thread survived (the good sample after the junk arrived), the junk is bad data.
        _wait_for_seq(view, "good-1", 2)
        rows = {r.board_id: r for r in view.rows()}
        assert rows["evil-1"].health == "bad-data" and rows["evil-1"].bad_messages == 2
        assert "over the limit" in rows["evil-1"].last_error
        assert rows["evil-2"].health == "bad-data"


def test_retained_nested_json_does_not_break_a_later_status(mosquitto: LocalBroker, agents: AgentFactory,
                                                            tmp_path: Path) -> None:
    # Prepare: a real agent, and nested JSON retained on other boards' status and caps topics.
    prefix = "hostile-retained/v1"
    config = _config(tmp_path, prefix)
    _start_agent(agents, mosquitto, "good-1", prefix)
    _publish(mosquitto, [(status_topic(prefix, "evil-1"), NESTED_100K, True),
                         (status_topic(prefix, "evil-2"), NESTED_VALID_60K, True),
                         (caps_topic(prefix, "evil-3"), NESTED_OBJECTS, True)])

    # Execute + assert: every later `status` works (JSON and table), the agent's samples still fold.
    rows = _wait_healthy(mosquitto, config, "good-1")
    assert {rows[b]["health"] for b in ("evil-1", "evil-2", "evil-3")} == {"bad-data"}
    table = _status(mosquitto, config).stdout
    assert "good-1" in table and "replay marker" not in table
    assert all("bad-data" in _line(table, b) for b in ("evil-1", "evil-2", "evil-3"))


def _line(table: str, board_id: str) -> str:
    return next(line for line in table.splitlines() if line.strip().startswith(board_id + " "))


ABSURD: dict[str, dict[str, Any]] = {  # board id: the telemetry fields it lies about (retained, so every `status` sees them)
    "huge-int": {"mem_used_bytes": HUGE_INT},          # OverflowError in the table before
    "neg-mem": {"mem_used_bytes": -5},
    "big-float": {"cpu_percent": 1e308},
    "nan-temp": {"temp_c": float("nan")},
    "inf-power": {"power_w": float("inf")},
    "never-stale": {"interval_s": 1e308},
    "huge-core": {"cpu_percent_per_core": [1.0, HUGE_INT]},
}


def test_status_shows_absurd_values_as_bad_data_and_markup_as_text(mosquitto: LocalBroker, agents: AgentFactory,
                                                                   tmp_path: Path) -> None:
    # Prepare: a real agent; retained samples with absurd values; markup in power_source and a reason.
    prefix = "hostile-values/v1"
    config = _config(tmp_path, prefix)
    _start_agent(agents, mosquitto, "good-1", prefix)
    junk: list[Message] = [(telemetry_topic(prefix, board), telemetry(board, **fields), True) for board, fields in ABSURD.items()]
    junk += [(telemetry_topic(prefix, "markup-1"), telemetry("markup-1", interval_s=3600, power_source=MARKUP), True),
             (telemetry_topic(prefix, "markup-2"), telemetry("markup-2", interval_s=3600, power_source=CLOSING_TAG), True),
             (status_topic(prefix, "markup-3"), BoardStatus(state="offline", reason=CLOSING_TAG).to_json(), True)]
    _publish(mosquitto, junk)

    # Execute: `status --json` once the agent is healthy, then the table a person reads.
    rows = _wait_healthy(mosquitto, config, "good-1")
    table = _status(mosquitto, config).stdout  # OverflowError, then MarkupError, before

    # Assert: no absurd value is shown as healthy; markup is shown as the characters sent.
    for board in ABSURD:
        assert rows[board]["health"] == "bad-data", rows[board]
        assert rows[board]["cpu_percent"] is None and rows[board]["mem_used_bytes"] is None
        assert "outside what a board can report" in rows[board]["last_error"] or "finite" in rows[board]["last_error"]
        assert "bad-data" in _line(table, board)
    assert rows["markup-1"]["power_source"] == MARKUP and rows["markup-2"]["power_source"] == CLOSING_TAG
    assert _line(table, "markup-1").rstrip().endswith(MARKUP)
    assert _line(table, "markup-2").rstrip().endswith(CLOSING_TAG)
    assert f"offline ({CLOSING_TAG})" in _line(table, "markup-3")
    assert "online" in _line(table, "good-1") and "bad" not in _line(table, "good-1")


def test_a_thousand_bogus_retained_boards_are_capped_with_a_note(mosquitto: LocalBroker, agents: AgentFactory,
                                                                 tmp_path: Path) -> None:
    # Prepare: 1,000 retained statuses of boards that do not exist, and one real agent.
    prefix = "hostile-many/v1"
    config = _config(tmp_path, prefix)
    offline = BoardStatus(state="offline", reason="stopped").to_json()
    _publish(mosquitto, [(status_topic(prefix, f"bogus-{i:04d}"), offline, True) for i in range(1000)])
    _start_agent(agents, mosquitto, "good-1", prefix)

    # Execute: the snapshot as JSON (the note goes to stderr) and as the table (the note is its caption).
    rows = _wait_healthy(mosquitto, config, "good-1")
    json_run = _status(mosquitto, config, "--json")
    table = _status(mosquitto, config).stdout

    # Assert: 512 rows, the real board among them (it displaced a leftover), and a note naming the count.
    assert len(rows) == 512
    assert "489 more board(s) not shown: over the limit of 512" in json_run.stderr
    assert "489 more board(s) not shown" in " ".join(table.split()) and "--max-boards" in table
    assert len(table.splitlines()) < 600
    # A smaller limit, as the note suggests: the real board still displaces a leftover.
    small = _status_rows(mosquitto, config, "--max-boards", "10")
    assert len(small) == 10 and small["good-1"]["health"] == "ok"


def test_status_watch_keeps_drawing_through_junk(mosquitto: LocalBroker, tmp_path: Path) -> None:
    # Prepare: `status --watch` in a pseudo-terminal, as a person runs it, with a healthy board on screen.
    prefix = "hostile-watch/v1"
    config = _config(tmp_path, prefix)
    _publish(mosquitto, [(telemetry_topic(prefix, "good-1"), telemetry("good-1", interval_s=3600), True)])
    master, slave = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "edgefleet.coordinator.cli", "--broker", mosquitto.address,
                              "--config", str(config), "status", "--watch"],
                             stdout=slave, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "160"})
    os.close(slave)
    screen = b""

    def shows(*needles: bytes) -> bool:
        nonlocal screen
        screen += os.read(master, 1 << 16)
        return all(n in screen for n in needles)

    try:
        wait_until(lambda: shows(b"good-1"), timeout_s=20, what="the live table with good-1")
        # Execute: junk live on a board's own topics, then a board that appears after it.
        _publish(mosquitto, [(telemetry_topic(prefix, "evil-1"), NESTED_100K, False),
                             (status_topic(prefix, "evil-2"), NESTED_VALID_60K, False),
                             (telemetry_topic(prefix, "evil-3"), telemetry("evil-3", mem_used_bytes=HUGE_INT), False),
                             (telemetry_topic(prefix, "evil-4"), telemetry("evil-4", interval_s=3600, power_source=CLOSING_TAG), False),
                             (telemetry_topic(prefix, "late-1"), telemetry("late-1", interval_s=3600), False)])
        # Assert: the view still draws (the network thread and the drawing survived), then stops cleanly.
        wait_until(lambda: shows(b"late-1", b"evil-3", b"bad-data"), timeout_s=20, what="late-1 drawn after the junk")
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=15)
    finally:
        if watch.poll() is None:
            watch.kill()
        os.close(master)
    assert watch.returncode == 0, err
    assert "Traceback" not in err


def test_the_callback_boundary_drops_what_a_handler_cannot_take(mosquitto: LocalBroker,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a link whose handler raises on one topic, as any decoding bug would.
    prefix = "hostile-boundary"
    seen: list[str] = []

    def handler(topic: str, payload: bytes, retained: bool) -> None:
        if topic.endswith("/boom"):
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        seen.append(topic)

    link = MqttLink(_settings(mosquitto, "x"), client_id=f"boundary-{uuid.uuid4().hex[:8]}",
                    on_connect=lambda lk: lk.subscribe(f"{prefix}/#", qos=1), on_message=handler)
    link.start()
    try:
        assert link.wait_connected(10)
        def pinged() -> bool:
            _publish(mosquitto, [(f"{prefix}/ping", b"", False)])
            return bool(seen)

        wait_until(pinged, timeout_s=10, what="the subscription to be active")
        # Execute: ten messages that make the handler raise, then a good one.
        with caplog.at_level(logging.WARNING, logger="edgefleet.transport.mqtt_link"):
            _publish(mosquitto, [(f"{prefix}/boom", b"[" * 1000, False)] * 10 + [(f"{prefix}/after", b"ok", False)])
            wait_until(lambda: f"{prefix}/after" in seen, timeout_s=10, what="the message after the junk")
    finally:
        link.close()

    # Assert: the thread lived on; a few clear warnings naming the topic, the rest counted.
    assert link.dropped_messages == 10
    warnings = [r.getMessage() for r in caplog.records if "dropped a" in r.getMessage()]
    assert len(warnings) == DROP_LOG_BURST
    assert f"'{prefix}/boom'" in warnings[0] and "RecursionError" in warnings[0]


def test_an_agent_survives_junk_on_its_command_topic(mosquitto: LocalBroker, agents: AgentFactory) -> None:
    prefix = "hostile-agent/v1"
    agent = _start_agent(agents, mosquitto, "good-1", prefix)
    with monitor_fleet(_settings(mosquitto, prefix)) as view:
        wait_until(lambda: (row := _row(view, "good-1")) is not None and row.health == "ok", timeout_s=30,
                   what="the agent's samples")
        _publish(mosquitto, [(cmd_topic(prefix, "good-1"), payload, False)
                             for payload in (NESTED_100K, b"\x91" * 100_000, b"\xdd\xff\xff\xff\xff", bytes(range(256)))])
        row = _row(view, "good-1")
        assert row is not None and row.sample is not None
        seq = row.sample.seq
        wait_until(lambda: (r := _row(view, "good-1")) is not None and r.sample is not None and r.sample.seq > seq + 2,
                   timeout_s=10, what="the agent's samples after the junk")
    wait_until(lambda: agent.log().count("refused a command") >= 4, timeout_s=10, what="four refusals in the agent's log")
    assert agent.proc.poll() is None and "Traceback" not in agent.log()
