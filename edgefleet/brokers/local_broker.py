"""A Mosquitto broker on a free loopback port, for the demo, the lab and the tests."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.brokers.ports import free_port, wait_for_port
from edgefleet.protocol.errors import BrokerError

if TYPE_CHECKING:
    from edgefleet.brokers.embedded_broker import EmbeddedBroker

log = logging.getLogger(__name__)

INSTALL_HINT = "install it with 'apt-get install mosquitto' (Debian/Ubuntu/Raspberry Pi OS)"

# What the project's brokers do about Mosquitto's silent drops: the default per-client queue of
# 1,000 messages drops telemetry for a coordinator that pauses for a moment while 1,000+ boards
# publish at 1 Hz. 100,000 messages (about 50 MB of JSON) covers 20 s of 5,000 boards.
BASE_CONFIG = """\
persistence false
max_queued_messages 100000
max_inflight_messages 100
"""


@dataclass
class LocalBroker:
    """A running Mosquitto process; ``stop()`` (or the context manager) ends it."""

    host: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    kind: str = "mosquitto"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_mosquitto(*, host: str = "127.0.0.1", port: int | None = None, extra_config: str = "",
                    anonymous: bool = True, timeout_s: float = 10.0) -> LocalBroker:
    """Start Mosquitto bound to ``host`` only.

    Raises:
        BrokerError: mosquitto is not installed, or did not start (with its own words).
    """
    binary = shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if Path(p).exists()), None)
    if binary is None:
        raise BrokerError(f"mosquitto is not installed; {INSTALL_HINT}")
    port = port or free_port(host)
    workdir = Path(tempfile.mkdtemp(prefix="edgefleet-broker-"))
    conf = workdir / "mosquitto.conf"
    # Started by root, mosquitto drops to the 'mosquitto' user, which cannot read files in the
    # caller's private temporary folders (password files, ACLs); this broker stays on loopback.
    run_as = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(f"listener {port} {host}\nallow_anonymous {'true' if anonymous else 'false'}\n{run_as}{BASE_CONFIG}{extra_config}")
    log_path = workdir / "mosquitto.log"
    # Its log goes to a file: a pipe nobody reads would block the broker once full.
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir)
    broker = LocalBroker(host, port, proc, workdir)
    try:
        wait_for_port(host, port, timeout_s=timeout_s, proc=proc, log_path=log_path)
    except BaseException:
        broker.stop()
        raise
    log.info("mosquitto listening on %s", broker.address)
    return broker


def start_local_broker() -> LocalBroker | EmbeddedBroker:
    """Mosquitto on loopback if it is installed, else the in-process broker (``[embedded-broker]``).

    Raises:
        BrokerError: neither is available, saying how to get one.
    """
    if shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists():
        return start_mosquitto()
    try:
        from edgefleet.brokers.embedded_broker import start_embedded_broker  # amqtt: optional (embedded-broker extra)
    except ImportError:
        raise BrokerError(f"no MQTT broker: mosquitto is not installed ({INSTALL_HINT}) and the in-process "
                          "fallback needs: pip install '.[embedded-broker]' in the edgefleet checkout") from None
    return start_embedded_broker()
