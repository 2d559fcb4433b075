"""Fixtures: a real Mosquitto broker per session, and real agent processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgefleet.brokers.local_broker import INSTALL_HINT, LocalBroker, start_mosquitto

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as a user builds it (the rollout installs it; the packaging tests read it)."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (built,) = out.glob("edgefleet-*.whl")
    return built


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[LocalBroker]:
    """A real Mosquitto on a free loopback port, anonymous clients allowed."""
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.fail(f"mosquitto is not installed: {INSTALL_HINT} (or run .ci/run)")
    with start_mosquitto() as broker:
        yield broker


@dataclass
class AgentProcess:
    board_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class AgentFactory:
    """Starts real ``edge-agent`` processes and always stops them."""

    tmp_path: Path
    procs: list[AgentProcess] = field(default_factory=list)

    def start(self, board_id: str, broker: str, *, config: str = "", args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> AgentProcess:
        conf = self.tmp_path / f"{board_id}.toml"
        conf.write_text(config or f'board_id = "{board_id}"\n')
        log_path = self.tmp_path / f"{board_id}.log"
        cmd = [sys.executable, "-m", "edgefleet.agent", "--config", str(conf), "--broker", broker, *args]
        with log_path.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        agent = AgentProcess(board_id, proc, log_path)
        self.procs.append(agent)
        return agent

    def stop_all(self) -> None:
        for agent in self.procs:
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(timeout=10)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[AgentFactory]:
    factory = AgentFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
