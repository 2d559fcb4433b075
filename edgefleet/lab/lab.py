"""The emulated fleet: boards as namespaces + cgroups running real agents against a real Mosquitto.

    with Lab(load_fleet("lab/fleets/mixed4.toml")) as lab:
        print(lab.broker_address)          # e.g. 198.18.0.1:40123
        lab.wait_online(timeout_s=60)
        rows = lab.status_json()           # edge-coordinator status --json, from the coordinator's side

Why a context manager that also cleans up on its own: the lab changes the machine (namespaces,
links, cgroups, processes). ``__exit__`` tears everything down, ``atexit`` covers an exit that
skips it, and ``up()`` first removes what a crashed lab left (found by the ``efl-`` prefix). The
CLI (``edge-lab``) and the pytest fixtures are thin layers over this class.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import edgefleet.lab.leftovers as leftovers  # the modules, not the package: its __init__ imports this one
import edgefleet.lab.links as links
from edgefleet.agent.config import AgentConfig, SecuritySettings, TelemetrySettings
from edgefleet.brokers.local_broker import LocalBroker, start_mosquitto
from edgefleet.lab.cgroups import LAB_PARENT_SHARES, Cgroup, find_controller_mounts
from edgefleet.lab.fleet_file import BoardSpec, Fleet
from edgefleet.lab.host_check import lab_unavailable_reason
from edgefleet.lab.naming import (
    BROKER_MEMBER,
    CGROUP_PARENT,
    HOST_ADDRESS,
    SERVER,
    SERVER_ADDRESS,
    board_address,
    cgroup_name,
    host_ifname,
    netns_name,
    peer_ifname,
    workdir,
)
from edgefleet.lab.supervisor import BoardProcess, Report, Supervisor
from edgefleet.lab.units import format_rate
from edgefleet.launch import module_command
from edgefleet.transport.fleet_key import BOARD_KEY_SUFFIX, PRIVATE, private_key_text, public_key_text, read_key_file, write_new_key

log = logging.getLogger(__name__)

AGENT = "edge-agent"
BOARD_KEY_FILE = "board.key"  # in the board's home: its own key, which signs its job events


class LabUnavailable(RuntimeError):
    """This machine can't run the lab (not root, no CAP_NET_ADMIN, no cgroup v1, ...)."""


class LabBusy(RuntimeError):
    """Another lab is up on this machine (there is one bridge and one address plan per machine)."""


@dataclass
class Board:
    """A board as built: its spec, where it lives, and its cgroup."""

    spec: BoardSpec
    index: int
    netns: str
    address: ipaddress.IPv4Address
    host_if: str
    cgroup: Cgroup
    home: Path

    @property
    def id(self) -> str:
        return self.spec.id


def agent_supports_cpu_scope() -> bool:
    """True once the agent has ``telemetry.cpu_scope`` (then the lab asks for the board's own CPU)."""
    return "cpu_scope" in {f.name for f in dataclasses.fields(TelemetrySettings)}


def agent_supports_fleet_key() -> bool:
    """True once the agent has a ``[security]`` section (signed training commands)."""
    return "security" in {f.name for f in dataclasses.fields(AgentConfig)}


def agent_supports_board_key() -> bool:
    """True once the agent has ``security.board_key_file`` (then every board signs its job events)."""
    return "board_key_file" in {f.name for f in dataclasses.fields(SecuritySettings)}


def emulated_model(spec: BoardSpec) -> str:
    """The model string a board's agent publishes in its caps: what it imitates, and its limits."""
    return f"lab: {spec.model or spec.id}-like, {spec.describe()}"


def write_board_sysfs(sysfs_root: Path, spec: BoardSpec) -> Path:
    """The board's own /sys for its agent (``telemetry.sysfs_root``); returns the model file.

    Its device-tree model says what the board imitates, so ``status --json`` shows each board's
    speed, memory and link in ``caps.model``. No thermal zones or power sensors are faked: those
    readings are absent, never invented.
    """
    model = sysfs_root / "firmware" / "devicetree" / "base" / "model"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(emulated_model(spec).encode() + b"\0")  # device-tree strings end in NUL
    return model


