"""Fixtures shared by the protocol tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture()
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(sender, receiver): a real TCP connection on 127.0.0.1, both ends blocking."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()
