"""Commands signed with the coordinator's Ed25519 key, and nonces that outlive a restart.

A board holds only the coordinator's public key (and a key of its own), so what a stolen board holds
cannot command another board; a legacy HMAC command is refused by an Ed25519 board, naming the side
to change. A command the agent accepted is refused as replayed after the agent is killed and
restarted; with its nonce record unreadable, a command issued before the start is refused rather
than trusted. Real Mosquitto, real agent processes, signed commands on the wire.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.jobs import TrainCommand
from edgefleet.protocol.signing import sign_command
from edgefleet.transport.fleet_key import load_fleet_key, private_key_text, public_key_text, write_new_key
from tests.board_watch import BoardWatch
from tests.conftest import AgentFactory, AgentProcess
from tests.helpers import wait_until


def _command(board: str, job_id: str) -> dict:
    # A job that is accepted and then fails in the worker at once (no such model): no training needed.
    return TrainCommand(job_id=job_id, board_id=board, exchange_host="127.0.0.1", exchange_port=9, token="t",
                        model="no-such-model", dataset="digits", board_index=0, batch_sizes=[8], seed=0,
                        total_steps=5).to_dict()


def _fleet_keys(tmp_path: Path) -> tuple[Path, Path]:
    """The coordinator's private key and the public key file every board holds."""
    private = tmp_path / "fleet.key"
    write_new_key(private, private_key_text())
    public = tmp_path / "fleet.pub"
    public.write_text(public_key_text(private))
    return private, public


def _board_key(tmp_path: Path, board: str) -> Path:
    key = tmp_path / f"{board}-own.key"
    write_new_key(key, private_key_text())
    return key


def _config(board: str, public: Path, board_key: Path, max_age_s: float = 30.0) -> str:
    return (f'board_id = "{board}"\n[power]\nsource = "estimated"\n[security]\nfleet_key_file = "{public}"\n'
            f'board_key_file = "{board_key}"\nmax_command_age_s = {max_age_s}\n')


def _kill(agent: AgentProcess) -> None:
    """SIGKILL the agent and its worker, as a power cut or an OOM kill would."""
    family = psutil.Process(agent.proc.pid)
    for process in [*family.children(recursive=True), family]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    agent.proc.wait(timeout=10)


def test_a_board_holding_only_public_keys_obeys_the_coordinator_and_no_one_else(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    private, public = _fleet_keys(tmp_path)
    own = {board: _board_key(tmp_path, board) for board in ("ed-1", "ed-2")}
    agent = agents.start("ed-1", mosquitto.address, config=_config("ed-1", public, own["ed-1"]))
    agents.start("ed-2", mosquitto.address, config=_config("ed-2", public, own["ed-2"]))
    client = BoardWatch(mosquitto, "ed-1")
    try:
        client.wait_state("online")
        # Everything a stolen ed-2 holds is public keys and its own key: that signs nothing ed-1 accepts.
        # (A board answers at most one refusal a second: each is sent until its answer arrives.)
        stolen_key = load_fleet_key(own["ed-2"])
        wait_until(lambda: client.phases("job-stolen") or client.publish(
            sign_command(_command("ed-1", "job-stolen"), key=stolen_key)), timeout_s=30, interval_s=0.5, what="a refusal")
        # A coordinator still on the legacy shared key: refused, naming what to change.
        wait_until(lambda: client.phases("job-legacy") or client.publish(
            sign_command(_command("ed-1", "job-legacy"), key=b"k" * 32)), timeout_s=30, interval_s=0.5, what="a refusal")
        # The coordinator's own key: accepted.
        client.publish(sign_command(_command("ed-1", "job-ok"), key=load_fleet_key(private)))
        wait_until(lambda: client.phases("job-ok")[:1] == ["accepted"], timeout_s=30, what="the coordinator's command accepted")
        stolen = next(e for e in client.events if e.job_id == "job-stolen")
        legacy = next(e for e in client.events if e.job_id == "job-legacy")
        assert stolen.phase == "rejected" and "bad signature: not signed by the coordinator key" in stolen.message
        assert "--public" in stolen.message  # what to install where
        assert legacy.phase == "rejected" and "key mismatch" in legacy.message and "shared HMAC" in legacy.message
        log = agent.log()
        assert "can command every board" not in log and "holds a private key" not in log  # no key warnings at start
        assert "Traceback" not in log
    finally:
        client.close()


def test_a_command_replayed_to_a_restarted_agent_is_refused_as_replayed(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    private, public = _fleet_keys(tmp_path)
    config = _config("nonce-1", public, _board_key(tmp_path, "nonce-1"), max_age_s=300)  # the window outlasts the restart
    agent = agents.start("nonce-1", mosquitto.address, config=config)
    client = BoardWatch(mosquitto, "nonce-1")
    try:
        client.wait_state("online")
        captured = sign_command(_command("nonce-1", "job-once"), key=load_fleet_key(private))
        client.publish(captured)
        wait_until(lambda: "accepted" in client.phases("job-once"), timeout_s=30, what="the command accepted")
        record = json.loads((tmp_path / "command-nonces-nonce-1.json").read_text())  # state_dir: the config's dir
        assert len(record["nonces"]) == 1

        _kill(agent)
        client.wait_state("offline")  # the broker published the board's will
        client.states.clear()
        restarted = agents.start("nonce-1", mosquitto.address, config=config)
        client.wait_state("online")
        client.publish(captured)  # the same bytes, well within the window
        wait_until(lambda: "refused a command" in restarted.log(), timeout_s=30, what="the replay refused")
        assert "replayed nonce" in restarted.log()
        assert client.phases("job-once").count("accepted") == 1
        assert "Traceback" not in restarted.log()
    finally:
        client.close()


def test_an_unreadable_nonce_record_refuses_commands_issued_before_the_start(
        tmp_path: Path, mosquitto: LocalBroker, agents: AgentFactory) -> None:
    private, public = _fleet_keys(tmp_path)
    (tmp_path / "command-nonces-rec-1.json").write_text('{"version": 1, "nonces": [[1, 2')  # cut short by a crash
    key = load_fleet_key(private)
    captured = sign_command(_command("rec-1", "job-before"), key=key, now=time.time() - 1)  # from before the start
    agent = agents.start("rec-1", mosquitto.address, config=_config("rec-1", public, _board_key(tmp_path, "rec-1")))
    client = BoardWatch(mosquitto, "rec-1")
    try:
        client.wait_state("online")
        assert "cannot be used" in agent.log() and "command-nonces-rec-1.json" in agent.log()
        client.publish(captured)
        wait_until(lambda: client.phases("job-before"), timeout_s=30, what="the refusal")
        refusal = next(e for e in client.events if e.job_id == "job-before")
        assert refusal.phase == "rejected" and "possibly replayed" in refusal.message
        client.publish(sign_command(_command("rec-1", "job-after"), key=key))  # issued after the start: accepted
        wait_until(lambda: "accepted" in client.phases("job-after"), timeout_s=30, what="a fresh command accepted")
        assert json.loads((tmp_path / "command-nonces-rec-1.json").read_text())["version"] == 1  # rewritten whole
        assert "Traceback" not in agent.log()
    finally:
        client.close()
