"""A job's runs on one board: a re-planned run keeps the job's id on a new exchange (a pipeline revised around a
board). Its command replaces an earlier run still going, and a late stop for the earlier run leaves it alone. Real
workers (torch imported, the model built) against listening sockets that stand for the two runs' exchanges."""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from edgefleet.agent.job_runner import JobRunner
from edgefleet.protocol.jobs import JobEvent, StopCommand, TrainCommand

JOB = "lenet5-digits-1"


@contextmanager
def _exchange() -> Iterator[socket.socket]:
    """A socket that stands for a run's exchange: it takes the worker's connection and never answers its hello."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(90.0)  # a worker imports torch and builds the model before it connects
    try:
        yield listener
    finally:
        listener.close()


def _train(port: int) -> bytes:
    command = TrainCommand(job_id=JOB, board_id="b1", exchange_host="127.0.0.1", exchange_port=port, token="t",
                           model="lenet5", dataset="digits", board_index=0, batch_sizes=[8], seed=0, total_steps=2,
                           threads=1)
    return json.dumps(command.to_dict()).encode()


def _stop(port: int) -> bytes:
    return json.dumps(StopCommand(job_id=JOB, board_id="b1", exchange_port=port).to_dict()).encode()


def _closed(conn: socket.socket) -> bool:
    """Whether the worker's end of ``conn`` is closed (its hello read past), without waiting."""
    while True:
        try:
            if not conn.recv(65536, socket.MSG_DONTWAIT):
                return True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            return True


def test_a_replanned_run_replaces_the_earlier_one_and_its_late_stop_leaves_the_new_one_alone() -> None:
    events: list[JobEvent] = []
    runner = JobRunner(board_id="b1", verify=json.loads, publish_event=events.append, set_busy=lambda busy: None)
    conns: list[socket.socket] = []
    try:
        with _exchange() as first, _exchange() as second:
            runner.handle(_train(first.getsockname()[1]))
            conns.append(first.accept()[0])
            # the coordinator re-planned: the same job on a new exchange while the first run's worker still waits
            runner.handle(_train(second.getsockname()[1]))
            conns.append(second.accept()[0])  # before: dropped as a repeated delivery, and the new run waited forever
            old, new = conns
            old.settimeout(30.0)
            while old.recv(65536):  # the earlier run's worker was stopped: its connection ends
                pass
            runner.handle(_stop(first.getsockname()[1]))  # the earlier run's stop, late: returns once acted on
            assert runner.busy and not _closed(new)  # before: it stopped the new run's worker
            runner.handle(_stop(second.getsockname()[1]))
            assert _closed(new)
    finally:
        runner.stop()
        for conn in conns:
            conn.close()
    phases: list[tuple[str, Any]] = [(e.phase, e.message) for e in events if e.phase != "progress"]
    assert [p for p, _ in phases][:2] == ["accepted", "accepted"], phases
    # the replaced run's worker says nothing: its "failed" would read as the new run's
    assert sum(p == "failed" for p, _ in phases) == 1, phases  # the new run's, stopped at the end


def test_a_signed_command_of_a_newer_version_is_answered_at_once_saying_so() -> None:
    """A board that runs an older edgefleet than the coordinator refuses its command and says why on the bus, so the
    run fails at once naming the board and the upgrade instead of waiting for a board that never connects."""
    from edgefleet.protocol.jobs import TRAIN_SCHEMA_VERSION
    from edgefleet.protocol.signing import CommandVerifier, sign_command

    key = b"k" * 32
    events: list[JobEvent] = []
    runner = JobRunner(board_id="b1", verify=CommandVerifier(key).verify, publish_event=events.append,
                       set_busy=lambda busy: None)
    command = TrainCommand(job_id=JOB, board_id="b1", exchange_host="127.0.0.1", exchange_port=9, token="t",
                           model="lenet5", dataset="digits", board_index=0, batch_sizes=[8], seed=0,
                           total_steps=2).to_dict()
    runner.handle(sign_command({**command, "schema_version": TRAIN_SCHEMA_VERSION + 1}, key=key))
    assert [(e.job_id, e.phase) for e in events] == [(JOB, "rejected")]
    assert f"schema_version {TRAIN_SCHEMA_VERSION + 1} is newer than this side understands" in events[0].message
    assert not runner.busy
