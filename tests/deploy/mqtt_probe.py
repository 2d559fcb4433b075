"""A plain paho client for checking a broker's authentication and ACL from outside."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


class Probe:
    """One MQTT connection over TLS; records the CONNACK reason and the messages it receives."""

    def __init__(self, port: int, ca: Path, *, client_id: str, username: str = "", password: str = "") -> None:
        self.connack = threading.Event()
        self.subscribed = threading.Event()
        self.reason = ""
        self.messages: list[tuple[str, bytes]] = []
        self.arrived = threading.Condition()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        if username:
            self.client.username_pw_set(username, password)
        self.client.tls_set(ca_certs=str(ca), tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *args: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object, properties: object) -> None:
        self.reason = str(reason_code)
        self.connack.set()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self.arrived:
            self.messages.append((message.topic, message.payload))
            self.arrived.notify_all()

    def wait_for(self, topic: str, payload: bytes, timeout_s: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: (topic, payload) in self.messages, timeout=timeout_s)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def connack_reason(port: int, ca: Path, *, username: str = "", password: str = "", timeout_s: float = 10) -> str:
    """The broker's answer to a connection attempt ("Success", "Not authorized", …)."""
    probe = Probe(port, ca, client_id=f"edgefleet:probe-{username or 'anonymous'}", username=username, password=password)
    try:
        assert probe.connack.wait(timeout_s), "no CONNACK from the broker"
        return probe.reason
    finally:
        probe.close()
