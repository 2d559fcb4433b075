"""The demo's fallback broker (in-process, loopback only) carries a real agent's status and will."""

from __future__ import annotations

import signal

from edgefleet.brokers.embedded_broker import start_embedded_broker
from tests.conftest import AgentFactory
from tests.helpers import status_json, wait_until


def test_agent_goes_online_and_offline_through_the_in_process_broker(agents: AgentFactory) -> None:
    with start_embedded_broker() as broker:
        assert broker.host == "127.0.0.1"
        agent = agents.start("emb-1", broker.address, args=("--interval", "0.2"))
        wait_until(lambda: status_json(broker.address).get("emb-1", {}).get("health") == "ok", timeout_s=30,
                   what="agent online through the in-process broker")
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=5) == 0
        row = status_json(broker.address)["emb-1"]
        assert (row["state"], row["offline_reason"]) == ("offline", "stopped")
