"""The pipeline's stage links (issue 35): frames between the hosts of consecutive stages.

A pipelined job cuts the model into S stages (``workloads.stage_cut``), each on its own host. Each
step the first stage splits its batch into M micro-batches and they flow through the stages
GPipe-style. Every stream of tensors runs over a connection of its own, opened by the host that
sends it, so that no TLS connection is ever read and written at once:

* ``act``: stage k's output for micro-batch m, to stage k + 1 (k < S);
* ``out``: the last stage's output for micro-batch m, back to stage 1, whose ``training_step``
  computes the loss over its whole batch from the outputs put together;
* ``dout``: the loss's gradient with respect to micro-batch m's output, stage 1 to the last stage;
* ``dact``: the gradient with respect to stage k's input for micro-batch m, to stage k - 1.

A connection opens with ``stage_hello`` (the job, the sending board, its stage, the stream it will
carry, a proof of the board's key over the job, the sender, the stream and the receiver's TLS
certificate: ``protocol.exchange_auth``) and the receiver's ``stage_welcome`` or ``stage_refusal``;
``stage_stop`` ends a stream early with its reason. Every tensor is checked against the step,
micro-batch, shape and dtype the plan expects before it is used, and must be finite.
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

STAGE_VERSION = 1
STAGE_HELLO, STAGE_WELCOME, STAGE_REFUSAL, STAGE_STOP, STAGE_TENSOR = (
    "stage_hello", "stage_welcome", "stage_refusal", "stage_stop", "stage_tensor")
ACT, OUT, DOUT, DACT = "act", "out", "dout", "dact"
STREAMS = (ACT, OUT, DOUT, DACT)
MAX_ID = 128
MAX_PROOF_BYTES = 128
MAX_STAGES = 64
MAX_MICRO_BATCHES = 4096
MAX_GROUP = 64  # boards in stage 0's group
_PROTOCOL = "stage link"


def _text(d: Mapping[str, Any], key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise DecodeError(f"{STAGE_HELLO} frame: {key} {value!r:.40} is not a string of 1 to {MAX_ID} characters")
    return value


def _whole(d: Mapping[str, Any], frame: str, key: str, below: int) -> int:
    value = d.get(key)
    if not is_int(value) or not 0 <= value < below:
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a whole number below {below}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class StageHello:
    """A stage host opens one stream to its neighbour: the job, itself, its stage, the stream, its proof."""

    job_id: str
    board_id: str
    stage: int
    stream: str
    start: int
    proof: bytes = dataclasses.field(repr=False)

    def to_wire(self) -> dict[str, Any]:
        return {"type": STAGE_HELLO, "v": STAGE_VERSION, "job_id": self.job_id, "board_id": self.board_id,
                "stage": self.stage, "stream": self.stream, "start": self.start, "proof": self.proof}

    @classmethod
    def from_wire(cls, d: Any) -> StageHello:
        """Raises DecodeError: not a stage hello of this version, or a field of the wrong type."""
        expect_kind(d, STAGE_HELLO, _PROTOCOL)
        if d.get("v") != STAGE_VERSION:
            raise DecodeError(f"the peer speaks stage link protocol {d.get('v')!r:.10}, this board {STAGE_VERSION}: "
                              "install the same edgefleet version on every board")
        stream, proof = d.get("stream"), d.get("proof")
        if stream not in STREAMS:
            raise DecodeError(f"{STAGE_HELLO} frame: stream {stream!r:.20} is not one of {', '.join(STREAMS)}")
        if not isinstance(proof, bytes) or not 0 < len(proof) <= MAX_PROOF_BYTES:
            raise DecodeError(f"{STAGE_HELLO} frame: proof is not 1 to {MAX_PROOF_BYTES} bytes")
        return cls(job_id=_text(d, "job_id"), board_id=_text(d, "board_id"),
                   stage=_whole(d, STAGE_HELLO, "stage", MAX_STAGES), stream=str(stream),
                   start=_whole(d, STAGE_HELLO, "start", 2**62), proof=proof)


@dataclasses.dataclass(frozen=True)
class StageMessage:
    """A welcome (empty reason), a refusal or a stop: the reason, for the peer's log and its failed event."""

    kind: str
    reason: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.kind, "v": STAGE_VERSION, "reason": self.reason[:1000]}


class StageStopped(DecodeError):
    """The peer sent ``stage_stop`` or ``stage_refusal`` where a tensor or a welcome was expected."""