class Lab:
    """A fleet of emulated boards.

    Args:
        fleet: The validated fleet file.
        interval_s: The agents' telemetry interval (default: the fleet's ``lab.telemetry_interval_s``).
        keepalive_s: The agents' MQTT keepalive (default: the fleet's ``lab.keepalive_s``).
        start_agents: Start an ``edge-agent`` in every board (False: boards only, for link tests).
        logs_dir: Where board logs go; default inside the lab's work dir (removed by ``down``).
        on_report: Called with every supervisor report (a board process that ended unasked).
        fleet_key_file: The coordinator's key file (``--fleet-key``). The agents get what a real
            board holds (their ``[security] fleet_key_file``): the public key of an Ed25519 private
            key (written to the work dir as ``fleet.pub``), or the file itself when it holds public
            keys or a legacy HMAC key. Without one they refuse every command, as real boards do.
            Every board also gets a key of its own that signs its job events; their public keys are
            in :attr:`board_keys_dir` (the coordinator's ``--board-keys``).
        agent_settings: Extra TOML sections for every agent's config, e.g.
            ``"[training]\nkeep_worker = true\n"`` (benchmarks that run hundreds of short jobs).
    """

    def __init__(self, fleet: Fleet, *, interval_s: float | None = None, keepalive_s: int | None = None,
                 start_agents: bool = True, logs_dir: Path | None = None,
                 on_report: Callable[[Report], None] | None = None, fleet_key_file: Path | None = None,
                 agent_settings: str = "") -> None:
        if fleet_key_file is not None and not agent_supports_fleet_key():
            raise ValueError("this edge-agent has no [security] section: it can't take a fleet key")
        self.fleet = fleet
        self.fleet_key_file = Path(fleet_key_file).resolve() if fleet_key_file is not None else None
        self.interval_s = interval_s or fleet.lab.telemetry_interval_s
        self.keepalive_s = keepalive_s or fleet.lab.keepalive_s
        self.start_agents = start_agents
        self.agent_settings = agent_settings
        self.workdir = workdir()
        self.logs_dir = logs_dir or self.workdir / "logs"
        self.board_keys_dir = self.workdir / "board-keys"  # <board_id>.pub: the coordinator's --board-keys
        self.supervisor = Supervisor(on_report=on_report)
        self.boards: dict[str, Board] = {}
        self.server_netns: str | None = None
        self.server_cgroup: Cgroup | None = None
        self.broker: LocalBroker | None = None
        self._mounts = find_controller_mounts()
        self._lock = threading.Lock()
        self._is_up = False
        self._state: dict[str, Any] = {}

    # Life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Lab:
        """Build every board, start the broker and the agents.

        Raises:
            LabUnavailable: this machine can't run the lab (the message says why).
            LabBusy: another live process owns a lab on this machine.
        """
        reason = lab_unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        other = leftovers.running_lab()
        if other is not None:
            raise LabBusy(f"a lab is already up on this machine (pid {other['pid']}, fleet {other.get('fleet')}); "
                          "stop it with: edge-lab down")
        stale = leftovers.leftovers()
        if stale:
            log.warning("removing what an earlier lab left behind: %s", ", ".join(stale))
            leftovers.sweep()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._state = {"pid": os.getpid(), "pid_start_ticks": leftovers.process_start_ticks(os.getpid()),
                       "fleet": self.fleet.source, "name": self.fleet.lab.name, "phase": "starting",
                       "started": time.time()}
        leftovers.write_state(self._state)
        self._is_up = True
        atexit.register(self.down)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        started = time.monotonic()
        parent = Cgroup(CGROUP_PARENT, self._mounts)
        parent.create()
        parent.set_cpu_shares(LAB_PARENT_SHARES)
        links.create_bridge()
        if self.fleet.server is not None:
            self.server_netns = netns_name(SERVER)
            links.create_member(self.server_netns, host_if=host_ifname(0), peer_if=peer_ifname(0), address=SERVER_ADDRESS,
                                rate_up_bps=self.fleet.server.rate_up_bps, rate_down_bps=self.fleet.server.rate_down_bps)
        for index, spec in enumerate(self.fleet.boards, start=1):
            self.boards[spec.id] = self._build_board(spec, index)
        self._start_broker()
        self._state.update(phase="up", broker=self.broker_address, server_netns=self.server_netns,
                           broker_pid=self.broker.proc.pid if self.broker else None,
                           broker_workdir=str(self.broker.workdir) if self.broker else None,
                           boards=[{"id": b.id, "netns": b.netns, "address": str(b.address), "host_if": b.host_if,
                                    "cgroup": b.cgroup.relpath, "cpu": b.spec.cpu, "memory_bytes": b.spec.memory_bytes,
                                    "rate_up_bps": b.spec.rate_up_bps, "rate_down_bps": b.spec.rate_down_bps,
                                    "idle_w": b.spec.idle_w, "max_w": b.spec.max_w, "model": b.spec.model}
                                   for b in self.boards.values()])
        leftovers.write_state(self._state)
        if self.start_agents:
            for board in self.boards.values():
                self.start_agent(board.id)
        log.info("lab %s up in %.1f s: %d boards, broker %s", self.fleet.lab.name, time.monotonic() - started,
                 len(self.boards), self.broker_address)

    def _build_board(self, spec: BoardSpec, index: int) -> Board:
        board = Board(spec=spec, index=index, netns=netns_name(spec.id), address=board_address(index),
                      host_if=host_ifname(index), cgroup=Cgroup(cgroup_name(spec.id), self._mounts),
                      home=self.workdir / "boards" / spec.id)
        links.create_member(board.netns, host_if=board.host_if, peer_if=peer_ifname(index), address=board.address,
                            rate_up_bps=spec.rate_up_bps, rate_down_bps=spec.rate_down_bps)
        board.cgroup.create()
        board.cgroup.set_cpu_quota(spec.cpu, period_us=round(self.fleet.lab.cpu_period_ms * 1000))
        board.cgroup.set_memory_limit(spec.memory_bytes)
        write_board_sysfs(board.home / "sys", spec)
        return board

    def _start_broker(self) -> None:
        if self.server_netns is not None:
            # Started from a thread inside the server namespace, so Mosquitto lives there.
            self.broker = links.call_in_netns(self.server_netns, lambda: start_mosquitto(host=str(SERVER_ADDRESS)))
            member = SERVER
        else:
            self.broker = start_mosquitto(host=str(HOST_ADDRESS))
            member = BROKER_MEMBER
        # No limits: the group only marks the broker as the lab's, so `down` finds it after a crash.
        group = Cgroup(cgroup_name(member), self._mounts)
        group.create()
        group.add(self.broker.proc.pid)
        self.server_cgroup = group

    def down(self) -> None:
        """Stop everything and remove every object this lab made. Safe to call twice."""
        with self._lock:
            if not self._is_up:
                return
            self._is_up = False
        atexit.unregister(self.down)
        # A second Ctrl-C or SIGTERM must not cut the teardown short: hold them until it is done.
        in_main = threading.current_thread() is threading.main_thread()
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held) if in_main else None
        try:
            self._teardown()
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _teardown(self) -> None:
        self.supervisor.stop_all()
        if self.broker is not None:
            self.broker.stop()
        for board in self.boards.values():
            try:
                board.cgroup.remove()
            except OSError as exc:
                log.warning("board %s: cannot remove its cgroup: %s", board.id, exc)
        if self.server_cgroup is not None:
            try:
                self.server_cgroup.remove()
            except OSError as exc:
                log.warning("cannot remove the broker's cgroup: %s", exc)
        # Whatever is left (namespaces, links, the bridge, the parent cgroup, the work dir) goes by prefix.
        state = leftovers.read_state()
        if state is None or state.get("pid") == os.getpid():
            leftovers.sweep()
        log.info("lab %s down", self.fleet.lab.name)

    # Using the lab --------------------------------------------------------------------------

    @property
    def broker_address(self) -> str:
        """``HOST:PORT`` of the broker, reachable from the host and from every board."""
        assert self.broker is not None, "the lab is not up"
        return self.broker.address

    @property
    def coordinator_netns(self) -> str | None:
        """The namespace the coordinator runs in (None: on the host)."""
        return self.server_netns

    def board(self, board_id: str) -> Board:
        return self.boards[board_id]

    def agent_config(self, board: Board) -> str:
        """The agent's config file: the board's power model, labelled estimated, and its own /sys."""
        spec = board.spec
        cpu_scope = 'cpu_scope = "cgroup"\n' if agent_supports_cpu_scope() else ""
        board_key = board.home / BOARD_KEY_FILE
        security = "".join([f'fleet_key_file = "{self.agent_fleet_key_file()}"\n' if self.fleet_key_file else "",
                            f'board_key_file = "{board_key}"\n' if board_key.exists() else ""])
        security = f"[security]\n{security}" if security else ""
        return (f'board_id = "{spec.id}"\n'
                f"[broker]\nkeepalive_s = {self.keepalive_s}\n"
                f'[telemetry]\ninterval_s = {self.interval_s}\nsysfs_root = "{board.home / "sys"}"\n{cpu_scope}'
                f'[power]\nsource = "estimated"\nidle_w = {spec.idle_w}\nmax_w = {spec.max_w}\n{security}'
                f"{self.agent_settings}")

    def agent_fleet_key_file(self) -> Path | None:
        """What the boards verify commands with: the public key of an Ed25519 private key (written
        once to the work dir), else the coordinator's key file itself (public keys, or a legacy key)."""
        if self.fleet_key_file is None:
            return None
        if read_key_file(self.fleet_key_file).kind != PRIVATE:
            return self.fleet_key_file
        public = self.workdir / "fleet.pub"
        if not public.exists():
            public.parent.mkdir(parents=True, exist_ok=True)
            public.write_text(public_key_text(self.fleet_key_file))
        return public

    def ensure_board_key(self, board: Board) -> None:
        """The board's own key (in its home, mode 600), made once, and its public key in :attr:`board_keys_dir`."""
        if not agent_supports_board_key():
            return
        key = board.home / BOARD_KEY_FILE
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            write_new_key(key, private_key_text())
        self.board_keys_dir.mkdir(parents=True, exist_ok=True)
        (self.board_keys_dir / f"{board.id}{BOARD_KEY_SUFFIX}").write_text(public_key_text(key))

    def start_agent(self, board_id: str) -> BoardProcess:
        """Start (or restart) the board's ``edge-agent`` under the supervisor."""
        board = self.boards[board_id]
        self.ensure_board_key(board)
        config = board.home / "agent.toml"
        config.write_text(self.agent_config(board))
        return self.start_in_board(board_id, AGENT, module_command("edgefleet.agent", "--config", str(config),
                                                                  "--broker", self.broker_address))

    def agent(self, board_id: str) -> BoardProcess:
        """The board's most recent agent process."""
        procs = self.supervisor.processes(board_id=board_id, name=AGENT)
        if not procs:
            raise KeyError(f"board {board_id} has no agent")
        return procs[-1]

    def start_in_board(self, board_id: str, name: str, argv: list[str], *, capture_stdout: bool = False,
                       expect_exit: bool = False) -> BoardProcess:
        """Start any command inside a board (its namespace and cgroups), supervised like the agent.

        ``expect_exit``: a job that ends by itself (exit 0 is not reported as a problem).
        """
        board = self.boards[board_id]
        board.home.mkdir(parents=True, exist_ok=True)
        return self.supervisor.start(board_id=board_id, name=name, argv=argv, netns=board.netns, cgroup=board.cgroup,
                                     cwd=board.home, log_path=self.logs_dir / f"{board_id}.{name}.log",
                                     capture_stdout=capture_stdout, expect_exit=expect_exit)

    def start_in_server(self, name: str, argv: list[str], *, capture_stdout: bool = False,
                        expect_exit: bool = False) -> BoardProcess:
        """Start a command in the server namespace (fleets with a ``[server]``), supervised."""
        if self.server_netns is None or self.server_cgroup is None or self.fleet.server is None:
            raise KeyError("this fleet has no [server] namespace")
        return self.supervisor.start(board_id=SERVER, name=name, argv=argv, netns=self.server_netns, cgroup=self.server_cgroup,
                                     cwd=self.workdir, log_path=self.logs_dir / f"{SERVER}.{name}.log",
                                     capture_stdout=capture_stdout, expect_exit=expect_exit)

    def coordinator(self, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``edge-coordinator --broker <lab broker> ARGS`` where the coordinator lives."""
        cmd = module_command("edgefleet.coordinator.cli", "--broker", self.broker_address, *args)
        if self.server_netns is not None:
            cmd = ["nsenter", f"--net=/run/netns/{self.server_netns}", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)

    def status_json(self) -> dict[str, dict[str, Any]]:
        """``edge-coordinator status --json`` as ``{board_id: row}``; ``{}`` if the CLI failed."""
        done = self.coordinator("status", "--json", "--wait", "2")
        if done.returncode != 0:
            log.warning("edge-coordinator status failed (%d): %s", done.returncode, done.stderr.strip()[-500:])
            return {}
        return {row["board_id"]: row for row in json.loads(done.stdout)}

    def wait_online(self, *, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """Wait until every board is online with samples (health ok); returns the status rows.

        Raises:
            TimeoutError: naming the boards that did not come up, with their supervisor reports.
        """
        deadline = time.monotonic() + timeout_s
        rows: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            rows = self.status_json()
            if all(rows.get(b, {}).get("health") == "ok" for b in self.boards):
                return rows
            time.sleep(0.2)  # between polls of a CLI that itself waits up to 2 s
        missing = [b for b in self.boards if rows.get(b, {}).get("health") != "ok"]
        reports = "; ".join(r.message for r in self.supervisor.reports())
        raise TimeoutError(f"boards not online after {timeout_s:.0f} s: {', '.join(missing)}"
                           + (f"; supervisor: {reports}" if reports else ""))

    def set_link_up(self, board_id: str, up: bool) -> None:
        """Unplug (False) or replug (True) a board's cable, for fault tests."""
        links.set_link_up(self.boards[board_id].netns, up)

    def set_link_rate(self, board_id: str, *, rate_up_bps: int | None = None, rate_down_bps: int | None = None) -> None:
        """Change a board's link rate while it runs (a Wi-Fi board walking away from the access point)."""
        board = self.boards[board_id]
        if rate_down_bps:
            links.shape(board.host_if, rate_down_bps)
        if rate_up_bps:
            links.shape("eth0", rate_up_bps, netns=board.netns)
        log.info("board %s: link now up %s / down %s", board_id, format_rate(rate_up_bps or board.spec.rate_up_bps),
                 format_rate(rate_down_bps or board.spec.rate_down_bps))


__all__ = ["AGENT", "BOARD_KEY_FILE", "Board", "Lab", "LabBusy", "LabUnavailable", "agent_supports_board_key",
           "agent_supports_cpu_scope", "agent_supports_fleet_key", "emulated_model"]
