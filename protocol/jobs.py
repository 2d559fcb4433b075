"""Training jobs on the control plane: the command a board is given and the events it sends back.

Commands travel signed (``protocol.signing``) on ``…/boards/<id>/cmd``; events travel as msgpack
on ``…/boards/<id>/events``. Both are plain maps validated into these dataclasses, so a malformed
or hostile message is refused with a message that names the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from protocol._validate import message_from_dict
from protocol.errors import DecodeError

JOB_SCHEMA_VERSION = 1
WIRE_DTYPES = ("float32", "float16", "bfloat16")
DATA_MODES = ("global", "local")
EVENT_PHASES = ("accepted", "rejected", "running", "progress", "finished", "failed")
MAX_EVENT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainCommand:
    """Start (or join) a training job. The body of a signed ``train`` command."""

    kind: str = "train"
    job_id: str                     # the run id; every event and exchange frame names it
    board_id: str                   # the addressee: a board refuses a command meant for another
    exchange_host: str              # the coordinator's exchange endpoint
    exchange_port: int
    token: str                      # per-job secret the board shows when it connects to the exchange
    model: str                      # built-in name, import path "pkg.mod:Class" or entry point
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset: str
    dataset_options: dict[str, Any] = field(default_factory=dict)
    board_index: int                # this board's slice of each global batch
    batch_sizes: list[int]          # every board's batch size, by board_index; their sum is the global batch
    seed: int
    total_steps: int                # the job ends after this global step
    data_mode: str = "global"       # "global": every board holds the whole dataset; "local": each its own
    lr: float | None = None         # overrides the model's default learning rate
    wire_dtype: str = "float32"     # gradients on the wire: float32, float16 or bfloat16
    threads: int = 0                # torch threads on the board; 0 = torch's default
    schema_version: int = JOB_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.kind != "train":
            raise ValueError(f"kind {self.kind!r} is not 'train'")
        if not 0 <= self.board_index < len(self.batch_sizes):
            raise ValueError(f"board_index {self.board_index} is outside the {len(self.batch_sizes)} batch sizes")
        if any(b < 0 for b in self.batch_sizes) or sum(self.batch_sizes) <= 0:
            raise ValueError(f"batch_sizes {self.batch_sizes} must be >= 0 with a positive sum")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {self.wire_dtype!r} is not one of {WIRE_DTYPES}")
        if self.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode {self.data_mode!r} is not one of {DATA_MODES}")
        if not 0 < self.exchange_port < 65536 or self.total_steps < 0:
            raise ValueError("exchange_port or total_steps out of range")

    @property
    def batch_size(self) -> int:
        return self.batch_sizes[self.board_index]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TrainCommand:
        return message_from_dict(cls, data, schema_version=JOB_SCHEMA_VERSION)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopCommand:
    """Stop a running job on a board (its worker ends; the agent returns to idle)."""

    kind: str = "stop"
    job_id: str
    board_id: str
    schema_version: int = JOB_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StopCommand:
        return message_from_dict(cls, data, schema_version=JOB_SCHEMA_VERSION)


def command_from_dict(data: Any) -> TrainCommand | StopCommand:
    """The command a verified body describes.

    Raises:
        DecodeError: unknown kind or invalid fields.
    """
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "train":
        return TrainCommand.from_dict(data)
    if kind == "stop":
        return StopCommand.from_dict(data)
    raise DecodeError(f"unknown command kind {kind!r}; this agent understands 'train' and 'stop'")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """What a board says about a job: accepted, rejected, running, progress, finished or failed."""

    job_id: str
    board_id: str
    phase: str
    message: str = ""               # human words, e.g. why it failed and what to do
    step: int | None = None         # the last global step the board took part in
    loss: float | None = None
    compute_s: float | None = None  # the board's own time for its last step (forward + backward)
    ts: float | None = None
    schema_version: int = JOB_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.phase not in EVENT_PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {EVENT_PHASES}")

    def to_msgpack(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> JobEvent:
        if len(payload) > MAX_EVENT_BYTES:
            raise DecodeError(f"JobEvent: {len(payload)} bytes is over the {MAX_EVENT_BYTES}-byte limit")
        try:
            data = msgpack.unpackb(payload, max_str_len=MAX_EVENT_BYTES, max_bin_len=0, max_array_len=1000, max_map_len=100)
        except (ValueError, msgpack.UnpackException) as exc:
            raise DecodeError(f"JobEvent: not valid msgpack ({exc})") from None
        return message_from_dict(cls, data, schema_version=JOB_SCHEMA_VERSION)


__all__ = ["DATA_MODES", "WIRE_DTYPES", "JobEvent", "StopCommand", "TrainCommand", "command_from_dict"]
