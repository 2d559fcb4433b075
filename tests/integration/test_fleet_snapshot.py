"""A status snapshot holds every board the broker retained, however little time it is given."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.topics import status_topic
from tests.helpers import coordinator

BOARDS = 400


def _retain_offline_boards(broker: LocalBroker, prefix: str, count: int) -> None:
    """Publish ``count`` retained offline statuses and wait until the broker has acknowledged each."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"retainer-{prefix}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        payload = BoardStatus(state="offline", reason="stopped").to_json()
        infos = [client.publish(status_topic(prefix, f"old-{i:03d}"), payload, qos=1, retain=True) for i in range(count)]
        for info in infos:
            info.wait_for_publish(timeout=30)
            assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def _snapshot(broker: LocalBroker, config: Path) -> subprocess.CompletedProcess[str]:
    return coordinator("--broker", broker.address, "--config", str(config), "status", "--json", "--wait", "0")


def test_a_snapshot_with_no_wait_still_holds_every_retained_board(mosquitto: LocalBroker, tmp_path: Path) -> None:
    # Prepare: many retained boards under a prefix of this test's own.
    config = tmp_path / "coordinator.toml"
    config.write_text('[broker]\ntopic_prefix = "snapshot-test/v1"\n')
    _retain_offline_boards(mosquitto, "snapshot-test/v1", BOARDS)

    # Execute: a snapshot that may not wait for samples at all.
    done = _snapshot(mosquitto, config)

    # Assert: the replay marker came back after the last retained status, so none is missing.
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == BOARDS
    assert {r["state"] for r in rows} == {"offline"}
    assert "replay marker" not in done.stderr


def test_a_broker_that_drops_the_marker_gets_a_warning_not_a_hang(tmp_path: Path) -> None:
    # Prepare: a broker whose ACL lets this user read boards but write nothing.
    acl = tmp_path / "acl"
    acl.write_text("user reader\ntopic read acl-test/v1/boards/#\n")
    passwords = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwords), "reader", "secret"], check=True, capture_output=True)
    subprocess.run(["mosquitto_passwd", "-b", str(passwords), "writer", "secret"], check=True, capture_output=True)
    with start_mosquitto(anonymous=False, extra_config=f"password_file {passwords}\nacl_file {acl}\n") as broker:
        config = tmp_path / "coordinator.toml"
        config.write_text('[broker]\ntopic_prefix = "acl-test/v1"\nusername = "reader"\npassword = "secret"\n')

        # Execute: a snapshot as that user.
        done = _snapshot(broker, config)

    # Assert: it ends, says why the fleet may be incomplete and what to check, and exits 0.
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    assert "replay marker" in done.stderr and "ACL" in done.stderr
    assert "Traceback" not in done.stderr
