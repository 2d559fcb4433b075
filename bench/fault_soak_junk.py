"""The fault soak's hostile board: junk on another board's MQTT topics, one round every second.

Run by bench/fault_soak.py inside a lab board's namespace (a compromised board on the same LAN),
as ``python bench/fault_soak_junk.py --broker HOST:PORT --board pi5-1 --run-dir DIR --stats FILE``.
It is a plain paho client, not edgefleet's link: an attacker uses whatever it likes.

Each round publishes, on the target board's topics (the coordinator subscribes to its status,
caps and events; its agent to its command topic):

- status: 100 KB of ``[`` (RecursionError in a bare ``json.loads``), valid JSON nested 30,000 deep,
  and, once the job is stepping, a forged ``offline`` status;
- caps: objects nested 5,000 deep;
- events: 1 MiB of random bytes, bytes that are not msgpack, a ``failed`` event for the running
  job unsigned and one signed with a key of the attacker's, and an event naming another board;
- telemetry: a value no board can report (cycling through them), and the 100 KB nesting retained;
- command: a ``stop`` for the running job signed with the attacker's Ed25519 key, one as a legacy
  HMAC envelope, 200 KB of junk, and every real command seen on the topic replayed.

Forged and replayed commands and the forged ``offline`` status wait for the job's first step unless
``--forge-during-join``: while boards join, the coordinator fails a board whose status goes offline,
and fails the job on a ``rejected`` event, which the real board sends (signed) when it refuses a
forged command naming the job (see bench/fault_soak.py). Counts go to ``--stats`` (JSON) after
every round; SIGTERM ends it with exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edgefleet.protocol.jobs import JobEvent, StopCommand
from edgefleet.protocol.messages import BoardStatus
from edgefleet.protocol.signing import ED25519_ALGORITHM, CoordinatorKeys, EventSigner, generate_ed25519_seed, sign_command
from edgefleet.protocol.topics import caps_topic, cmd_topic, events_topic, status_topic, telemetry_topic

PREFIX = "edgefleet/v1"
NESTED_100K = b"[" * 100_000
NESTED_VALID_60K = b"[" * 30_000 + b"]" * 30_000
NESTED_OBJECTS = b'{"a":' * 5_000 + b'"[[[[{{{{"' + b"}" * 5_000
ABSURD: list[tuple[str, Any]] = [("mem_used_bytes", 10 ** 400), ("cpu_percent", 1e308), ("temp_c", float("nan")),
                                 ("power_w", float("-inf")), ("power_source", "[bold red]x[/]"), ("interval_s", 0.0),
                                 ("cpu_percent_per_core", [10.0] * 5000), ("power_source", "\x1b[2J\x1b[H")]


def _telemetry(board: str, seq: int, name: str, value: Any) -> bytes:
    sample: dict[str, Any] = {"board_id": board, "ts": time.time(), "seq": seq, "interval_s": 1.0, "cpu_percent": 12.5,
                              "mem_total_bytes": 8_000_000_000, "mem_used_bytes": 2_000_000_000, "schema_version": 1}
    sample[name] = value
    return json.dumps(sample).encode()


class Hostile:
    """A connected attacker and what it has sent so far."""

    def __init__(self, host: str, port: int, board: str, other: str, run_dir: Path, *, forge_during_join: bool) -> None:
        self.board, self.other, self.run_dir, self.forge_during_join = board, other, run_dir, forge_during_join
        self._own: set[bytes] = set()
        self.counts: dict[str, int] = {}
        self.captured: list[bytes] = []  # real commands seen on the target's command topic
        self.connects = 0
        self.rounds = 0
        self._lock = threading.Lock()
        self._coordinator = CoordinatorKeys(ED25519_ALGORITHM, generate_ed25519_seed())  # not the fleet's key
        self._hmac_key = os.urandom(32)
        self._own_signer = EventSigner(generate_ed25519_seed())   # not the board's key
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"hostile-{board}-{os.getpid()}")
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(1, 2)  # back quickly after the soak restarts the broker
        self.client.connect_async(host, port, keepalive=10)
        self.client.loop_start()

    def _on_connect(self, client: mqtt.Client, *_: Any) -> None:
        self.connects += 1
        client.subscribe(cmd_topic(PREFIX, self.board), qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            payload = bytes(message.payload)
            if payload not in self._own and payload not in self.captured and len(self.captured) < 8 and len(payload) < 64_000:
                self.captured.append(payload)

    def _job(self) -> tuple[str | None, bool]:
        """The running job's id (from its run directory) and whether it has taken a step."""
        try:
            job_id = json.loads((self.run_dir / "config.json").read_text()).get("run_id")
        except (OSError, ValueError):
            return None, False
        try:
            stepping = (self.run_dir / "metrics.jsonl").stat().st_size > 0
        except OSError:
            stepping = False
        return job_id, stepping

    def _send(self, kind: str, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=0, retain=retain)
        if info.rc == mqtt.MQTT_ERR_SUCCESS:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def round(self) -> None:
        """One second's junk."""
        b, n = self.board, self.rounds
        status, caps, events, telemetry, cmd = (status_topic(PREFIX, b), caps_topic(PREFIX, b), events_topic(PREFIX, b),
                                                telemetry_topic(PREFIX, b), cmd_topic(PREFIX, b))
        job_id, stepping = self._job()
        self._send("nested JSON 100 KB", status, NESTED_100K)
        self._send("nested JSON 30,000 deep", status, NESTED_VALID_60K)
        self._send("nested objects", caps, NESTED_OBJECTS)
        self._send("random 1 MiB", events, os.urandom(1 << 20))
        self._send("bad msgpack", events, b"\xc1\xc1" + os.urandom(64))
        name, value = ABSURD[n % len(ABSURD)]
        self._send("absurd telemetry", telemetry, _telemetry(b, n, name, value))
        self._send("retained nested JSON", telemetry, NESTED_100K, retain=True)
        self._send("junk command 200 KB", cmd, os.urandom(200_000))
        if job_id is not None:
            failed = JobEvent(job_id=job_id, board_id=b, phase="failed", message="forged: out of memory", ts=time.time())
            self._send("forged failed event, unsigned", events, failed.to_msgpack())
            self._send("forged failed event, other key", events, failed.to_msgpack(self._own_signer))
            other = JobEvent(job_id=job_id, board_id=self.other, phase="failed", message="forged: another board", ts=time.time())
            self._send("event naming another board", events, other.to_msgpack())
        if not (stepping or self.forge_during_join):
            self.rounds += 1
            return
        if job_id is not None:
            stop = StopCommand(job_id=job_id, board_id=b).to_dict()
            self._send_command("forged stop, other Ed25519 key", cmd, sign_command(stop, key=self._coordinator))
            self._send_command("forged stop, HMAC envelope", cmd, sign_command(stop, key=self._hmac_key))
        self._send("forged offline status", status, BoardStatus(state="offline", ts=time.time(), reason="forged").to_json())
        with self._lock:
            captured = list(self.captured)
        for payload in captured:
            self._send("replayed real command", cmd, payload)
        self.rounds += 1

    def _send_command(self, kind: str, topic: str, payload: bytes) -> None:
        with self._lock:
            self._own.add(payload)  # not to be taken for a real command when it comes back on the subscription
        self._send(kind, topic, payload)

    def stats(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "connects": self.connects, "captured_commands": len(self.captured),
                "counts": dict(self.counts)}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--broker", required=True, help="HOST:PORT")
    parser.add_argument("--board", required=True, help="the board whose topics get the junk")
    parser.add_argument("--other", required=True, help="another board of the job, named in events on --board's topic")
    parser.add_argument("--run-dir", type=Path, required=True, help="the job's run directory (its id, whether it steps)")
    parser.add_argument("--stats", type=Path, required=True, help="counts written here (JSON) after every round")
    parser.add_argument("--forge-during-join", action="store_true",
                        help="forged commands and statuses from the start, not only once the job steps")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between rounds (default 1)")
    args = parser.parse_args(argv)
    host, _, port = args.broker.rpartition(":")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    hostile = Hostile(host, int(port), args.board, args.other, args.run_dir,
                      forge_during_join=args.forge_during_join)
    try:
        while not stop.wait(args.interval):
            if hostile.client.is_connected():
                hostile.round()
            tmp = args.stats.with_suffix(".tmp")
            tmp.write_text(json.dumps(hostile.stats()))
            tmp.replace(args.stats)
    finally:
        hostile.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
