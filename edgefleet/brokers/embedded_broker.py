"""An in-process MQTT 3.1.1 broker (amqtt) on loopback, for the demo when Mosquitto is not installed.

It runs on its own thread with its own event loop. Only for trying edgefleet on one machine:
production fleets use Mosquitto (``examples/mosquitto.conf``, the Ansible role).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.broker import Broker  # the [embedded-broker] extra; ImportError tells the caller it is missing

from edgefleet.brokers.ports import free_port
from edgefleet.protocol.errors import BrokerError

log = logging.getLogger(__name__)


@dataclass
class EmbeddedBroker:
    """Same surface as ``LocalBroker``: host, port, address, workdir, kind, stop()."""

    host: str
    port: int
    workdir: Path
    kind: str = "in-process broker"
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None
    _error: list[BaseException] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_broker(host: str = "127.0.0.1") -> EmbeddedBroker:
    """Start the broker bound to ``host`` only, anonymous clients allowed (it is loopback-only).

    Raises:
        BrokerError: it did not start listening.
    """
    broker = EmbeddedBroker(host=host, port=free_port(host), workdir=Path(tempfile.mkdtemp(prefix="edgefleet-broker-")))
    config: dict[str, Any] = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{broker.port}"}},  # never amqtt's 0.0.0.0 default
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    ready = threading.Event()

    async def serve() -> None:
        broker._loop, broker._stop = asyncio.get_running_loop(), asyncio.Event()
        server = Broker(config)
        await server.start()
        ready.set()
        await broker._stop.wait()
        await server.shutdown()

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported to the starting thread, which raises it as BrokerError
            broker._error.append(exc)
            ready.set()

    logging.getLogger("amqtt").setLevel(logging.WARNING)
    broker._thread = threading.Thread(target=main, name="embedded-broker", daemon=True)
    broker._thread.start()
    ready.wait(timeout=15)
    if broker._error:
        broker.stop()
        raise BrokerError(f"the in-process broker did not start: {broker._error[0]}")
    if not ready.is_set():
        broker.stop()
        raise BrokerError("the in-process broker did not start within 15 s")
    log.info("in-process broker listening on %s", broker.address)
    return broker
