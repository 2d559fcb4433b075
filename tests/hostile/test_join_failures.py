"""A job whose board cannot take it fails within seconds, naming the board and the reason, instead of waiting
the 180 s join timeout and then blaming the network: a board with another fleet key or none answers the
command with a refusal, and a board whose agent dies while joining is dropped as soon as the broker says it
is offline. Real Mosquitto, real agents, a real `edge-coordinator train`."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from edgefleet.brokers.local_broker import LocalBroker
from edgefleet.protocol.signing import sign_command
from edgefleet.transport.fleet_key import generate_key_hex
from tests.board_watch import BoardWatch
from tests.conftest import Fleet
from tests.helpers import train_command, wait_boards_online, wait_until, write_fleet_key

FAST_S = 45.0  # far below the 180 s join timeout; a board's worker import alone takes a few seconds here


def _train(broker: LocalBroker, key: Path, run_dir: Path, boards: str) -> subprocess.Popen[str]:
    cmd = train_command(broker=broker, fleet_key=key, boards=boards, model="lenet5", dataset="digits", steps=20, threads=1,
                        run_dir=run_dir)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"train still waiting after {timeout_s:.0f} s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return proc.returncode, out + err


def test_a_board_with_another_fleet_key_or_none_fails_the_job_at_once_naming_it(
        tmp_path: Path, mosquitto: LocalBroker, make_fleet: Callable[..., Fleet]) -> None:
    coordinator_key = write_fleet_key(tmp_path / "coordinator.key")
    make_fleet(["keyed-1"], wait=None)                  # a fleet of its own: it trusts another key than the coordinator's
    make_fleet(["keyless-1"], secure=False, wait=None)  # no fleet key at all (both are waited for together below)
    wait_boards_online(mosquitto.address, ["keyed-1", "keyless-1"])

    for board, expected in (("keyed-1", "its fleet key differs from the coordinator's"),
                            ("keyless-1", "has no fleet key (security.fleet_key_file is not set)")):
        started = time.monotonic()
        code, output = _finish(_train(mosquitto, coordinator_key, tmp_path / f"run-{board}", board), FAST_S)
        took = time.monotonic() - started
        assert code != 0 and f"board {board}" in output and expected in output, output[-3000:]
        assert "did not connect to the exchange within" not in output  # not blamed on the network
        assert "Traceback" not in output and took < FAST_S


def test_a_board_whose_agent_dies_while_joining_is_dropped_as_soon_as_the_broker_says_so(
        tmp_path: Path, mosquitto: LocalBroker, make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(["dying-1"], wait="online")
    agent = fleet.agent("dying-1")
    proc = _train(mosquitto, fleet.key, tmp_path / "run", "dying-1")
    try:
        # The agent took the command and starts its worker (which imports torch for seconds): kill both,
        # as a power cut or an OOM kill of the unit would.
        wait_until(lambda: "starting a worker" in agent.log() or proc.poll() is not None, timeout_s=60,
                   what="the agent to accept the job")
        family = psutil.Process(agent.proc.pid)
        for process in [*family.children(recursive=True), family]:
            process.kill()
        killed = time.monotonic()
        code, output = _finish(proc, FAST_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and "board dying-1: went offline while joining" in output, output[-3000:]
    assert time.monotonic() - killed < 30 and "Traceback" not in output


def test_a_forged_command_for_the_job_while_boards_join_does_not_fail_the_job(
        tmp_path: Path, mosquitto: LocalBroker, make_fleet: Callable[..., Fleet]) -> None:
    # Someone who can write the command topic (the coordinator's MQTT credentials, or a broker without
    # the ACL) sends a command for the running job signed with another key: the board refuses it with a
    # `rejected` event for the job, but it has accepted the real command, so the job goes on.
    fleet = make_fleet(["joining-1"], wait="online")
    agent = fleet.agent("joining-1")
    watch = BoardWatch(mosquitto, "joining-1")
    proc = _train(mosquitto, fleet.key, tmp_path / "run", "joining-1")
    try:
        wait_until(lambda: "starting a worker" in agent.log() or proc.poll() is not None, timeout_s=60,
                   what="the agent to accept the job")
        found = re.search(r"job (\S+): ", agent.log().split("starting a worker")[0].splitlines()[-1])
        assert found is not None, agent.log()[-2000:]
        job_id = found.group(1)
        forged = {"kind": "stop", "job_id": job_id, "board_id": "joining-1"}
        watch.publish(sign_command(forged, key=bytes.fromhex(generate_key_hex())))
        wait_until(lambda: "rejected" in watch.phases(job_id) or proc.poll() is not None, timeout_s=30,
                   what="the board to refuse the forged command")
        code, output = _finish(proc, 120)
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
    assert "rejected" in watch.phases(job_id)
    assert code == 0 and "Traceback" not in output, output[-3000:]
