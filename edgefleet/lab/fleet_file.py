"""The fleet file: which emulated boards to build, as frozen dataclasses, refused when wrong.

A fleet file is TOML (see ``fleets/mixed4.toml`` for a commented example)::

    [lab]                       # optional
    name = "mixed4"
    reserved_cpus = 0.5         # cores left to the broker, the coordinator and the host
    telemetry_interval_s = 1.0  # the agents' [telemetry] interval_s
    keepalive_s = 10            # the agents' [broker] keepalive_s
    cpu_period_ms = 10          # the CPU quotas' CFS period (1: the shortest the kernel allows each board)

    [server]                    # optional: broker and coordinator in a namespace of their own
    rate_up = "1gbit"
    rate_down = "1gbit"

    [[board]]                   # one per board
    id = "pi4-1"
    model = "Raspberry Pi 4 Model B, 2 GB"
    cpu = 0.20                  # fraction of ONE of this machine's cores
    memory = "2GiB"
    rate_up = "20mbit"          # board -> network
    rate_down = "30mbit"        # network -> board
    idle_w = 2.7                # power model for a board without a sensor
    max_w = 6.4

Why so strict: a typo in a key would otherwise build a board with a default nobody chose, and
quotas that add up to more than the machine's cores make every board slower than its file says
(they compete for the same cores), which silently distorts every figure measured on the lab.
Every refusal names the file, the board and the key.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefleet.lab.cgroups import CFS_PERIOD_US
from edgefleet.lab.units import UnitError, format_rate, format_size, parse_rate, parse_size
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.topics import valid_board_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

MAX_BOARDS = 200            # addresses .11-.210 of the lab's /24
DEFAULT_RESERVED_CPUS = 0.5  # the broker, the coordinator and the host need the rest


class FleetError(ConfigError):
    """The fleet file is wrong; the message names the file, the board and the key."""


@dataclass(frozen=True, slots=True)
class BoardSpec:
    """One emulated board.

    Attributes:
        id: The agent's board_id, also the name of its namespace (``efl-<id>``).
        model: What the board imitates, published in the agent's caps.
        cpu: CPU quota as a fraction of one host core (cpu.cfs_quota_us / cpu.cfs_period_us).
        memory_bytes: memory.limit_in_bytes of its cgroup.
        rate_up_bps: Board-to-network link rate, bits per second.
        rate_down_bps: Network-to-board link rate, bits per second.
        idle_w: Estimated power at 0 % CPU, watts.
        max_w: Estimated power at 100 % CPU, watts.
    """

    id: str
    model: str
    cpu: float
    memory_bytes: int
    rate_up_bps: int
    rate_down_bps: int
    idle_w: float
    max_w: float

    def describe(self) -> str:
        """One line for tables and for the emulated board's model string."""
        return (f"{self.cpu:.2f} CPU, {format_size(self.memory_bytes)}, up {format_rate(self.rate_up_bps)}"
                f" / down {format_rate(self.rate_down_bps)}, {self.idle_w:g}-{self.max_w:g} W est.")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """The broker's and coordinator's own namespace and link."""

    rate_up_bps: int
    rate_down_bps: int


@dataclass(frozen=True, slots=True)
class LabSettings:
    """The ``[lab]`` table."""

    name: str = "lab"
    reserved_cpus: float = DEFAULT_RESERVED_CPUS
    telemetry_interval_s: float = 1.0
    keepalive_s: int = 10
    # the CFS period of the boards' CPU quotas; a board whose quota of it would be under the kernel's 1 ms floor gets a
    # longer one (lab.cgroups). 1 gives each board the shortest the kernel allows: a board computing in bursts (a later
    # pipeline stage) then runs at most 1 ms at the host's speed before its quota stops it, as a real slower CPU would
    cpu_period_ms: float = CFS_PERIOD_US / 1000


@dataclass(frozen=True, slots=True)
class Fleet:
    """A whole fleet file, validated."""

    source: str
    lab: LabSettings
    boards: tuple[BoardSpec, ...]
    server: ServerSpec | None = None

    @property
    def cpu_total(self) -> float:
        return sum(b.cpu for b in self.boards)

    def board(self, board_id: str) -> BoardSpec:
        for spec in self.boards:
            if spec.id == board_id:
                return spec
        raise KeyError(board_id)


_BOARD_KEYS = {"id", "model", "cpu", "memory", "rate_up", "rate_down", "idle_w", "max_w"}
_BOARD_REQUIRED = ("id", "cpu", "memory", "rate_up", "rate_down", "idle_w", "max_w")
_LAB_KEYS = {"name", "reserved_cpus", "telemetry_interval_s", "keepalive_s", "cpu_period_ms"}
_SERVER_KEYS = {"rate_up", "rate_down"}
_TOP_KEYS = {"lab", "server", "board"}


