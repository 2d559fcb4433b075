"""A paho-mqtt 2.x client with edgefleet's connection policy, used by both sides.

It speaks MQTT 3.1.1 unless told otherwise, reconnects with backoff, renews subscriptions on every
reconnect (they are made in ``on_connect``), sets the last will, and turns paho's reason codes into
one clear log line per attempt window instead of a traceback.

Nothing a peer publishes can raise out of the message callback: an exception there would end paho's
network thread, and with it every later message (a frozen ``status --watch``, a ``train`` that no
longer hears its boards). The message is dropped instead, with a rate-limited warning naming the topic.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edgefleet.protocol.errors import BrokerError
from edgefleet.transport.log_limit import LogLimiter, suppressed_text
from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 1
RECONNECT_MAX_S = 30
LOG_WINDOW_S = 60.0  # a failure that repeats is logged again at most this often
DROP_LOG_BURST = 3   # dropped messages warned about per LOG_WINDOW_S; the others are counted
_TOPIC_SHOWN = 120   # characters of a topic quoted in a warning
PROBE_TIMEOUT_S = 3.0  # a probe of why a connection failed waits at most this long per step

# Every client id edgefleet asks a broker for starts with this. The shipped Mosquitto configurations
# admit no other (clientid_prefixes), and no board id can start with it (a board id holds no ':'):
# a board's client id on the broker is its user name (use_username_as_clientid on the boards'
# listener), so no connection on either listener can take a board's client id and knock it off.
CLIENT_ID_PREFIX = "edgefleet:"


def agent_client_id(board_id: str) -> str:
    """The client id an agent asks for (the boards' listener replaces it by the board's user name)."""
    return f"{CLIENT_ID_PREFIX}agent:{board_id}"


def coordinator_client_id(role: str) -> str:
    """A client id for one coordinator connection: unique, and unguessable, so that no one else on the
    coordinator's listener (a read-only user) can take it and knock that connection off."""
    return f"{CLIENT_ID_PREFIX}coordinator:{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}"


_AUTH_HINTS = {
    "Not authorized": "check broker.username and broker.password (or password_file), and the broker's ACL",
    "Bad user name or password": "check broker.username and broker.password (or password_file)",
    "Client identifier not valid": "the board id is refused by the broker; choose another id",
    "Unsupported protocol version": 'the broker does not speak this MQTT version; set broker.protocol = "3.1.1"',
}


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


MessageHandler = Callable[[str, bytes, bool], None]  # (topic, payload, retained)


class _FailureLog:
    """Logs a repeated connection failure once per window, with a count."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.last_text = ""
        self.last_logged = 0.0
        self.suppressed = 0

    def failed(self, text: str) -> None:
        now = time.monotonic()
        if text != self.last_text or now - self.last_logged >= LOG_WINDOW_S:
            extra = f" ({self.suppressed} more attempts since the last report)" if self.suppressed else ""
            log.warning("broker %s: %s. Retrying with backoff (at most %d s apart)%s", self.address, text, RECONNECT_MAX_S, extra)
            self.last_text, self.last_logged, self.suppressed = text, now, 0
        else:
            self.suppressed += 1

    def connected(self) -> None:
        if self.last_text:
            log.info("broker %s: connected after earlier failures", self.address)
        self.last_text, self.suppressed = "", 0


def _probe(settings: BrokerSettings) -> str:
    """Why a connection to the broker fails, in words (called only when logging): name resolution, TCP, then TLS."""
    host, port = settings.host, settings.port
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            return _probe_tls(settings, sock) if settings.uses_tls else _probe_plain(host, port)
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} ({exc.strerror}); check broker.host / --broker"
    except OSError as exc:
        return f"cannot connect ({exc.strerror or exc}); check that the broker runs and listens on that port"


def _probe_tls(settings: BrokerSettings, sock: socket.socket) -> str:
    """Why a TLS connection fails: the broker's certificate against the CA file, or a port that speaks no TLS."""
    ca = settings.tls_ca_file or "the system's CA bundle"
    try:
        context = ssl.create_default_context(cafile=settings.tls_ca_file or None)
        with context.wrap_socket(sock, server_hostname=settings.host):
            return "TLS works but the MQTT handshake failed; check broker.protocol and the broker's log"
    except ssl.SSLCertVerificationError as exc:
        return (f"the broker's TLS certificate does not verify against {ca} (certificate verify failed: "
                f"{exc.verify_message}): that CA did not sign the broker's certificate, or the address is not in it; "
                "check broker.tls_ca_file")
    except ssl.SSLError as exc:
        return (f"the TLS handshake failed ({exc.reason or exc}): is {settings.host}:{settings.port} a plain MQTT port? "
                "Use mqtt:// there, or the broker's TLS port (8883)")
    except OSError as exc:
        return f"TCP connects but the TLS handshake failed ({exc}); check broker.tls_ca_file and the broker's log"


