"""The metrics page's HTTP server: prometheus_client's WSGI app behind a server that bounds its clients.

prometheus_client's own ``start_http_server`` gives every connection a thread and never times one
out: 150 clients that connect and send nothing (a slowloris on the same network) held 150 threads
for as long as they liked. Here a client that sends or takes nothing for :data:`CLIENT_TIMEOUT_S`
is closed, and at most :data:`MAX_CLIENTS` connections are served at once (one more is closed at
once; Prometheus scrapes with one connection at a time). A scrape is small and quick: neither
limit touches it.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from edgefleet.protocol.address import HostPort

log = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 10.0  # a client that sends or takes nothing for this long is closed
MAX_CLIENTS = 32         # connections served at once


class _QuietHandler(WSGIRequestHandler):
    """One connection, no access log on stderr (its ``timeout``, which StreamRequestHandler sets on the
    connection, is :data:`CLIENT_TIMEOUT_S` as it is when the server starts)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CLIENTS` of them."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d clients already connected; closed one from %s", MAX_CLIENTS, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_server(app: Any, listen: HostPort) -> tuple[WSGIServer, threading.Thread]:
    """Serve the WSGI ``app`` on ``listen`` from a daemon thread; returns the server and its thread.

    Raises:
        OSError: the address cannot be listened on.
    """
    family = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family})
    handler_class = type("MetricsHandler", (_QuietHandler,), {"timeout": CLIENT_TIMEOUT_S})
    server: WSGIServer = make_server(listen.host, listen.port, app, server_class, handler_class=handler_class)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread


__all__ = ["CLIENT_TIMEOUT_S", "MAX_CLIENTS", "start_server"]
