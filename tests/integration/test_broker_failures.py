"""A dead broker and wrong credentials: clear log lines and retries, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from edgefleet.brokers.local_broker import free_port, start_mosquitto
from tests.conftest import AgentFactory
from tests.helpers import status_json, wait_until


def test_agent_retries_until_the_broker_comes_up(agents: AgentFactory) -> None:
    port = free_port()
    agent = agents.start("it-late", f"127.0.0.1:{port}", args=("--interval", "0.2"))
    wait_until(lambda: "cannot connect" in agent.log(), timeout_s=15, what="a 'cannot connect' log line")
    assert agent.proc.poll() is None, agent.log()
    with start_mosquitto(port=port) as broker:
        wait_until(lambda: status_json(broker.address).get("it-late", {}).get("health") == "ok",
                   timeout_s=30, what="late agent online")
    assert "Traceback" not in agent.log()
    assert agent.log().count("cannot connect") <= 2  # one line per attempt window, not one per attempt


def test_wrong_credentials_are_reported_and_retried(tmp_path: Path, agents: AgentFactory) -> None:
    passwords = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwords), "pi-1", "right-secret"], check=True, capture_output=True)
    subprocess.run(["mosquitto_passwd", "-b", str(passwords), "ops", "ops-secret"], check=True, capture_output=True)
    coord_conf = tmp_path / "coordinator.toml"
    coord_conf.write_text('[broker]\nusername = "ops"\npassword = "ops-secret"\n')
    with start_mosquitto(anonymous=False, extra_config=f"password_file {passwords}\n") as broker:
        secret = tmp_path / "secret"
        secret.write_text("wrong-secret\n")
        config = f'board_id = "it-auth"\n[broker]\nusername = "pi-1"\npassword_file = "{secret}"\n'
        agent = agents.start("it-auth", broker.address, config=config, args=("--interval", "0.2"))
        wait_until(lambda: "Not authorized" in agent.log(), timeout_s=15, what="an authorisation error in the log")
        line = next(line for line in agent.log().splitlines() if "Not authorized" in line)
        assert "username" in line and "password" in line  # says what to fix
        assert agent.proc.poll() is None and "Traceback" not in agent.log()

        # The operator fixes the password file; the agent's next start connects.
        agent.proc.terminate()
        agent.proc.wait(timeout=5)
        secret.write_text("right-secret\n")
        agents.start("it-auth", broker.address, config=config, args=("--interval", "0.2"))
        wait_until(lambda: status_json(broker.address, config=coord_conf).get("it-auth", {}).get("health") == "ok",
                   timeout_s=30, what="agent online with the right password")