def decode_stage_reply(d: Any) -> None:
    """The receiver's answer to a hello.

    Raises:
        StageStopped: refused (the reason says why).
        DecodeError: malformed.
    """
    kind = frame_kind(d, _PROTOCOL)
    if kind in (STAGE_REFUSAL, STAGE_STOP):
        raise StageStopped(str(d.get("reason", ""))[:1000] or "the peer ended the job")
    expect_kind(d, STAGE_WELCOME, _PROTOCOL)


@dataclasses.dataclass(frozen=True)
class StageTensor:
    """One micro-batch's tensor on one stream: ``act``, ``out``, ``dout`` or ``dact``; ``micros``: the step's
    micro-batch count (a batch smaller than the plan's micro-batch count is split into fewer); ``src``: which board
    of stage 0's group the micro-batch comes from (its samples' board: 0 with a group of one)."""

    stream: str
    step: int
    micro: int
    micros: int
    tensor: np.ndarray
    src: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"type": STAGE_TENSOR, "k": self.stream, "step": self.step, "src": self.src, "mb": self.micro,
                "n": self.micros, "t": encode_array(self.tensor)}

    @staticmethod
    def key_of(d: Any, stream: str) -> tuple[int, int, int, int]:
        """A ``stream`` frame's (step, source board, micro-batch, micro-batches), checked before its tensor is decoded.

        Raises:
            StageStopped: the peer stopped the stream (the reason says why).
            DecodeError: another frame or stream, or a step or micro-batch that is not a whole number.
        """
        kind = frame_kind(d, _PROTOCOL)
        if kind in (STAGE_STOP, STAGE_REFUSAL):
            raise StageStopped(str(d.get("reason", ""))[:1000] or "the peer ended the job")
        expect_kind(d, STAGE_TENSOR, _PROTOCOL)
        if d.get("k") != stream:
            raise DecodeError(f"a {d.get('k')!r:.10} tensor on the {stream} stream")
        micros = _whole(d, stream, "n", MAX_MICRO_BATCHES + 1)
        micro = _whole(d, stream, "mb", max(micros, 1))
        src = _whole(d, stream, "src", MAX_GROUP) if "src" in d else 0
        return _whole(d, stream, "step", 2**62), src, micro, micros

    @classmethod
    def from_wire(cls, d: Any, stream: str, *, step: int, micro: int, sample: tuple[int, ...], rows: int | None = None,
                  max_rows: int = 0, src: int = 0) -> StageTensor:
        """The frame as ``stream``'s tensor for (``step``, ``micro``): a finite float32 tensor of ``rows`` samples
        (None: 1 to ``max_rows``) of shape ``sample`` each.

        Raises:
            StageStopped: the peer stopped the stream.
            DecodeError: another stream, step, micro-batch, shape or dtype, or a NaN or infinite value (the message
                says which).
        """
        import numpy as np  # numpy: only a training process decodes tensors

        at_step, at_src, at_micro, micros = cls.key_of(d, stream)
        if (at_step, at_src, at_micro) != (step, src, micro):
            raise DecodeError(f"{stream} frame for step {at_step} board {at_src} micro-batch {at_micro}, expected step "
                              f"{step} board {src} micro-batch {micro}")
        where = f"{stream} frame for step {step} micro-batch {micro}"
        most = rows if rows is not None else max_rows
        expected = f"({'1..' + str(most) if rows is None else rows}, {', '.join(map(str, sample))}) float32"
        try:
            array = (decode_array(d.get("t"), max_elements=most * math.prod(sample))
                     if isinstance(d.get("t"), dict) else None)
        except DecodeError as exc:
            raise DecodeError(f"{where}: {exc}, expected shape {expected}") from None
        if (array is None or array.dtype != np.float32 or tuple(array.shape[1:]) != sample or array.ndim < 1
                or not 0 < array.shape[0] <= most or (rows is not None and array.shape[0] != rows)):
            what = "no tensor" if array is None else f"shape {tuple(array.shape)} {array.dtype}"
            raise DecodeError(f"{where}: {what}, expected shape {expected}")
        if not np.isfinite(array).all():
            raise DecodeError(f"{where}: holds NaN or infinite values")
        return cls(stream=stream, step=step, micro=micro, micros=micros, tensor=array, src=src)


__all__ = ["ACT", "DACT", "DOUT", "MAX_GROUP", "MAX_STAGES", "OUT", "STAGE_HELLO", "STAGE_REFUSAL", "STAGE_STOP", "STAGE_TENSOR",
           "STAGE_VERSION", "STAGE_WELCOME", "STREAMS", "StageHello", "StageMessage", "StageStopped", "StageTensor",
           "decode_stage_reply"]
