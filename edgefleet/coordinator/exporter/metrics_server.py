"""The HTTP endpoint Prometheus scrapes, and the fleet view behind it.

:func:`serve_fleet_metrics` is what ``edge-coordinator exporter`` and ``train --metrics-listen``
run: a fleet view kept current from the broker, rendered by :class:`FleetCollector` (plus any
other collectors, such as a training run's) on ``http://HOST:PORT/metrics``. Its own registry, not
prometheus_client's global one, so nothing else in the process leaks onto the page.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgefleet.coordinator.control.fleet import DEFAULT_MAX_BOARDS
from edgefleet.coordinator.control.monitor import monitor_fleet
from edgefleet.coordinator.exporter.http_server import start_server
from edgefleet.protocol.address import HostPort, parse_host_port
from edgefleet.protocol.errors import ConfigError, EdgeTrainError

if TYPE_CHECKING:
    from prometheus_client.registry import Collector, CollectorRegistry

    from edgefleet.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9465
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_METRICS_PORT}"
LISTEN_HELP = ("Anyone who can reach that address can read the page (board ids, models, load, power; no secrets) with no "
               "password: keep it on 127.0.0.1 or a trusted network, or firewall the port to the Prometheus server")


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """Where the page is served (the port the system gave when the address said 0)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


def parse_listen(text: str, *, what: str = "--listen") -> HostPort:
    """``HOST:PORT``, ``HOST`` (port 9465) or ``[v6addr]:PORT``. Raises ConfigError naming ``what`` and the fix."""
    return parse_host_port(text, what=what, default_port=DEFAULT_METRICS_PORT)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_prometheus_client() -> None:
    try:
        # optional (coordinator extra): is it installed?
        import prometheus_client  # noqa: F401
    except ImportError:
        raise EdgeTrainError("serving metrics needs the 'prometheus-client' package: pip install 'edgefleet[coordinator]'") from None


@contextmanager
def serve_metrics(registry: CollectorRegistry, listen: HostPort) -> Iterator[MetricsEndpoint]:
    """Serve ``registry`` on ``http://listen/metrics`` from a background thread until the block ends
    (``exporter.http_server``: slow clients time out, the connections served at once are bounded).

    Raises:
        ConfigError: the address cannot be listened on (in use, not this machine's), naming it and the fix.
    """
    from prometheus_client import make_wsgi_app  # optional (coordinator extra), checked first

    try:
        server, thread = start_server(make_wsgi_app(registry), listen)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror or exc}; choose another address or port "
                          "(HOST:PORT; a host of this machine, 127.0.0.1 for this machine only)") from None
    endpoint = MetricsEndpoint(listen.host, int(server.server_address[1]))
    where = "this machine only" if is_loopback(listen.host) else "anyone who can reach it, with no password"
    log.info("serving Prometheus metrics on %s (readable by %s)", endpoint.url, where)
    try:
        yield endpoint
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def serve_fleet_metrics(settings: BrokerSettings, listen: HostPort, *, collectors: Iterable[Collector] = (),
                        max_boards: int = DEFAULT_MAX_BOARDS, connect_timeout_s: float = 5.0) -> Iterator[MetricsEndpoint]:
    """Follow the fleet on the broker and serve its boards (and ``collectors``) until the block ends.

    Raises:
        BrokerError: the broker could not be reached within ``connect_timeout_s``.
        ConfigError: the address cannot be listened on.
        EdgeTrainError: prometheus-client is not installed (with the pip command).
    """
    _require_prometheus_client()
    # prometheus_client: optional (coordinator extra), checked just above
    from prometheus_client import CollectorRegistry
    from prometheus_client.process_collector import ProcessCollector

    from edgefleet.coordinator.exporter.fleet_collector import counting_collector

    with monitor_fleet(settings, connect_timeout_s=connect_timeout_s, max_boards=max_boards) as view:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(counting_collector(view))
        for collector in collectors:
            registry.register(collector)
        with serve_metrics(registry, listen) as endpoint:
            yield endpoint


__all__ = ["DEFAULT_LISTEN", "DEFAULT_METRICS_PORT", "LISTEN_HELP", "MetricsEndpoint", "is_loopback", "parse_listen",
           "serve_fleet_metrics", "serve_metrics"]