def _unknown(key: str, known: set[str], where: str, source: str) -> FleetError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return FleetError(f"{source}: {where}: unknown key {key!r}.{hint} Known keys: {', '.join(sorted(known))}.")


def _number(value: Any, *, where: str, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FleetError(f"{source}: {where}: {key} = {value!r} should be a number")
    return float(value)


def _check_keys(table: Any, known: set[str], *, where: str, source: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise FleetError(f"{source}: {where} should be a table, got {table!r}")
    for key in table:
        if key not in known:
            raise _unknown(key, known, where, source)
    return table


def _parse_lab(table: Any, source: str) -> LabSettings:
    data = _check_keys(table, _LAB_KEYS, where="[lab]", source=source)
    name = data.get("name", "lab")
    if not isinstance(name, str) or not name:
        raise FleetError(f"{source}: [lab]: name = {name!r} should be a non-empty string")
    reserved = _number(data.get("reserved_cpus", DEFAULT_RESERVED_CPUS), where="[lab]", key="reserved_cpus", source=source)
    interval = _number(data.get("telemetry_interval_s", 1.0), where="[lab]", key="telemetry_interval_s", source=source)
    keepalive = data.get("keepalive_s", 10)
    period = _number(data.get("cpu_period_ms", CFS_PERIOD_US / 1000), where="[lab]", key="cpu_period_ms", source=source)
    if not 1 <= period <= 100:
        raise FleetError(f"{source}: [lab]: cpu_period_ms = {period:g} is outside 1-100 ms (1: the shortest the kernel "
                         "allows each board)")
    if reserved < 0:
        raise FleetError(f"{source}: [lab]: reserved_cpus = {reserved:g} cannot be negative")
    if not 0.05 <= interval <= 3600:
        raise FleetError(f"{source}: [lab]: telemetry_interval_s = {interval:g} is outside 0.05-3600 seconds")
    if isinstance(keepalive, bool) or not isinstance(keepalive, int) or not 2 <= keepalive <= 3600:
        raise FleetError(f"{source}: [lab]: keepalive_s = {keepalive!r} should be a whole number of seconds, 2-3600")
    return LabSettings(name=name, reserved_cpus=reserved, telemetry_interval_s=interval, keepalive_s=keepalive,
                       cpu_period_ms=period)


def _rate(data: dict[str, Any], key: str, *, where: str, source: str) -> int:
    try:
        return parse_rate(data[key])
    except UnitError as exc:
        raise FleetError(f"{source}: {where}: {key} = {exc}") from None


def _parse_server(table: Any, source: str) -> ServerSpec:
    data = _check_keys(table, _SERVER_KEYS, where="[server]", source=source)
    for key in ("rate_up", "rate_down"):
        if key not in data:
            raise FleetError(f"{source}: [server]: missing key {key!r} (the server's link rate, e.g. \"1gbit\")")
    return ServerSpec(rate_up_bps=_rate(data, "rate_up", where="[server]", source=source),
                      rate_down_bps=_rate(data, "rate_down", where="[server]", source=source))


def _parse_board(table: Any, index: int, source: str, host_cores: int) -> BoardSpec:
    raw_id = table.get("id") if isinstance(table, dict) else None
    where = f"board {raw_id!r}" if isinstance(raw_id, str) else f"board #{index + 1}"
    data = _check_keys(table, _BOARD_KEYS, where=where, source=source)
    for key in _BOARD_REQUIRED:
        if key not in data:
            raise FleetError(f"{source}: {where}: missing key {key!r}")
    board_id = data["id"]
    if not isinstance(board_id, str) or not valid_board_id(board_id):
        raise FleetError(f"{source}: {where}: id = {board_id!r} is not a valid board id: use 1-63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    model = data.get("model", "")
    if not isinstance(model, str):
        raise FleetError(f"{source}: {where}: model = {model!r} should be a string")
    cpu = _number(data["cpu"], where=where, key="cpu", source=source)
    if not 0.01 <= cpu <= host_cores:
        raise FleetError(f"{source}: {where}: cpu = {cpu:g} should be between 0.01 and {host_cores} (this machine's cores), as a fraction "
                         "of one core")
    try:
        memory = parse_size(data["memory"])
    except UnitError as exc:
        raise FleetError(f"{source}: {where}: memory = {exc}") from None
    idle_w = _number(data["idle_w"], where=where, key="idle_w", source=source)
    max_w = _number(data["max_w"], where=where, key="max_w", source=source)
    if not 0 <= idle_w <= max_w:
        raise FleetError(f"{source}: {where}: idle_w = {idle_w:g} and max_w = {max_w:g} must satisfy 0 <= idle_w <= max_w")
    return BoardSpec(id=board_id, model=model, cpu=cpu, memory_bytes=memory,
                     rate_up_bps=_rate(data, "rate_up", where=where, source=source),
                     rate_down_bps=_rate(data, "rate_down", where=where, source=source),
                     idle_w=idle_w, max_w=max_w)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - exotic platforms
        return 0


def parse_fleet(text: str, *, source: str = "<fleet>", host_cores: int | None = None,
                host_memory_bytes: int | None = None) -> Fleet:
    """Validate a fleet file's text.

    Args:
        text: The TOML.
        source: The file name, for messages.
        host_cores: This machine's cores (default ``os.cpu_count()``); the boards' quotas may add
            up to ``host_cores - lab.reserved_cpus`` at most.
        host_memory_bytes: This machine's RAM (default: read), for the over-commit warning.

    Raises:
        FleetError: naming the file, the board and the key.
    """
    cores = host_cores or os.cpu_count() or 1
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"{source}: not valid TOML: {exc}") from None
    for key in data:
        if key not in _TOP_KEYS:
            raise _unknown(key, _TOP_KEYS, "the top level (boards are [[board]] tables)", source)
    lab = _parse_lab(data.get("lab", {}), source)
    server = _parse_server(data["server"], source) if "server" in data else None
    raw_boards = data.get("board", [])
    if not isinstance(raw_boards, list) or not raw_boards:
        raise FleetError(f"{source}: no boards: add at least one [[board]] table")
    if len(raw_boards) > MAX_BOARDS:
        raise FleetError(f"{source}: {len(raw_boards)} boards; the lab's address plan has room for {MAX_BOARDS}")
    boards: list[BoardSpec] = []
    seen: dict[str, int] = {}
    budget = cores - lab.reserved_cpus
    total = 0.0
    for index, table in enumerate(raw_boards):
        board = _parse_board(table, index, source, cores)
        if board.id in seen:
            raise FleetError(f"{source}: board {board.id!r}: id = {board.id!r} is used twice (boards #{seen[board.id] + 1} and "
                             f"#{index + 1}); board ids must be unique")
        seen[board.id] = index
        total += board.cpu
        if total > budget + 1e-9:
            raise FleetError(
                f"{source}: board {board.id!r}: cpu = {board.cpu:g} brings the boards' quotas to {total:.2f} CPUs, more than "
                f"the {budget:.2f} this machine can give them ({cores} cores minus lab.reserved_cpus = {lab.reserved_cpus:g} "
                "for the broker and coordinator); lower cpu on some boards, or the emulated boards would compete for cores")
        boards.append(board)
    host_mem = _host_memory_bytes() if host_memory_bytes is None else host_memory_bytes
    mem_total = sum(b.memory_bytes for b in boards)
    for board in boards:
        if host_mem and board.memory_bytes > host_mem:
            raise FleetError(f"{source}: board {board.id!r}: memory = {format_size(board.memory_bytes)} is more than this machine's "
                             f"{format_size(host_mem)}")
    if host_mem and mem_total > host_mem:
        log.warning("%s: the boards' memory limits add up to %s, more than this machine's %s: limits are ceilings, "
                    "not reservations, but boards that all use theirs would push the host into swapping or its own OOM killer",
                    source, format_size(mem_total), format_size(host_mem))
    return Fleet(source=source, lab=lab, boards=tuple(boards), server=server)


FLEETS_DIR = Path(__file__).parent / "fleets"  # shipped in the package: edge-lab up --fleet mixed4


def shipped_fleets() -> list[str]:
    """Names of the fleet files that come with edgefleet (``mixed4``, ``fleet8``)."""
    return sorted(p.stem for p in FLEETS_DIR.glob("*.toml"))


def fleet_path(name_or_path: Path | str) -> Path:
    """A fleet file's path: an existing file as given, else a shipped fleet by its name."""
    path = Path(name_or_path)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    return FLEETS_DIR / f"{path.name}.toml"


def load_fleet(path: Path | str, *, host_cores: int | None = None) -> Fleet:
    """Read and validate a fleet file (a path, or the name of a shipped fleet such as ``mixed4``).

    Raises:
        FleetError: the file is missing or wrong (the message names the board and the key).
    """
    path = fleet_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FleetError(f"fleet file {path} does not exist; give a TOML file or a shipped fleet: "
                         f"{', '.join(shipped_fleets())}") from None
    except OSError as exc:
        raise FleetError(f"fleet file {path} cannot be read: {exc.strerror}") from None
    return parse_fleet(text, source=str(path), host_cores=host_cores)


__all__ = ["BoardSpec", "Fleet", "FleetError", "LabSettings", "ServerSpec", "load_fleet", "parse_fleet"]
