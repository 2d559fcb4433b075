"""The wire messages again, as msgspec Structs with the same constraints: ``validation_libraries.py``'s contender.

Only the benchmark imports this (msgspec is the ``bench`` extra, not a dependency). Each Struct has
the fields, defaults and bounds of its dataclass in ``protocol/messages.py`` or ``protocol/jobs.py``:
ranges as ``Meta(ge=, le=)``, list and map sizes as ``Meta(max_length=)``, text as ``max_length``
and a pattern that refuses control characters, fixed sets of words as ``Literal``. What a
constraint cannot say is checked in ``__post_init__`` by the very code the dataclasses use (a used
part above its total, ``TrainCommand``'s cross-field rules, ``JobEvent.data``'s depth).

Two differences remain, both in the direction of msgspec accepting a little more:

* the text pattern refuses C0/C1 control characters; ``str.isprintable`` also refuses other
  unprintable code points (separators, private use, unassigned);
* msgpack has no per-container length limits (``msgpack.unpackb(max_array_len=, max_map_len=)``);
  the payload's size limit, checked before decoding, still bounds the work.

:func:`decoder` wraps each in what the production decoders also do first (the size limit) and turns
msgspec's errors into ``DecodeError`` as the production code raises it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from edgefleet.protocol import jobs, messages
from edgefleet.protocol._validate import MAX_JSON_BYTES
from edgefleet.protocol.errors import DecodeError

T = TypeVar("T")

PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f]*$"  # no control characters (str.isprintable refuses a few more)
Text = Annotated[str, Meta(max_length=256, pattern=PRINTABLE)]
ShortText = Annotated[str, Meta(max_length=64, pattern=PRINTABLE)]
BoardId = Annotated[str, Meta(max_length=63, pattern=PRINTABLE)]
Key = Annotated[str, Meta(max_length=128, pattern=PRINTABLE)]
Epoch = Annotated[float, Meta(ge=0, le=1e10)]
Period = Annotated[float, Meta(ge=0.01, le=86_400)]
Bytes = Annotated[int, Meta(ge=0, le=messages.MAX_MEMORY_BYTES)]
Disk = Annotated[int, Meta(ge=0, le=messages.MAX_DISK_BYTES)]
Percent = Annotated[float, Meta(ge=0, le=100)]
Celsius = Annotated[float, Meta(ge=-100, le=250)]
Load = Annotated[float, Meta(ge=0, le=1e6)]
Rate = Annotated[float, Meta(ge=0, le=1e12)]
Count63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Scalar = str | int | float | bool | None  # an option value: never a nested structure
# schema_version: newer than this side understands is refused (the dataclasses' rule)
MessageSchema = Annotated[int, Meta(ge=0, le=messages.MESSAGE_SCHEMA_VERSION)]
JobSchema = Annotated[int, Meta(ge=0, le=jobs.JOB_SCHEMA_VERSION)]
TrainSchema = Annotated[int, Meta(ge=0, le=jobs.TRAIN_SCHEMA_VERSION)]


class BoardStatus(msgspec.Struct, kw_only=True, frozen=True):
    state: Literal["online", "offline", "busy"]
    ts: Epoch | None = None
    reason: Text = ""
    agent_version: ShortText = ""
    interval_s: Period | None = None
    keepalive_s: Annotated[float, Meta(ge=0, le=86_400)] | None = None
    activity: ShortText = ""
    schema_version: MessageSchema = messages.MESSAGE_SCHEMA_VERSION


Cores = Annotated[int, Meta(ge=1, le=messages.MAX_CORES)]


class BoardCaps(msgspec.Struct, kw_only=True, frozen=True):
    board_id: BoardId
    hostname: Text
    model: Text
    machine: ShortText
    cores: Cores
    ram_bytes: Bytes
    accelerator: ShortText = ""
    power_source: ShortText = "none"
    agent_version: ShortText = ""
    python_version: ShortText = ""
    training_available: bool = False
    cpu_cores: Annotated[float, Meta(ge=0, le=messages.MAX_CORES)] = 0.0
    train_threads: Annotated[int, Meta(ge=0, le=messages.MAX_CORES)] = 0
    address: Annotated[str, Meta(max_length=messages.MAX_ADDRESS_CHARS)] = ""
    schema_version: MessageSchema = messages.MESSAGE_SCHEMA_VERSION


USED_WITHIN_TOTAL = (("mem_used_bytes", "mem_total_bytes"), ("mem_available_bytes", "mem_total_bytes"),
                     ("swap_used_bytes", "swap_total_bytes"), ("gpu_mem_used_bytes", "gpu_mem_total_bytes"),
                     ("disk_data_used_bytes", "disk_data_total_bytes"), ("disk_run_used_bytes", "disk_run_total_bytes"))


def check_used_within_total(sample: Any) -> None:
    """``TelemetrySample.from_json``'s cross-field rule: no used part above its total.

    Raises:
        ValueError: naming both fields and values.
    """
    for part, total in USED_WITHIN_TOTAL:
        a, b = getattr(sample, part), getattr(sample, total)
        if a is not None and b is not None and a > b:
            raise ValueError(f"field {part!r} = {a} is more than {total} = {b}")


class TelemetrySample(msgspec.Struct, kw_only=True, frozen=True):
    board_id: BoardId
    ts: Epoch
    seq: Count63
    interval_s: Period
    cpu_percent: Percent | None = None
    cpu_percent_per_core: Annotated[list[Percent], Meta(max_length=messages.MAX_CORES)] = []
    cpu_freq_mhz: Annotated[float, Meta(ge=0, le=100_000)] | None = None
    load_avg_1m: Load | None = None
    load_avg_5m: Load | None = None
    load_avg_15m: Load | None = None
    mem_total_bytes: Bytes | None = None
    mem_used_bytes: Bytes | None = None
    mem_available_bytes: Bytes | None = None
    mem_percent: Percent | None = None
    swap_total_bytes: Bytes | None = None
    swap_used_bytes: Bytes | None = None
    net_rx_bytes_per_s: Rate | None = None
    net_tx_bytes_per_s: Rate | None = None
    temp_c: Celsius | None = None
    temps_c: Annotated[dict[Key, Celsius], Meta(max_length=256)] = {}
    power_w: Annotated[float, Meta(ge=0, le=messages.MAX_POWER_W)] | None = None
    power_source: ShortText = "none"
    power_rails_w: Annotated[dict[Key, Annotated[float, Meta(ge=-50, le=messages.MAX_POWER_W)]], Meta(max_length=64)] = {}
    gpu_load_percent: Percent | None = None
    gpu_mem_used_bytes: Bytes | None = None
    gpu_mem_total_bytes: Bytes | None = None
    throttled_bits: Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)] | None = None
    under_voltage_now: bool | None = None
    freq_capped_now: bool | None = None
    throttled_now: bool | None = None
    soft_temp_limit_now: bool | None = None
    under_voltage_since_boot: bool | None = None
    freq_capped_since_boot: bool | None = None
    throttled_since_boot: bool | None = None
    soft_temp_limit_since_boot: bool | None = None
    disk_data_used_bytes: Disk | None = None
    disk_data_total_bytes: Disk | None = None
    disk_run_used_bytes: Disk | None = None
    disk_run_total_bytes: Disk | None = None
    energy_wh: Annotated[float, Meta(ge=0, le=messages.MAX_ENERGY_WH)] | None = None
    job_steps_done: Count63 | None = None
    job_total_steps: Count63 | None = None
    schema_version: MessageSchema = messages.MESSAGE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_used_within_total(self)


class JobEvent(msgspec.Struct, kw_only=True, frozen=True):
    job_id: str
    board_id: str
    phase: Literal["accepted", "rejected", "running", "progress", "finished", "failed"]
    message: str = ""
    step: int | None = None
    loss: float | None = None
    compute_s: float | None = None
    ts: float | None = None
    data: dict[str, Any] | None = None
    schema_version: JobSchema = jobs.JOB_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.data is not None and not jobs._plain_data(self.data):  # the dataclass's own depth rule
            raise ValueError(f"field 'data' should be a map of plain values nested at most {jobs._DATA_MAX_DEPTH} deep "
                             f"with finite numbers, got {self.data!r:.60}")


class TrainCommand(msgspec.Struct, kw_only=True, frozen=True):
    kind: str = "train"
    job_id: str
    board_id: str
    exchange_host: str
    exchange_port: int
    token: str
    model: str
    model_options: dict[str, Scalar] = {}
    dataset: str = ""
    dataset_options: dict[str, Scalar] = {}
    datamodule: str = ""
    datamodule_options: dict[str, Scalar] = {}
    board_index: int
    batch_sizes: list[int]
    seed: int
    total_steps: int
    data_mode: str = "global"
    lr: float | None = None
    wire_dtype: str = "float32"
    threads: int = 0
    batches_per_epoch: int = 0
    max_epochs: int = 0
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    deterministic: bool = False
    precision: str = "32-true"
    exchange_tls_sha256: str = ""
    sync_every: int = 1
    sync_warmup: int = 0
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    placement: str = ""
    tail_port: int = 0
    pipeline: dict[str, Any] | None = None
    schema_version: TrainSchema = jobs.TRAIN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        jobs.TrainCommand.__post_init__(self)  # type: ignore[arg-type]  # the dataclass's rules, word for word


class TelemetrySettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The agent's ``[telemetry]`` section (``agent/config.py``), for the config error messages."""

    interval_s: Annotated[float, Meta(ge=0.05, le=3600)] = 1.0
    net_interfaces: tuple[str, ...] = ()
    sysfs_root: str = "/sys"
    cpu_scope: Literal["system", "cgroup"] = "system"
    home_assistant: bool = False
    home_assistant_prefix: str = "homeassistant"


def decoder(cls: type[T], fmt: str, *, max_bytes: int = MAX_JSON_BYTES) -> Callable[[bytes], T]:
    """Decode ``fmt`` ("json" or "msgpack") bytes into ``cls``, as the production decoders are called.

    Raises (the returned function):
        DecodeError: over ``max_bytes``, malformed, or a field msgspec refuses (its words, after the class name).
    """
    decode = (msgspec.json.Decoder(cls) if fmt == "json" else msgspec.msgpack.Decoder(cls)).decode
    name = cls.__name__

    def run(payload: bytes) -> T:
        if len(payload) > max_bytes:
            raise DecodeError(f"{name}: {len(payload)} bytes, over the limit of {max_bytes} for one message")
        try:
            return decode(payload)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise DecodeError(f"{name}: {exc}") from None
    return run
