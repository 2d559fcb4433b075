"""``edge-agent``'s command line habits: journald priority prefixes, the shipped example config, and a
reader that closes the pipe early."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgefleet.agent.__main__ import JournalFormatter, journal_priority, stdout_is_journal

REPO = Path(__file__).resolve().parents[2]


def _record(level: int, message: str, exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord("edgefleet.agent", level, __file__, 1, message, None, exc_info)  # type: ignore[arg-type]


@pytest.mark.parametrize("level, priority", [
    (logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6), (logging.DEBUG, 7), (25, 6),
])
def test_each_level_gets_the_sd_daemon_priority_journald_reads(level: int, priority: int) -> None:
    assert journal_priority(level) == priority
    line = JournalFormatter("%(levelname)s %(name)s: %(message)s").format(_record(level, "broker lost"))
    assert line.startswith(f"<{priority}>") and line.endswith("edgefleet.agent: broker lost")


def test_every_line_of_a_traceback_carries_the_prefix() -> None:
    try:
        raise RuntimeError("sensor gone")
    except RuntimeError:
        record = _record(logging.ERROR, "sampling failed\nsecond line", sys.exc_info())
    lines = JournalFormatter("%(message)s").format(record).split("\n")
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>RuntimeError: sensor gone"


def test_journal_stream_must_name_the_descriptor_itself(tmp_path: Path) -> None:
    with (tmp_path / "out").open("w") as out, (tmp_path / "other").open("w") as other:
        stat = os.fstat(out.fileno())
        stream = f"{stat.st_dev}:{stat.st_ino}"
        assert stdout_is_journal(stream, out.fileno())
        assert not stdout_is_journal(stream, other.fileno())  # inherited by a child whose output went elsewhere
    assert not stdout_is_journal(None, 1) and not stdout_is_journal("garbage", 1) and not stdout_is_journal("1:2:3", 1)


def test_under_systemd_the_agent_logs_with_priority_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "journal"
    script = ("import logging; from edgefleet.agent.__main__ import configure_logging; configure_logging(False); "
              "logging.getLogger('edgefleet.agent').warning('hot'); logging.getLogger('edgefleet.agent').info('fine')")
    with out.open("w") as stdout:
        stat = os.fstat(stdout.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}
        subprocess.run([sys.executable, "-c", script], stdout=stdout, env=env, check=True, timeout=60)
    assert out.read_text().splitlines() == ["<4>WARNING edgefleet.agent: hot", "<6>INFO edgefleet.agent: fine"]


def test_the_shipped_example_config_passes_check_config() -> None:
    done = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(REPO / "examples" / "agent.toml"),
                           "--check-config"], capture_output=True, text=True, timeout=60, env={**os.environ, "EDGEFLEET_BROKER": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# config OK") and 'password_file = ""' in done.stdout


def test_check_config_into_a_closed_pipe_ends_quietly() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the agent writes a byte: its write fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(REPO / "examples" / "agent.toml"),
                               "--check-config"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize("name, write, says", [
    ("board id with a newline", lambda d: (d / "agent.toml").write_text('[agent]\nboard_id = "pi-1\\n"\n'), "board_id"),
    ("config not UTF-8", lambda d: (d / "agent.toml").write_bytes(b'[agent]\nboard_id = "pi-\xff"\n'), "not UTF-8"),
    ("nested beyond reason", lambda d: (d / "agent.toml").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n"), "nests"),
    ("password file not UTF-8", lambda d: ((d / "pw").write_bytes(b"\xff\xfe"),
                                           (d / "agent.toml").write_text(f'[broker]\npassword_file = "{d / "pw"}"\n')), "not UTF-8"),
])
def test_a_hostile_config_file_exits_78_with_its_reason(tmp_path: Path, name: str, write: Any, says: str) -> None:
    """A bad config is a configuration error (78: systemd does not restart the agent), named, never a traceback."""
    write(tmp_path)
    done = subprocess.run([sys.executable, "-m", "edgefleet.agent", "--config", str(tmp_path / "agent.toml"), "--check-config"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "EDGEFLEET_BROKER": ""})
    assert done.returncode == 78, (name, done.returncode, done.stderr[-2000:])
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