def _probe_plain(host: str, port: int) -> str:
    """Why a plain MQTT connection fails once TCP connects: a TLS port, or something else."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only: does this port speak TLS at all?
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock, context.wrap_socket(sock):
            return (f"{host}:{port} speaks TLS: use mqtts://{host}:{port} (--broker, or broker.tls_ca_file: the CA "
                    "that signed its certificate)")
    except (ssl.SSLError, OSError):
        return "TCP connects but the MQTT handshake failed; check broker.protocol and the broker's log"


class MqttLink:
    """One MQTT connection that keeps itself up until ``close()``.

    Args:
        settings: broker address, credentials, TLS and protocol.
        client_id: unique per connection (a duplicate kicks the other client off); starts with
            ``CLIENT_ID_PREFIX`` for a broker configured as examples/mosquitto.conf is.
        will: published by the broker if this client vanishes without ``close()``.
        on_connect: called on the network thread after every successful (re)connect; subscribe here.
        on_message: called on the network thread for each message; must not block. An exception it
            raises drops that message (a rate-limited warning names the topic) and nothing else.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        *,
        client_id: str,
        will: Will | None = None,
        on_connect: Callable[[MqttLink], None] | None = None,
        on_message: MessageHandler | None = None,
        max_queued_messages: int = 1000,
    ) -> None:
        self.settings = settings
        self.connected = threading.Event()
        self._on_connect_cb = on_connect
        self._on_message_cb = on_message
        self._refused = False   # the broker's CONNACK refused the attempt under way
        self._closing = False
        self._failures = _FailureLog(settings.address())
        self._drop_log = LogLimiter(window_s=LOG_WINDOW_S, burst=DROP_LOG_BURST)
        self.dropped_messages = 0  # messages whose handler raised (counted, never re-raised)
        protocol = MQTTProtocolVersion.MQTTv5 if settings.protocol == "5" else MQTTProtocolVersion.MQTTv311
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        if settings.username:
            self._client.username_pw_set(settings.username, settings.password or None)
        if settings.uses_tls:
            try:
                self._client.tls_set(
                    ca_certs=settings.tls_ca_file,
                    certfile=settings.tls_cert_file or None,
                    keyfile=settings.tls_key_file or None,
                    tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (OSError, ssl.SSLError) as exc:
                raise BrokerError(f"TLS files for broker {settings.address()} cannot be used: {exc}") from None
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        self._client.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)
        self._client.max_queued_messages_set(max_queued_messages)
        self._client.on_connect = self._handle_connect
        self._client.on_connect_fail = self._handle_connect_fail
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_message = self._handle_message

    def start(self) -> None:
        """Connect in the background; retries forever with backoff until ``close()``."""
        try:
            self._client.connect_async(self.settings.host, self.settings.port, keepalive=self.settings.keepalive_s)
        except ValueError as exc:
            raise BrokerError(f"broker address {self.settings.address()} is not usable: {exc}") from None
        self._client.loop_start()

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    @property
    def last_failure(self) -> str:
        """Why the latest connection attempt failed, in words with what to check ("" if none failed since it connected)."""
        return self._failures.last_text

    def publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self._client.publish(topic, payload, qos=qos, retain=retain)

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        self._client.subscribe(topic_filter, qos=qos)

    def local_address(self) -> str:
        """The address this side of the broker connection is bound to ("" while not connected).

        The network routes the broker's traffic to it, so it is one other hosts on the broker's network can reach
        (a board's pipeline stage links use it). Valid from ``on_connect`` on, which runs once the socket exists.
        """
        getsockname = getattr(self._client.socket(), "getsockname", None)  # a TLS socket answers as its TCP one does
        try:
            name = getsockname() if getsockname is not None else None
        except OSError:  # closed meanwhile
            return ""
        return str(name[0]) if isinstance(name, tuple) and name else ""

    def close(self, *, final: list[tuple[str, bytes]] | None = None, timeout_s: float = 1.0) -> None:
        """Publish ``final`` retained QoS-1 messages (if connected), then disconnect cleanly.

        A clean disconnect suppresses the will, so a stopping board publishes its own offline status
        through ``final``.
        """
        deadline = time.monotonic() + timeout_s
        self._closing = True
        if self.connected.is_set():
            infos = [self._client.publish(t, p, qos=1, retain=True) for t, p in final or []]
            for info in infos:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    info.wait_for_publish(remaining)
                except (ValueError, RuntimeError):
                    break
        self._client.disconnect()
        self._client.loop_stop()
        self.connected.clear()

    # paho callbacks: all on the network thread, never blocking.
    def _handle_connect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object, properties: object) -> None:
        if getattr(reason_code, "is_failure", False):
            text = str(reason_code)
            hint = _AUTH_HINTS.get(text, "see the broker's log")
            self._failures.failed(f"refused the connection: {text}; {hint}")
            self._refused = True  # said why: the disconnect that follows adds nothing
            return
        self._failures.connected()
        log.info("connected to broker %s (MQTT %s)", self.settings.address(), self.settings.protocol)
        self.connected.set()
        if self._on_connect_cb is not None:
            self._on_connect_cb(self)

    def _handle_connect_fail(self, client: mqtt.Client, userdata: object) -> None:
        self._failures.failed(_probe(self.settings))

    def _handle_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason_code: object, properties: object) -> None:
        was_connected = self.connected.is_set()
        self.connected.clear()
        refused, self._refused = self._refused, False
        if was_connected and getattr(reason_code, "value", 0) != 0:
            log.warning("lost broker %s (%s); reconnecting", self.settings.address(), reason_code)
        elif not was_connected and not refused and not self._closing:  # closed before its CONNACK: say why
            self._failures.failed(_probe(self.settings))

    def _handle_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        # The boundary: whatever the payload does to the handler, paho's network thread lives on.
        if self._on_message_cb is None:
            return
        try:
            self._on_message_cb(message.topic, bytes(message.payload), bool(message.retain))
        except Exception as exc:  # deliberately everything: RecursionError, OverflowError, ...
            self._dropped(message, exc)

    def _dropped(self, message: mqtt.MQTTMessage, exc: Exception) -> None:
        self.dropped_messages += 1
        suppressed = self._drop_log.allow()
        if suppressed is None:
            return
        try:
            topic = repr(message.topic[:_TOPIC_SHOWN])
        except UnicodeDecodeError:
            topic = "a topic that is not UTF-8"
        log.warning("dropped a %d-byte message on %s: %s: %.200s. Whoever publishes there sent something this side "
                    "cannot use; the connection and every other topic carry on%s", len(message.payload), topic,
                    type(exc).__name__, str(exc) or "no details", suppressed_text(suppressed, LOG_WINDOW_S))
        log.debug("the dropped message's traceback", exc_info=exc)


__all__ = ["MqttLink", "Will"]
