"""Fixtures: a real Mosquitto broker per session, real agent processes, and a fleet of them with a fleet key.

A module whose tests share one fleet marks itself and asks for ``fleet``::

    pytestmark = pytest.mark.fleet(boards=("t1", "t2"), keep_worker=True)

    def test_something(fleet: Fleet, tmp_path: Path) -> None:
        done = fleet.train(boards="t1,t2", steps=5, run_dir=tmp_path / "run")

A test that needs a fleet of its own (it stops boards, or must start from fresh ones) calls ``make_fleet(boards=…)``.
The options of both are ``start_fleet``'s.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

from edgefleet.brokers.local_broker import INSTALL_HINT, LocalBroker, start_mosquitto
from tests.helpers import agent_config, train_command, wait_boards_online, wait_until, write_fleet_key
from tests.hostile.exchange_server import ServerProcess

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built as a user builds it (the rollout installs it; the packaging tests read it)."""
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)]
    if _has_build_backend():
        # The same backend pip's isolated build would fetch from the index (2-3 minutes of one worker on CI).
        command.insert(4, "--no-build-isolation")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (built,) = out.glob("edgefleet-*.whl")
    return built


def _has_build_backend() -> bool:
    """Whether this environment has the setuptools pyproject.toml asks for (77 or later), so no isolated build is needed."""
    try:
        major = int(version("setuptools").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return False
    return major >= 77


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

    def tails(self, lines: int = 30) -> str:
        """The last ``lines`` of each agent's log but its telemetry, for a failed test's message."""
        parts = []
        for agent in self.procs:
            kept = [line for line in agent.log().splitlines() if "telemetry" not in line]
            parts.append(f"--- {agent.board_id} (pid {agent.proc.pid}) ---\n" + "\n".join(kept[-lines:]))
        return "\n".join(parts)

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


@dataclass(frozen=True)
class FleetOptions:
    """How ``start_fleet`` configures and starts each agent of a fleet."""

    secure: bool = True                    # the agents trust the fleet key ([security] fleet_key_file)
    power: str | None = "estimated"        # [power] source (None: the agent's default)
    idle_w: float | None = None            # the estimated power model's watts at 0% and 100% CPU
    max_w: float | None = None
    keep_worker: bool | None = None        # [training] keep_worker (None: the agent's default)
    agent_args: tuple[str, ...] = ()       # flags of each edge-agent, e.g. ("--interval", "0.2")
    config_extra: str = ""                 # TOML appended to each agent's config
    env: dict[str, str] | None = None      # added to the agents' environment
    wait: str | None = "connected"         # "connected" (each agent's log says so), "online" (status shows all), None

    def config(self, board_id: str, key: Path) -> str:
        return agent_config(board_id, key=key if self.secure else None, power=self.power, idle_w=self.idle_w,
                            max_w=self.max_w, keep_worker=self.keep_worker, extra=self.config_extra)


@dataclass
class Fleet:
    """A broker, a fleet key and real agents that trust it; ``boards`` are the ones it started with."""

    broker: LocalBroker
    key: Path
    agents: AgentFactory
    boards: tuple[str, ...]
    options: FleetOptions

    def start(self, board_id: str, **overrides: Any) -> AgentProcess:
        """One more board (or a stopped one again), configured as the fleet's boards are but for ``overrides``."""
        options = replace(self.options, **overrides) if overrides else self.options
        agent = self._launch(board_id, options)
        if options.wait == "connected":
            _wait_connected([agent])
        return agent

    def _launch(self, board_id: str, options: FleetOptions) -> AgentProcess:
        return self.agents.start(board_id, self.broker.address, config=options.config(board_id, self.key),
                                 args=tuple(options.agent_args), env=options.env)

    def agent(self, board_id: str) -> AgentProcess:
        """The last agent process started as ``board_id``."""
        return [a for a in self.agents.procs if a.board_id == board_id][-1]

    def train_command(self, *extra: str, **options: Any) -> list[str]:
        """``edge-coordinator --broker B train --fleet-key K …`` (``tests.helpers.train_args``' keywords)."""
        return train_command(*extra, broker=self.broker, fleet_key=self.key, **options)

    def train(self, *extra: str, timeout_s: float = 240, **options: Any) -> subprocess.CompletedProcess[str]:
        """Run ``train_command(*extra, **options)`` to its end."""
        return subprocess.run(self.train_command(*extra, **options), capture_output=True, text=True, timeout=timeout_s,
                              check=False)


@contextmanager
def start_fleet(tmp: Path, broker: LocalBroker, boards: Sequence[str] | Mapping[str, Mapping[str, Any]] = ("b1", "b2"),
                **options: Any) -> Iterator[Fleet]:
    """A fleet key in ``tmp`` and one real ``edge-agent`` per board on ``broker`` (``options``: ``FleetOptions``'
    fields); every agent is stopped after. ``boards`` may map each board to options of its own
    (``{"a": {}, "b": {"keep_worker": True}}``)."""
    settings = FleetOptions(**{**options, "agent_args": tuple(options.get("agent_args", ()))})
    assert settings.wait in ("connected", "online", None), settings.wait
    tmp.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(broker, write_fleet_key(tmp / "fleet.key"), AgentFactory(tmp), tuple(boards), settings)
    try:
        started = [fleet._launch(board, replace(settings, **boards[board]) if isinstance(boards, Mapping) else settings)
                   for board in boards]  # all at once, then wait for them together
        if settings.wait == "connected":
            _wait_connected(started)
        elif settings.wait == "online":
            wait_boards_online(broker.address, list(boards))
        yield fleet
    finally:
        fleet.agents.stop_all()


def _wait_connected(agents: list[AgentProcess]) -> None:
    """Until every agent's log says it is connected to the broker; fails at once with the log of one that exited."""
    def connected() -> bool:
        for agent in agents:
            assert agent.proc.poll() is None, f"agent {agent.board_id} exited:\n{agent.log()}"
        return all("connected to broker" in agent.log() for agent in agents)

    wait_until(connected, timeout_s=60, what=f"{', '.join(a.board_id for a in agents)} connected to the broker")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fleet(boards=..., **options): the module's shared fleet (tests/conftest.py start_fleet)")
    config.addinivalue_line("markers", "untimed: a lab test that times nothing, run beside the other worker's tests")
    # `status` keeps the board ids it saw for shell completion in the user's cache: the tests' go to a folder of their own
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="edgefleet-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if Path(cache).name.startswith("edgefleet-test-cache-"):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, mosquitto: LocalBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The module's fleet on the session's broker, as its ``pytestmark = pytest.mark.fleet(boards=…, …)`` describes."""
    marker = request.node.get_closest_marker("fleet")
    assert marker is not None, f"{request.node.name}: the fleet fixture needs pytestmark = pytest.mark.fleet(boards=...)"
    with start_fleet(tmp_path_factory.mktemp(f"fleet-{request.module.__name__.rpartition('.')[2]}"), mosquitto,
                     *marker.args, **marker.kwargs) as shared:
        yield shared


@pytest.fixture
def make_fleet(mosquitto: LocalBroker, tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """``make_fleet(boards=…, **start_fleet options)``: a fleet of this test's own, stopped at its end."""
    with ExitStack() as stack:
        numbers = itertools.count()

        def make(boards: Sequence[str] = ("b1", "b2"), **options: Any) -> Fleet:
            return stack.enter_context(start_fleet(tmp_path / f"fleet-{next(numbers)}", mosquitto, boards, **options))

        yield make


@pytest.fixture
def fleet_key(tmp_path: Path) -> Path:
    """A new fleet key in the test's folder (``tests.helpers.write_fleet_key``)."""
    return write_fleet_key(tmp_path / "fleet.key")


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``tests/hostile/exchange_proc.py`` (a real ExchangeServer) in subprocesses; all are killed at the end."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(tmp_path, *args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# pytest-xdist (``-n 2 --dist loadgroup``, pyproject.toml): a test file's tests stay on one worker (its module's
# fleet is started once), and the tests that take the machine's network namespaces (the lab) or its containers
# (the image bake) run one after the other on one worker each.
_SERIAL_GROUPS = {"lab": "lab", "deploy": "deploy"}
# Every test of these folders carries the folder's marker (registered in pyproject.toml).
_FOLDER_MARKERS = ("lab", "deploy")
# The lab's tests time steps under CPU quotas: while one runs, no test runs on the other worker. Every test holds
# a shared lock on this file while it runs, a lab test an exclusive one; a turnstile lock taken before either
# keeps a worker that runs test after test from starving a lab test that waits.
_EXCLUSIVE_DIRS = ("lab",)
# ...except those marked untimed: they time nothing and leave the host's own names alone (test_teardown counts every
# efl-* name, so it stays alone), so they run beside the other worker's tests, slower but to the same result.
_LOCK_DIR = Path(os.environ.get("TMPDIR", "/tmp"))
# EDGEFLEET_TEST_TIMELINE=FILE: each test's worker, wait for the lock and run, one line a test (tab-separated epoch
# seconds), to see where the suite's wall time goes (a lab test's wait is the other worker's idle time)
_TIMELINE = os.environ.get("EDGEFLEET_TEST_TIMELINE", "")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve().relative_to(REPO)
        group = _SERIAL_GROUPS.get(path.parts[1], str(path)) if len(path.parts) > 2 else str(path)
        item.add_marker(pytest.mark.xdist_group(name=group))
        if len(path.parts) > 2 and path.parts[1] in _FOLDER_MARKERS:  # -m "not lab and not deploy": scripts/test --quick
            item.add_marker(path.parts[1])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist: a lab test runs alone on the machine, the others two at a time (setup and teardown included)."""
    worker = getattr(item.config, "workerinput", None)  # an xdist worker's own (a nested pytest run has its own uid)
    if worker is None:  # one process: nothing else runs beside it
        yield
        return
    run = worker["testrunuid"]
    path = Path(str(item.fspath)).resolve().relative_to(REPO)
    exclusive = len(path.parts) > 2 and path.parts[1] in _EXCLUSIVE_DIRS and item.get_closest_marker("untimed") is None
    asked = time.time()
    with open(_LOCK_DIR / f"edgefleet-tests-{run}.turnstile", "a") as turnstile, \
            open(_LOCK_DIR / f"edgefleet-tests-{run}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        started = time.time()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            if _TIMELINE:  # where the suite's time goes: worker, asked for the lock, got it, done, test
                with open(_TIMELINE, "a") as out:
                    out.write(f"{worker['workerid']}\t{asked:.2f}\t{started:.2f}\t{time.time():.2f}\t{item.nodeid}\n")
