"""The activation exchange's frames (layer placement): boards and the tail host, one step at a time.

A placed job (``--placement CUT``) cuts the model into a head, trained data-parallel on the boards,
and a tail that runs once over the whole global batch on the tail host (``workloads.layer_cut``).
Each step, on its own authenticated connection (TLS when the exchange has it, the same credential
as the gradient exchange's hello):

1. board -> host ``act``: the head's output for the board's slice of the global batch, float32,
   shape ``(n, *boundary)``; the host runs the tail's forward over every board's slice at once;
2. host -> board ``out``: the tail's output for the board's slice; the board's ``training_step``
   computes its loss from it as from its own forward;
3. board -> host ``dout``: the gradient of the board's loss with respect to that output;
4. host -> board ``dact``: the gradient with respect to the board's activation; the board finishes
   backward through its head, then exchanges the head's gradient as in data-parallel training.

A connection starts with ``tail_hello`` (job, board, credential, the step the board starts at) and
the host's ``tail_welcome`` (the boundary's per-sample shape) or a ``refusal``; ``stop`` ends it.
Every tensor is checked against the shape and dtype the step takes before it is used, and must be
finite: a board that sends anything else is dropped from the step and named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from edgefleet.protocol.codec import decode_array, encode_array
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.frame_fields import expect_kind, frame_kind, is_int

if TYPE_CHECKING:
    import numpy as np

ACTIVATION_VERSION = 1
TAIL_HELLO, TAIL_WELCOME, ACT, OUT, DOUT, DACT, TAIL_STOP, TAIL_REFUSAL = (
    "tail_hello", "tail_welcome", "act", "out", "dout", "dact", "tail_stop", "tail_refusal")
MAX_ID = 128
MAX_PROOF_BYTES = 128
MAX_DIMS = 6
_PROTOCOL = "activation exchange"


def _text(d: Mapping[str, Any], frame: str, key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or len(value) > MAX_ID:
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a string of at most {MAX_ID} characters")
    return value


def _whole(d: Mapping[str, Any], frame: str, key: str) -> int:
    value = d.get(key)
    if not is_int(value) or value < 0:
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a whole number")
    return int(value)


def _shape(value: Any, frame: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or not all(is_int(v) and 0 < v < 2**31 for v in value)):
        raise DecodeError(f"{frame} frame: shape {value!r:.60} is not a list of at most {MAX_DIMS} positive sizes")
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class TailHello:
    """A board opens its activation connection: the job, itself, its credential, and the step it starts at."""

    job_id: str
    board_id: str
    token: str = dataclasses.field(repr=False)
    start: int
    proof: bytes | None = dataclasses.field(default=None, repr=False)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": TAIL_HELLO, "v": ACTIVATION_VERSION, "job_id": self.job_id,
                                "board_id": self.board_id, "token": self.token, "start": self.start}
        if self.proof is not None:
            wire["proof"] = self.proof
        return wire

    @classmethod
    def from_wire(cls, d: Any) -> TailHello:
        """Raises DecodeError: not a tail hello of this version, or a field of the wrong type."""
        expect_kind(d, TAIL_HELLO, _PROTOCOL)
        if d.get("v") != ACTIVATION_VERSION:
            raise DecodeError(f"the board speaks activation protocol {d.get('v')!r:.10}, this coordinator "
                              f"{ACTIVATION_VERSION}: install the same edgefleet version on both")
        proof = d.get("proof")
        if proof is not None and (not isinstance(proof, bytes) or len(proof) > MAX_PROOF_BYTES):
            raise DecodeError(f"tail_hello frame: proof is not up to {MAX_PROOF_BYTES} bytes")
        return cls(job_id=_text(d, TAIL_HELLO, "job_id"), board_id=_text(d, TAIL_HELLO, "board_id"),
                   token=_text(d, TAIL_HELLO, "token"), start=_whole(d, TAIL_HELLO, "start"), proof=proof)


@dataclasses.dataclass(frozen=True)
class TailWelcome:
    """The host takes the board: one sample's activation shape at the cut, and the output's."""

    boundary: tuple[int, ...]
    output: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"type": TAIL_WELCOME, "v": ACTIVATION_VERSION, "boundary": list(self.boundary),
                "output": list(self.output)}

    @classmethod
    def from_wire(cls, d: Any) -> TailWelcome:
        expect_kind(d, TAIL_WELCOME, _PROTOCOL)
        return cls(boundary=_shape(d.get("boundary"), TAIL_WELCOME), output=_shape(d.get("output"), TAIL_WELCOME))


@dataclasses.dataclass(frozen=True)
class TailMessage:
    """A refusal or a stop from the host: the reason, for the board's log and its failed event."""

    kind: str
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.kind, "reason": self.reason[:1000]}


@dataclasses.dataclass(frozen=True)
class StepTensor:
    """``act``, ``out``, ``dout`` or ``dact``: one step's tensor for one board's slice."""

    kind: str
    step: int
    tensor: np.ndarray

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.kind, "step": self.step, "t": encode_array(self.tensor)}

    @classmethod
    def from_wire(cls, d: Any, kind: str, *, step: int, shape: tuple[int, ...]) -> StepTensor:
        """The frame as ``kind`` for ``step``: a finite float32 tensor of ``shape``.

        Raises:
            DecodeError: another frame, step, shape or dtype, or a value that is NaN or infinite (the message says which).
        """
        import numpy as np  # numpy: only a training process decodes tensors

        got = frame_kind(d, _PROTOCOL)
        if got in (TAIL_STOP, TAIL_REFUSAL):
            raise TailStopped(str(d.get("reason", ""))[:1000] or "the tail host ended the job")
        expect_kind(d, kind, _PROTOCOL)
        at = _whole(d, kind, "step")
        if at != step:
            raise DecodeError(f"{kind} frame for step {at}, expected step {step}")
        elements = math.prod(shape)
        try:
            array = decode_array(d.get("t"), max_elements=elements) if isinstance(d.get("t"), dict) else None
        except DecodeError as exc:
            raise DecodeError(f"{kind} frame for step {step}: {exc}, expected shape {shape} float32") from None
        if array is None or array.dtype != np.float32 or tuple(array.shape) != shape:
            what = "no tensor" if array is None else f"shape {tuple(array.shape)} {array.dtype}"
            raise DecodeError(f"{kind} frame for step {step}: {what}, expected shape {shape} float32")
        if not np.isfinite(array).all():
            raise DecodeError(f"{kind} frame for step {step}: holds NaN or infinite values")
        return cls(kind=kind, step=at, tensor=array)


class TailStopped(DecodeError):
    """The host sent ``tail_stop`` or ``tail_refusal`` instead of the expected frame."""


def decode_tail_reply(d: Any) -> TailWelcome:
    """The host's answer to a tail hello.

    Raises:
        TailStopped: refused (the reason says why).
        DecodeError: malformed.
    """
    if frame_kind(d, _PROTOCOL) in (TAIL_REFUSAL, TAIL_STOP):
        raise TailStopped(str(d.get("reason", ""))[:1000])
    return TailWelcome.from_wire(d)


__all__ = ["ACT", "ACTIVATION_VERSION", "DACT", "DOUT", "OUT", "TAIL_REFUSAL", "TAIL_STOP", "StepTensor", "TailHello",
           "TailMessage", "TailStopped", "TailWelcome", "decode_tail_reply"]
