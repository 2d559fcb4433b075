"""The link probe across protocol versions, over real sockets: the real board side against the real probe
server, and against a fake coordinator; each side names the side to upgrade."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading

import pytest

from edgefleet.agent.link_probe import ProfileError, probe_link
from edgefleet.coordinator.planning.link_probe import LinkProbeServer
from edgefleet.protocol.probe_frames import PROBE_VERSION, Go, ProbeHello
from edgefleet.transport.frame_io import recv_frame, send_frame

TOKEN = "s" * 32


@pytest.mark.parametrize("version, upgrade", [(PROBE_VERSION + 1, "upgrade edge-coordinator"),
                                              (PROBE_VERSION - 1, "upgrade edge-agent on board b1")])
def test_the_probe_server_refuses_a_board_of_another_version(monkeypatch, caplog, version: int, upgrade: str) -> None:
    monkeypatch.setattr("edgefleet.agent.link_probe.ProbeHello", functools.partial(ProbeHello, v=version))
    message = f"board b1 speaks link probe protocol {version}, this coordinator {PROBE_VERSION}: {upgrade}"

    async def main() -> None:
        server = LinkProbeServer(job_id="p-0", token=TOKEN, boards=["b1"])
        port = await server.start("127.0.0.1")
        try:
            probe = functools.partial(probe_link, host="127.0.0.1", port=port, token=TOKEN, job_id="p-0", board_id="b1",
                                      nbytes=1000)
            with pytest.raises(ProfileError) as refused:
                await asyncio.get_running_loop().run_in_executor(None, probe)
            assert str(refused.value) == f"the coordinator refused the link probe: {message}"
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING, logger="edgefleet.coordinator.planning.link_probe"):
        asyncio.run(main())
    assert f"link probe: refused a connection: {message}" in caplog.messages


@pytest.mark.parametrize("version, upgrade", [(PROBE_VERSION + 1, "upgrade edge-agent on this board"),
                                              (PROBE_VERSION - 1, "upgrade edge-coordinator")])
def test_the_board_refuses_a_coordinator_of_another_version(version: int, upgrade: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    hellos: list[ProbeHello] = []

    def coordinator() -> None:  # takes the hello, answers go of its own version, waits for the board to close
        conn, _ = listener.accept()
        with conn, listener:
            conn.settimeout(10)
            hellos.append(ProbeHello.from_wire(recv_frame(conn)))
            send_frame(conn, Go(v=version).to_wire())
            conn.recv(1)

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    with pytest.raises(ProfileError) as refused:
        probe_link(host="127.0.0.1", port=listener.getsockname()[1], token=TOKEN, job_id="p-0", board_id="b1", nbytes=1000)
    thread.join(10)
    assert str(refused.value) == f"the coordinator speaks link probe protocol {version}, this board {PROBE_VERSION}: {upgrade}"
    assert hellos == [ProbeHello(job_id="p-0", board_id="b1", token=TOKEN, nbytes=1000, round_bytes=0, rounds=0)]
