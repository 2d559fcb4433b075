"""JSON messages of the control plane: board status, capabilities and telemetry samples.

They are JSON (not msgpack) so that mosquitto_sub, Telegraf, Node-RED or Home Assistant can read
them with no code. Units are in the field names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from edgefleet.protocol._validate import message_from_json, message_to_json, set_bounds
from edgefleet.protocol.bounds import Bound, bounds_for
from edgefleet.protocol.errors import DecodeError

MESSAGE_SCHEMA_VERSION = 1
STATES = ("online", "offline", "busy")
ACTIVITIES = ("training", "profiling")  # BoardStatus.activity of a busy board

# Where a power reading came from. "hwmon:<chip>" names the chip, e.g. "hwmon:ina219".
POWER_SOURCES = ("jtop", "ina3221", "rpi5-pmic", "hwmon", "rapl", "estimated", "none")
OTHER_POWER_SOURCE = "other"  # what any other power_source string counts as: never a measurement
_HWMON_CHIP = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # a chip's hwmon name ("ina219", "cpu_thermal"), bounded
_NOT_MEASURED = ("estimated", "none", OTHER_POWER_SOURCE)


def power_source_label(power_source: str) -> str:
    """``power_source`` as one of a bounded set of values: a source of :data:`POWER_SOURCES`, ``hwmon:<chip>``
    with a chip name of at most 32 letters, digits and ``_.-``, else :data:`OTHER_POWER_SOURCE` (a board that
    names a new string every sample cannot add metric series or pass for a sensor without limit)."""
    if power_source in POWER_SOURCES:
        return power_source
    kind, colon, chip = power_source.partition(":")
    if kind == "hwmon" and colon and _HWMON_CHIP.fullmatch(chip):
        return power_source
    return OTHER_POWER_SOURCE


def is_measured(power_source: str) -> bool:
    """True for a known sensor's reading (:func:`power_source_label`), False for an estimate, no reading at all
    or a source this version does not know."""
    return power_source_label(power_source) not in _NOT_MEASURED


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardStatus:
    """Retained on ``…/status``. The broker publishes the offline form as the last will."""

    state: str                      # "online", "offline" or "busy"
    ts: float | None = None         # unix seconds when the board said it; None in the last will
    reason: str = ""                # why offline: "stopped", "connection lost", …
    agent_version: str = ""
    interval_s: float | None = None  # telemetry period, so viewers know when a sample is stale
    keepalive_s: float | None = None  # MQTT keepalive: an unplugged board is offline after 1.5x this
    activity: str = ""              # while busy: "training" or "profiling" (ACTIVITIES); "" otherwise or from an older agent
    schema_version: int = MESSAGE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state {self.state!r} is not one of {STATES}")

    def to_json(self) -> bytes:
        return message_to_json(self)

    @classmethod
    def from_json(cls, payload: bytes | str) -> BoardStatus:
        return message_from_json(cls, payload, schema_version=MESSAGE_SCHEMA_VERSION)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardCaps:
    """Retained on ``…/caps``: what the board is and what it can do."""

    board_id: str
    hostname: str
    model: str                      # "Raspberry Pi 5 Model B Rev 1.0", "NVIDIA Jetson Orin Nano", DMI name…
    machine: str                    # platform.machine(): "aarch64", "x86_64"
    cores: int
    ram_bytes: int
    accelerator: str = ""           # "jetson-igpu", "" for none
    power_source: str = "none"      # see POWER_SOURCES
    agent_version: str = ""
    python_version: str = ""
    training_available: bool = False  # torch and Lightning importable on the board
    cpu_cores: float = 0.0          # CPU the agent may use: its cgroup's quota, else its CPUs (0: not reported)
    train_threads: int = 0          # torch threads a job uses unless told otherwise (0: not reported)
    # Where other boards reach this one (a pipeline's stage links): the agent's [training] address, else the local
    # address of its broker connection; "" from an agent before it (added within version 1: an older side ignores it).
    address: str = ""
    schema_version: int = MESSAGE_SCHEMA_VERSION

    def to_json(self) -> bytes:
        return message_to_json(self)

    @classmethod
    def from_json(cls, payload: bytes | str) -> BoardCaps:
        return message_from_json(cls, payload, schema_version=MESSAGE_SCHEMA_VERSION)


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetrySample:
    """One reading of a board, published on ``…/telemetry`` every ``interval_s``."""

    board_id: str
    ts: float                       # unix seconds when the sample was taken
    seq: int                        # increases by one per sample since the agent started
    interval_s: float
    cpu_percent: float | None = None          # all cores, 0-100
    cpu_percent_per_core: list[float] = field(default_factory=list)
    cpu_freq_mhz: float | None = None
    load_avg_1m: float | None = None
    load_avg_5m: float | None = None
    load_avg_15m: float | None = None
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None         # total - available
    mem_available_bytes: int | None = None
    mem_percent: float | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    net_rx_bytes_per_s: float | None = None   # summed over interfaces, loopback excluded
    net_tx_bytes_per_s: float | None = None
    temp_c: float | None = None               # hottest sensor
    temps_c: dict[str, float] = field(default_factory=dict)
    power_w: float | None = None
    power_source: str = "none"                # see POWER_SOURCES; "estimated" is never a measurement
    power_rails_w: dict[str, float] = field(default_factory=dict)
    # Added later, all optional (an older side ignores them or leaves them None), and left out of the
    # JSON when None so that a board without the sensor sends no noise (see OMITTED_WHEN_NONE).
    gpu_load_percent: float | None = None     # a Jetson's iGPU, 0-100 (jtop, else sysfs)
    gpu_mem_used_bytes: int | None = None     # a Jetson's iGPU memory, from jtop only (shared with the CPU)
    gpu_mem_total_bytes: int | None = None    # the RAM the iGPU shares: the board's RAM
    throttled_bits: int | None = None         # a Pi's raw `vcgencmd get_throttled` (bits 0-3 now, 16-19 since boot)
    under_voltage_now: bool | None = None     # a Pi's firmware flags, decoded from throttled_bits
    freq_capped_now: bool | None = None
    throttled_now: bool | None = None
    soft_temp_limit_now: bool | None = None
    under_voltage_since_boot: bool | None = None
    freq_capped_since_boot: bool | None = None
    throttled_since_boot: bool | None = None
    soft_temp_limit_since_boot: bool | None = None
    disk_data_used_bytes: int | None = None   # the file system of the agent's state_dir
    disk_data_total_bytes: int | None = None
    disk_run_used_bytes: int | None = None    # the file system of the agent's working directory (where jobs run)
    disk_run_total_bytes: int | None = None
    energy_wh: float | None = None            # energy drawn: power_w integrated since the record in the agent's state_dir
                                              # began (else since the agent started); never decreases while it runs
    job_steps_done: int | None = None         # global steps the running training job has done (its last progress)
    job_total_steps: int | None = None        # global steps that job takes in all
    schema_version: int = MESSAGE_SCHEMA_VERSION

    def to_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        for name in OMITTED_WHEN_NONE:
            if fields[name] is None:
                del fields[name]
        return json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, payload: bytes | str) -> TelemetrySample:
        sample = message_from_json(cls, payload, schema_version=MESSAGE_SCHEMA_VERSION)
        for part, total in (("mem_used_bytes", "mem_total_bytes"), ("mem_available_bytes", "mem_total_bytes"),
                            ("swap_used_bytes", "swap_total_bytes"), ("gpu_mem_used_bytes", "gpu_mem_total_bytes"),
                            ("disk_data_used_bytes", "disk_data_total_bytes"), ("disk_run_used_bytes", "disk_run_total_bytes")):
            a, b = getattr(sample, part), getattr(sample, total)
            if a is not None and b is not None and a > b:
                raise DecodeError(f"TelemetrySample: field {part!r} = {a} is more than {total} = {b}")
        return sample


# The fields added after the first release: absent from the JSON when None (no such sensor on the board).
OMITTED_WHEN_NONE = (
    "gpu_load_percent", "gpu_mem_used_bytes", "gpu_mem_total_bytes",
    "throttled_bits", "under_voltage_now", "freq_capped_now", "throttled_now", "soft_temp_limit_now",
    "under_voltage_since_boot", "freq_capped_since_boot", "throttled_since_boot", "soft_temp_limit_since_boot",
    "disk_data_used_bytes", "disk_data_total_bytes", "disk_run_used_bytes", "disk_run_total_bytes",
    "energy_wh", "job_steps_done", "job_total_steps",
)

# What a board can physically report (see bounds.py); every decoded message is checked against these.
# Generous on purpose: the agent itself keeps temperatures within -40..150 °C, CPU within 0-100 %.
MAX_MEMORY_BYTES = 1 << 50        # 1 PiB of RAM or swap
MAX_CORES = 4096
MAX_POWER_W = 5000.0              # a whole board, however large; a rail may read slightly negative
MAX_DISK_BYTES = 1 << 60          # 1 EiB: a file system a board's folder can sit on
MAX_ENERGY_WH = 1e12              # a board at MAX_POWER_W for 20,000 years
_EPOCH_S = Bound(0, 1e10, "s since 1970")   # until the year 2286
_PERIOD_S = Bound(0.01, 86_400, "s")
_BYTES = Bound(0, MAX_MEMORY_BYTES, "bytes")
_DISK = Bound(0, MAX_DISK_BYTES, "bytes")
_PERCENT = Bound(0, 100, "%")
_CELSIUS = Bound(-100, 250, "°C")
_SCHEMA = Bound(0, 1 << 31)
_SHORT_TEXT = Bound(max_chars=64)
_BOARD_ID = Bound(max_chars=63)
MAX_ADDRESS_CHARS = 253           # a DNS name at its longest; an IPv6 address with a zone is shorter

set_bounds(BoardStatus, bounds_for(BoardStatus, {
    "ts": _EPOCH_S, "interval_s": _PERIOD_S, "keepalive_s": Bound(0, 86_400, "s"), "agent_version": _SHORT_TEXT,
    "activity": _SHORT_TEXT, "schema_version": _SCHEMA}))
set_bounds(BoardCaps, bounds_for(BoardCaps, {
    "board_id": _BOARD_ID, "machine": _SHORT_TEXT, "accelerator": _SHORT_TEXT, "power_source": _SHORT_TEXT,
    "agent_version": _SHORT_TEXT, "python_version": _SHORT_TEXT,
    "cores": Bound(1, MAX_CORES, "cores"), "ram_bytes": _BYTES, "cpu_cores": Bound(0, MAX_CORES, "cores"),
    "train_threads": Bound(0, MAX_CORES, "threads"), "address": Bound(max_chars=MAX_ADDRESS_CHARS), "schema_version": _SCHEMA}))
set_bounds(TelemetrySample, bounds_for(TelemetrySample, {
    "board_id": _BOARD_ID, "ts": _EPOCH_S, "seq": Bound(0, (1 << 63) - 1), "interval_s": _PERIOD_S,
    "cpu_percent": _PERCENT, "cpu_percent_per_core": Bound(0, 100, "%", max_items=MAX_CORES),
    "cpu_freq_mhz": Bound(0, 100_000, "MHz"),
    "load_avg_1m": Bound(0, 1e6), "load_avg_5m": Bound(0, 1e6), "load_avg_15m": Bound(0, 1e6),
    "mem_total_bytes": _BYTES, "mem_used_bytes": _BYTES, "mem_available_bytes": _BYTES, "mem_percent": _PERCENT,
    "swap_total_bytes": _BYTES, "swap_used_bytes": _BYTES,
    "net_rx_bytes_per_s": Bound(0, 1e12, "bytes/s"), "net_tx_bytes_per_s": Bound(0, 1e12, "bytes/s"),
    "temp_c": _CELSIUS, "temps_c": Bound(_CELSIUS.lo, _CELSIUS.hi, "°C", max_items=256, max_chars=128),
    "power_w": Bound(0, MAX_POWER_W, "W"), "power_source": _SHORT_TEXT,
    "power_rails_w": Bound(-50, MAX_POWER_W, "W", max_items=64, max_chars=128),
    "gpu_load_percent": _PERCENT, "gpu_mem_used_bytes": _BYTES, "gpu_mem_total_bytes": _BYTES,
    "throttled_bits": Bound(0, 0xFFFF_FFFF, "(a 32-bit field)"),
    "disk_data_used_bytes": _DISK, "disk_data_total_bytes": _DISK, "disk_run_used_bytes": _DISK, "disk_run_total_bytes": _DISK,
    "energy_wh": Bound(0, MAX_ENERGY_WH, "Wh"), "job_steps_done": Bound(0, (1 << 63) - 1), "job_total_steps": Bound(0, (1 << 63) - 1),
    "schema_version": _SCHEMA}))


__all__ = [
    "ACTIVITIES",
    "MAX_ADDRESS_CHARS",
    "MAX_CORES",
    "MAX_DISK_BYTES",
    "MAX_ENERGY_WH",
    "MAX_MEMORY_BYTES",
    "MAX_POWER_W",
    "MESSAGE_SCHEMA_VERSION",
    "OMITTED_WHEN_NONE",
    "OTHER_POWER_SOURCE",
    "POWER_SOURCES",
    "STATES",
    "BoardCaps",
    "BoardStatus",
    "TelemetrySample",
    "is_measured",
    "power_source_label",
]
