"""The gradient exchange's wire contract: every frame a board and the coordinator send on the exchange socket.

Each frame is a ``protocol.framing`` map (msgpack, a str ``type``) and here a dataclass, frozen
but for the two frames of every step (:class:`Grad`, :class:`Avg`: see the note above them):
``to_wire()`` gives the map to send, ``from_wire(d)`` validates a decoded map and raises
``DecodeError`` naming the frame and the field.

    board -> coordinator   hello    {v, job_id, board_id, token, param_count, proof?} :class:`Hello`
    coordinator -> board   welcome  {v, step, model, optimizer, schedulers?, splits?}  :class:`Welcome`
                           error    {message}                                      :class:`Refusal`
    board -> coordinator   grad     {step, n, loss, compute_s, g, logs?}           :class:`Grad`
    coordinator -> board   avg      {step, n, boards, g, split?, lrs?}             :class:`Avg`
                           stop     {reason}                                       :class:`Stop`

A ``split`` (:class:`BatchSplit`) re-divides the global batch among the boards, by board index,
from step ``from_step`` on. :func:`decode_hello_reply` and :func:`decode_step_reply` read what a
board expects back.

Versions: :data:`EXCHANGE_VERSION` is the one version of this contract. ``hello`` and ``welcome``
carry it as ``v``; a peer of another version is refused with :class:`ExchangeVersionError`, whose
message says which side to upgrade. A welcome without ``v`` is version 1.

Tensors stay as they travel, never copied here: ``g`` is the flat numpy array over the receive
buffer once decoded (``protocol.hot_frames`` layouts give it as one; a general frame's tensor map
is turned into one by ``protocol.codec.decode_array``), or, to send, a ``protocol.codec.encode_array``
tensor map (or an array, described on the way out). ``model``, ``optimizer`` and ``schedulers``
are ``protocol.codec.encode_value`` trees, passed through untouched. The two frames of every step,
``grad`` and ``avg``, go out in the fixed layouts of ``protocol.hot_frames`` whenever they fit one
(:meth:`Grad.encode_hot`, :meth:`Avg.encode_hot`), byte for byte what those layouts are.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import msgpack

from edgefleet.protocol._msgpack_view import ALIGN_KEY
from edgefleet.protocol.codec import decode_array, encode_array
from edgefleet.protocol.errors import DecodeError, ProtocolError
from edgefleet.protocol.frame_fields import expect_kind, frame_kind, is_int
from edgefleet.protocol.framing import FRAME_ALIGN, FRAME_HEADER, MAX_FRAME_BYTES
from edgefleet.protocol.wire_dtype import WIRE_DTYPES, numpy_dtype

if TYPE_CHECKING:
    import numpy as np

    from edgefleet.protocol.hot_frames import HotFrame

EXCHANGE_VERSION: Final = 1
MAX_SPLIT_BOARDS = 4096  # a split or a list of learning rates longer than this is malformed
MAX_LOGGED = 64          # names a board may log in one step
MAX_LOG_NAME = 128       # characters of one logged name
MAX_ID = 256             # characters of a job id, board id or token
MAX_PROOF_BYTES = 64     # a hello's proof: an Ed25519 signature or an HMAC-SHA256
MAX_COMPUTE_S = 86400.0  # a grad frame's compute_s (seconds of one step's forward and backward) is at most a day
MAX_ABS_LOSS = 1e200     # a grad frame's loss is finite and at most this in size: sample-weighted sums stay finite
_U16, _U32, _F64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">d")
_COMPUTE_S_KEY = b"\xa9compute_s\xcb"  # msgpack: the key, then a float 64's type byte
STREAM_TAIL_BYTES = len(_COMPUTE_S_KEY) + 8  # what follows a streamed grad frame's tensor (Grad.stream_tail)

HELLO, WELCOME, REFUSAL, GRAD, AVG, STOP = "hello", "welcome", "error", "grad", "avg", "stop"


class ExchangeVersionError(ProtocolError):
    """A peer speaks another version of the exchange protocol; the message says which side to upgrade.

    Attributes:
        peer_version: the version the peer announced.
        board_id, job_id: what a refused hello claims (None where unreadable, and for a welcome).
    """

    def __init__(self, message: str, *, peer_version: int, board_id: str | None = None, job_id: str | None = None,
                 token: str | None = None, proof: bytes | None = None) -> None:
        super().__init__(message)
        self.peer_version, self.board_id, self.job_id = peer_version, board_id, job_id
        self._token = token
        self.proof = proof  # the refused hello's proof of the board's key (protocol.exchange_auth), if it had one

    @property
    def token(self) -> str:
        return self._token or ""

    def vouched_by(self, job_id: str, token: str) -> bool:
        """Whether the refused hello carried ``job_id`` and ``token``: it came from that job's board, not a stranger."""
        return self.job_id == job_id and self._token is not None and same_secret(self._token, token)


class GradientRefused(DecodeError):
    """A grad frame for a known step whose other fields are wrong: its gradient is refused for that step.

    Attributes:
        step: the step the frame is for.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


def _proof(d: Mapping[str, Any]) -> bytes | None:
    """A hello's ``proof``: bytes up to :data:`MAX_PROOF_BYTES`, else None."""
    proof = d.get("proof")
    return bytes(proof) if isinstance(proof, (bytes, bytearray, memoryview)) and 0 < len(proof) <= MAX_PROOF_BYTES else None


def same_secret(given: str, expected: str) -> bool:
    """Compare a presented token with the expected one in constant time (any characters)."""
    return hmac.compare_digest(given.encode(), expected.encode())


# ------------------------------------------------------------------------------------------ field checks

def _is_number(value: object) -> TypeGuard[int | float]:
    return type(value) is float or is_int(value) or isinstance(value, float)


def _kind(d: Any) -> str:
    """The frame's ``type``. Raises DecodeError: not a map, or no str type."""
    return frame_kind(d, "exchange")


def _expect(d: Any, kind: str) -> None:
    expect_kind(d, kind, "exchange")


def _whole(d: Mapping[str, Any], frame: str, key: str, *, minimum: int = 0) -> int:
    value = d.get(key)
    if type(value) is int and value >= minimum:  # the usual case, first
        return value
    if not is_int(value):
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a whole number")
    if value < minimum:
        raise DecodeError(f"{frame} frame: {key} {value} is below {minimum}")
    return int(value)


def _text(d: Mapping[str, Any], frame: str, key: str, *, limit: int = MAX_ID) -> str:
    value = d.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a string of at most {limit} characters")
    return value


def _number_or_none(d: Mapping[str, Any], frame: str, key: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise DecodeError(f"{frame} frame: {key} {value!r:.40} is not a number")
    return float(value)


def _version(d: Mapping[str, Any], frame: str, *, default: int | None = None) -> int:
    value = d.get("v", default)
    if not is_int(value):
        raise DecodeError(f"{frame} frame names no exchange protocol version (v = {value!r:.20})")
    return int(value)


_NUMPY: dict[str, tuple[Any, type[np.ndarray]]] = {}  # wire dtype -> (numpy dtype, numpy.ndarray): made on first use, numpy only to train


def _numpy(dtype: str) -> tuple[Any, type[np.ndarray]]:
    """The numpy dtype of wire dtype ``dtype``, and numpy's array type."""
    known = _NUMPY.get(dtype)
    if known is None:
        import numpy  # numpy: off the idle agent and the CLI start

        known = _NUMPY[dtype] = (numpy_dtype(dtype), numpy.ndarray)  # ValueError: not a wire dtype
    return known


def flat_array(value: Any, frame: str, *, elements: int, dtype: str) -> np.ndarray:
    """A frame's tensor as the flat array of ``elements`` of wire ``dtype`` it must be (no copy).

    ``value`` is an array already (a fixed layout's) or a tensor map (a general frame's).

    Raises:
        DecodeError: not a tensor, or another shape or dtype.
    """
    expected, ndarray = _numpy(dtype)
    if isinstance(value, ndarray):
        array: np.ndarray = value
    elif isinstance(value, dict):
        array = decode_array(value, max_elements=elements)
    else:
        raise DecodeError(f"{frame} frame: g is a {type(value).__name__}, not a tensor")
    if array.shape != (elements,) or array.dtype != expected:
        raise DecodeError(f"{frame} frame: gradient of shape {array.shape} and dtype {array.dtype}, "
                          f"expected ({elements},) {dtype}")
    return array


def _tensor_map(g: Any) -> dict[str, Any]:
    """``g`` as a tensor map to send: an array is described (its memory is not copied), a map is kept."""
    return g if isinstance(g, dict) else encode_array(g)


def _logs(value: Any) -> dict[str, list[Any]] | None:
    """A grad frame's ``logs`` (name -> [finite value, on_step, on_epoch, prog_bar]), or None if absent."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGGED:
        raise DecodeError(f"logs must be a map of at most {MAX_LOGGED} names")
    for name, entry in value.items():
        if not (isinstance(name, str) and 0 < len(name) <= MAX_LOG_NAME and isinstance(entry, list) and len(entry) == 4
                and _is_number(entry[0]) and math.isfinite(entry[0])
                and all(isinstance(flag, bool) for flag in entry[1:])):
            raise DecodeError(f"logged value {str(name)[:40]!r} is not [finite number, on_step, on_epoch, prog_bar]")
    return value


def _learning_rates(value: Any) -> tuple[float, ...]:
    if (not isinstance(value, list) or not 0 < len(value) <= MAX_SPLIT_BOARDS
            or not all(_is_number(v) and math.isfinite(v) and v >= 0 for v in value)):
        raise DecodeError(f"avg frame: lrs {str(value)[:60]} is not a list of learning rates")
    return tuple(float(v) for v in value)


# ------------------------------------------------------------------------------------------ frames

@dataclass(frozen=True, slots=True)
class BatchSplit:
    """A re-division of the global batch among the boards, by board index, in force from ``from_step`` on."""

    from_step: int
    batch_sizes: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"from_step": self.from_step, "batch_sizes": list(self.batch_sizes)}

    @classmethod
    def from_wire(cls, d: Any) -> BatchSplit:
        """Raises DecodeError: not a map of a step >= 0 and a list of positive batch sizes."""
        if not isinstance(d, Mapping):
            raise DecodeError(f"a split must be a map, got {type(d).__name__}")
        from_step, sizes = d.get("from_step"), d.get("batch_sizes")
        if not is_int(from_step) or from_step < 0:
            raise DecodeError(f"split from_step {from_step!r:.40} is not a step number")
        if (not isinstance(sizes, (list, tuple)) or not 0 < len(sizes) <= MAX_SPLIT_BOARDS
                or not all(is_int(b) and b > 0 for b in sizes)):
            raise DecodeError(f"split batch_sizes {sizes!r:.80} is not a list of positive integers")
        return cls(int(from_step), tuple(int(b) for b in sizes))


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """A board asks to join: it names the job, itself and its model's parameter count, and shows its credential.

    The credential is ``proof`` (the board's key over the job, its id and the exchange's certificate:
    ``protocol.exchange_auth``) or, for a board the coordinator cannot check that way, the ``token``
    its command carried ("" otherwise).
    """

    job_id: str
    board_id: str
    token: str = dataclasses.field(repr=False)
    param_count: int
    proof: bytes | None = dataclasses.field(default=None, repr=False)
    v: int = EXCHANGE_VERSION

    def to_wire(self) -> dict[str, Any]:
        wire = {"type": HELLO, "v": self.v, "job_id": self.job_id, "board_id": self.board_id, "token": self.token,
                "param_count": self.param_count}
        if self.proof is not None:
            wire["proof"] = self.proof
        return wire

    @classmethod
    def from_wire(cls, d: Any) -> Hello:
        """Raises:
            ExchangeVersionError: the board speaks another version (the message says which side to upgrade).
            DecodeError: not a hello, or a field of the wrong type.
        """
        _expect(d, HELLO)
        v = _version(d, HELLO)
        if v != EXCHANGE_VERSION:
            job_id, board_id, token = (d.get(k) if isinstance(d.get(k), str) else None for k in ("job_id", "board_id", "token"))
            who = f"board {board_id[:MAX_ID]}" if board_id else "a board"
            upgrade = "edge-coordinator" if v > EXCHANGE_VERSION else f"edge-agent on {who}"
            raise ExchangeVersionError(f"{who} speaks exchange protocol {v}, this coordinator {EXCHANGE_VERSION}: "
                                       f"upgrade {upgrade}", peer_version=v, board_id=board_id, job_id=job_id, token=token,
                                       proof=_proof(d))
        if "proof" in d and _proof(d) is None:
            raise DecodeError(f"hello field 'proof' should be up to {MAX_PROOF_BYTES} bytes, got {d['proof']!r:.40}")
        return cls(job_id=_text(d, HELLO, "job_id"), board_id=_text(d, HELLO, "board_id"), token=_text(d, HELLO, "token"),
                   param_count=_whole(d, HELLO, "param_count"), proof=_proof(d), v=v)

    def vouched_by(self, job_id: str, token: str) -> bool:
        """Whether the hello names ``job_id`` and presents ``token`` (compared in constant time)."""
        return self.job_id == job_id and same_secret(self.token, token)


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """The coordinator lets a board in: the step it starts at and the state to start from.

    ``splits``: the re-splits that still matter to a board starting at ``step`` (the one in force
    then, and any announced for later steps), in step order.
    """

    step: int
    model: Any                          # protocol.codec.encode_value tree of the model's state
    optimizer: Any                      # ... of the optimizer's state
    schedulers: list[Any] | None = None  # ... of each LR scheduler's state, in Lightning's order
    splits: tuple[BatchSplit, ...] = ()
    overlap: bool = False                # the vector's gradient is in reversed parameter order (``--overlap``)
    module_state: Any = None             # what the module's on_save_checkpoint added (a board joining mid-run loads it)
    loss_scale: dict[str, float] | None = None  # 16-mixed: the fleet's GradScaler state now (``workloads.loss_scaling``)
    outer_state: Any = None              # DiLoCo: encode_value tree of the outer optimizer's momentum (``workloads.outer_step``)
    v: int = EXCHANGE_VERSION

    def to_wire(self) -> dict[str, Any]:
        frame = {"type": WELCOME, "v": self.v, "step": self.step, "model": self.model, "optimizer": self.optimizer}
        if self.module_state is not None:
            frame["module_state"] = self.module_state
        if self.loss_scale is not None:
            frame["loss_scale"] = self.loss_scale
        if self.outer_state is not None:
            frame["outer_state"] = self.outer_state
        if self.schedulers:
            frame["schedulers"] = self.schedulers
        if self.splits:
            frame["splits"] = [split.to_wire() for split in self.splits]
        if self.overlap:  # only then: the welcome of an exact job is the same bytes as before
            frame["overlap"] = True
        return frame

    def with_fields(self, extra: Mapping[str, Any]) -> Welcome:
        """This welcome with more of its optional fields set by name (``schedulers``).

        Raises:
            ValueError: a name that is not an optional field of the welcome.
        """
        unknown = set(extra) - {"schedulers", "module_state", "loss_scale", "outer_state"}
        if unknown:
            raise ValueError(f"a welcome has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **extra) if extra else self

    @classmethod
    def from_wire(cls, d: Any) -> Welcome:
        """Raises:
            ExchangeVersionError: the coordinator speaks another version (the message says which side to upgrade).
            DecodeError: not a welcome, or a field of the wrong type.
        """
        _expect(d, WELCOME)
        v = _version(d, WELCOME, default=1)
        if v != EXCHANGE_VERSION:
            upgrade = "edge-agent on this board" if v > EXCHANGE_VERSION else "edge-coordinator"
            raise ExchangeVersionError(f"the coordinator speaks exchange protocol {v}, this board {EXCHANGE_VERSION}: "
                                       f"upgrade {upgrade}", peer_version=v)
        if "model" not in d or "optimizer" not in d:
            raise DecodeError("welcome frame: the model or optimizer state is missing")
        schedulers = d.get("schedulers")
        if schedulers is not None and not isinstance(schedulers, list):
            raise DecodeError(f"welcome frame: schedulers is a {type(schedulers).__name__}, not a list")
        splits = d.get("splits", [])
        if not isinstance(splits, list) or len(splits) > MAX_SPLIT_BOARDS:
            raise DecodeError("welcome frame: splits is not a list")
        overlap = d.get("overlap", False)
        if type(overlap) is not bool:
            raise DecodeError(f"welcome frame: overlap {overlap!r:.20} is not true or false")
        module_state = d.get("module_state")
        if module_state is not None and not isinstance(module_state, dict):
            raise DecodeError(f"welcome frame: module_state is a {type(module_state).__name__}, not a map")
        outer_state = d.get("outer_state")
        if outer_state is not None and not isinstance(outer_state, dict):
            raise DecodeError(f"welcome frame: outer_state is a {type(outer_state).__name__}, not a map")
        return cls(step=_whole(d, WELCOME, "step"), model=d["model"], optimizer=d["optimizer"], schedulers=schedulers,
                   splits=tuple(BatchSplit.from_wire(split) for split in splits), overlap=overlap,
                   module_state=module_state, loss_scale=_loss_scale(d.get("loss_scale")), outer_state=outer_state, v=v)


LOSS_SCALE_FIELDS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _loss_scale(value: Any) -> dict[str, float] | None:
    """A welcome's ``loss_scale``: a GradScaler's state, every field a finite number (None: not a 16-mixed job).

    Raises:
        DecodeError: not a map of exactly those fields, or a value that is not a finite number.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(LOSS_SCALE_FIELDS):
        raise DecodeError(f"welcome frame: loss_scale is not a map of {', '.join(LOSS_SCALE_FIELDS)}")
    numbers = {}
    for name in LOSS_SCALE_FIELDS:
        number = value[name]
        if type(number) not in (int, float) or not math.isfinite(number) or number < 0:
            raise DecodeError(f"welcome frame: loss_scale's {name} {number!r:.20} is not a finite number >= 0")
        numbers[name] = float(number)
    return numbers


@dataclass(frozen=True, slots=True)
class Refusal:
    """The coordinator refuses a board's hello, and says why."""

    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": REFUSAL, "message": self.message}

    @classmethod
    def from_wire(cls, d: Any) -> Refusal:
        _expect(d, REFUSAL)
        return cls(_text(d, REFUSAL, "message", limit=64 * 1024))


@dataclass(frozen=True, slots=True)
class Stop:
    """The coordinator ends the job for this board instead of sending a step's result."""

    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": STOP, "reason": self.reason}

    @classmethod
    def from_wire(cls, d: Any) -> Stop:
        _expect(d, STOP)
        reason = d.get("reason", "stopped by the coordinator")
        return cls(reason if isinstance(reason, str) else str(reason)[:200])


# Grad and Avg are the two frames of every step: each is built, sent, received and read once per board
# and step, on the exchange's critical path, where a round of a small model takes a few hundred
# microseconds and every microsecond added there shows in it several times over. So they are not
# frozen (a frozen dataclass's __init__ costs 0.6 us more; treat them as immutable), their fixed
# layouts are written without building one (:meth:`Grad.encode_hot`, :meth:`Avg.encode_hot`), and
# ``from_wire`` reads the fixed layout's frame, whose field types the layout guarantees, first.

@dataclass(slots=True, kw_only=True)
class Grad:
    """A board's mean gradient of one step over ``n`` samples, with its loss and what ``training_step`` logged.

    ``g``: the flat vector (gradient, then float buffers) as an array, or a tensor map to send.
    ``logs``: name -> [value, on_step, on_epoch, prog_bar].
    """

    step: int
    n: int
    loss: float | None
    compute_s: float | None
    g: np.ndarray | dict[str, Any]
    logs: dict[str, list[Any]] | None = None

    @property
    def array(self) -> np.ndarray:
        """``g`` as a numpy array (what :meth:`from_wire` gives)."""
        assert not isinstance(self.g, dict), "a tensor map to send, not a decoded gradient"
        return self.g

    def to_wire(self) -> dict[str, Any]:
        frame = {"type": GRAD, "step": self.step, "n": self.n, "loss": self.loss, "compute_s": self.compute_s,
                 "g": _tensor_map(self.g)}
        if self.logs:
            frame["logs"] = self.logs
        return frame

    def hot_segments(self, layout: HotFrame) -> list[bytes | memoryview] | None:
        """The frame in ``layout`` (a ``grad`` fixed layout), or None if it does not fit one (logs, a loss of None, ...)."""
        if self.logs is not None:
            return None
        return Grad.encode_hot(layout, step=self.step, n=self.n, loss=self.loss, compute_s=self.compute_s,
                               tensor=_tensor_map(self.g))

    @staticmethod
    def encode_hot(layout: HotFrame, *, step: int, n: int, loss: float | None, compute_s: float | None,
                   tensor: dict[str, Any]) -> list[bytes | memoryview] | None:
        """A grad frame without logs, ``tensor`` a tensor map, in ``layout``; None if it does not fit it."""
        return layout.encode({"step": step, "n": n, "loss": loss, "compute_s": compute_s}, tensor)

    @staticmethod
    def stream_head(*, step: int, n: int, loss: float, logs: dict[str, list[Any]] | None, dtype: str,
                    elements: int) -> bytes:
        """The start of a grad frame sent while backward runs (``--overlap``): its length header, then the map
        up to the tensor's data. The data (``elements`` values of wire ``dtype``) follows, then :meth:`stream_tail`.

        The frame is an ordinary msgpack map whose ``compute_s`` (known only when backward has ended)
        comes after the tensor; every decoder takes it. The tensor's data starts at a multiple of
        ``FRAME_ALIGN`` in the payload, as ``protocol.framing`` does; its ``bin`` is always a bin 32.

        Raises:
            ValueError: a dtype that is not a wire dtype, or a frame too large for the wire.
        """
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"{dtype!r} is not a wire dtype")
        nbytes = elements * WIRE_DTYPES[dtype].itemsize
        fields: dict[str, Any] = {"type": GRAD, "step": step, "n": n, "loss": loss}
        if logs:
            fields["logs"] = logs
        entries = b"".join(msgpack.packb(key) + msgpack.packb(value, use_bin_type=True) for key, value in fields.items())
        entries += (msgpack.packb("g") + b"\x83" + msgpack.packb("dtype") + msgpack.packb(dtype) + msgpack.packb("shape")
                    + msgpack.packb([elements]) + msgpack.packb("data") + b"\xc6" + _U32.pack(nbytes))
        count = len(fields) + 3  # + the padding, the tensor and compute_s
        header = (bytes((0x80 | count,)) if count < 16 else b"\xde" + _U16.pack(count)) + msgpack.packb(ALIGN_KEY) + b"\xc4"
        pad = -(len(header) + 1 + len(entries)) % FRAME_ALIGN
        prefix = header + bytes((pad,)) + bytes(pad) + entries
        payload = len(prefix) + nbytes + STREAM_TAIL_BYTES
        if payload > MAX_FRAME_BYTES:
            raise ValueError(f"a grad frame of {payload} bytes is larger than a frame may be")
        return bytes(FRAME_HEADER.pack(payload) + prefix)

    @staticmethod
    def stream_tail(compute_s: float) -> bytes:
        """The end of a streamed grad frame (:meth:`stream_head`): ``compute_s``, the map's last entry."""
        return _COMPUTE_S_KEY + _F64.pack(compute_s)

    @classmethod
    def from_wire(cls, d: Any, *, elements: int, dtype: str) -> Grad:
        """A grad frame whose ``g`` must be ``elements`` values of wire ``dtype``.

        Raises:
            DecodeError: not a grad frame, or no step number: the stream is not a board's.
            GradientRefused: a step number, but another field is wrong: refuse the gradient for that step
                (among them a loss that is not finite or above :data:`MAX_ABS_LOSS` in size, a ``compute_s`` not finite or outside
                [0, :data:`MAX_COMPUTE_S`], a logged value that is not finite).
        """
        if type(d) is not dict or d.get("type") != GRAD:
            _expect(d, GRAD)
        step, n, loss, compute_s, g = d.get("step"), d.get("n"), d.get("loss"), d.get("compute_s"), d.get("g")
        expected, ndarray = _numpy(dtype)
        if (type(step) is int and step >= 0 and type(n) is int and n > 0 and type(loss) is float
                and -MAX_ABS_LOSS <= loss <= MAX_ABS_LOSS and type(compute_s) is float and 0.0 <= compute_s <= MAX_COMPUTE_S
                and type(g) is ndarray and g.shape == (elements,) and g.dtype == expected and d.get("logs") is None):
            return cls(step=step, n=n, loss=loss, compute_s=compute_s, g=g)  # the fixed layout's frame
        if not is_int(step) or step < 0:
            raise DecodeError(f"grad frame: step {step!r:.40} is not a step number")
        try:
            if not is_int(n) or n <= 0:
                raise DecodeError(f"sample count {n!r:.40} is not a positive integer")
            array = flat_array(g, GRAD, elements=elements, dtype=dtype)
            loss, compute_s = _number_or_none(d, GRAD, "loss"), _number_or_none(d, GRAD, "compute_s")
            if loss is not None and not -MAX_ABS_LOSS <= loss <= MAX_ABS_LOSS:  # None: training_step skipped every batch
                raise DecodeError(f"loss {loss!r} is not a finite number of at most {MAX_ABS_LOSS:g} in size")
            if compute_s is not None and not 0.0 <= compute_s <= MAX_COMPUTE_S:  # NaN fails the comparison too
                raise DecodeError(f"compute_s {compute_s!r} is not a time between 0 and {MAX_COMPUTE_S:.0f} s")
            logs = _logs(d.get("logs"))
        except DecodeError as exc:
            raise GradientRefused(str(exc), step=step) from None
        return cls(step=step, n=n, loss=loss, compute_s=compute_s, g=array, logs=logs)


@dataclass(slots=True, kw_only=True)
class Avg:
    """A step's result: the average of ``boards`` boards' gradients over ``n`` samples in all.

    ``split``: a re-split announced with it; ``lrs``: learning rates (one per param group) every
    board sets before this step's update (a ReduceLROnPlateau's, decided on the coordinator).
    """

    step: int
    n: int
    boards: int
    g: np.ndarray | dict[str, Any]
    split: BatchSplit | None = None
    lrs: tuple[float, ...] | None = None

    @property
    def array(self) -> np.ndarray:
        """``g`` as a numpy array (what :meth:`from_wire` gives)."""
        assert not isinstance(self.g, dict), "a tensor map to send, not a decoded result"
        return self.g

    def to_wire(self) -> dict[str, Any]:
        frame = {"type": AVG, "step": self.step, "n": self.n, "boards": self.boards, "g": _tensor_map(self.g)}
        if self.split is not None:
            frame["split"] = self.split.to_wire()
        if self.lrs is not None:
            frame["lrs"] = list(self.lrs)
        return frame

    def hot_segments(self, layout: HotFrame) -> list[bytes | memoryview] | None:
        """The frame in ``layout`` (an ``avg`` fixed layout), or None if it does not fit one (a split, learning rates, ...)."""
        if self.split is not None or self.lrs is not None:
            return None
        return Avg.encode_hot(layout, step=self.step, n=self.n, boards=self.boards, tensor=_tensor_map(self.g))

    @staticmethod
    def encode_hot(layout: HotFrame, *, step: int, n: int, boards: int,
                   tensor: dict[str, Any]) -> list[bytes | memoryview] | None:
        """An avg frame without a split or learning rates, ``tensor`` a tensor map, in ``layout``; None if it does not fit it."""
        return layout.encode({"step": step, "n": n, "boards": boards}, tensor)

    @classmethod
    def from_wire(cls, d: Any, *, elements: int, dtype: str) -> Avg:
        """An avg frame whose ``g`` must be ``elements`` values of wire ``dtype``. Raises DecodeError."""
        _expect(d, AVG)
        return cls._read(d, elements=elements, dtype=dtype)

    @classmethod
    def _read(cls, d: Mapping[str, Any], *, elements: int, dtype: str) -> Avg:
        """The fields of a map whose type is avg."""
        step, n, boards, g, split, lrs = d.get("step"), d.get("n"), d.get("boards"), d.get("g"), d.get("split"), d.get("lrs")
        expected, ndarray = _numpy(dtype)
        if (type(step) is int and step >= 0 and type(n) is int and n >= 0 and type(boards) is int and boards >= 0
                and type(g) is ndarray and g.shape == (elements,) and g.dtype == expected and split is None and lrs is None):
            return cls(step=step, n=n, boards=boards, g=g)  # the fixed layout's frame
        return cls(step=_whole(d, AVG, "step"), n=_whole(d, AVG, "n"), boards=_whole(d, AVG, "boards"),
                   g=flat_array(g, AVG, elements=elements, dtype=dtype),
                   split=None if split is None else BatchSplit.from_wire(split),
                   lrs=None if lrs is None else _learning_rates(lrs))


def decode_hello_reply(d: Any) -> Welcome | Refusal:
    """What the coordinator answers a hello: a welcome or a refusal.

    Raises:
        ExchangeVersionError: a welcome of another version.
        DecodeError: anything else.
    """
    kind = _kind(d)
    if kind == WELCOME:
        return Welcome.from_wire(d)
    if kind == REFUSAL:
        return Refusal.from_wire(d)
    raise DecodeError(f"expected a welcome frame, got {kind!r:.40}")


def decode_step_reply(d: Any, *, elements: int, dtype: str) -> Avg | Stop:
    """What the coordinator answers a gradient: the step's result (``elements`` values of ``dtype``) or stop.

    Raises:
        DecodeError: anything else, or a malformed result.
    """
    kind = d.get("type") if type(d) is dict else None
    if type(kind) is not str:
        kind = _kind(d)  # raises DecodeError
    if kind == AVG:
        return Avg._read(d, elements=elements, dtype=dtype)
    if kind == STOP:
        return Stop.from_wire(d)
    raise DecodeError(f"expected a step's result, got a {kind!r:.40} frame")


__all__ = [
    "EXCHANGE_VERSION",
    "MAX_ABS_LOSS",
    "MAX_COMPUTE_S",
    "MAX_LOGGED",
    "MAX_SPLIT_BOARDS",
    "STREAM_TAIL_BYTES",
    "Avg",
    "BatchSplit",
    "ExchangeVersionError",
    "Grad",
    "GradientRefused",
    "Hello",
    "Refusal",
    "Stop",
    "Welcome",
    "decode_hello_reply",
    "decode_step_reply",
    "flat_array",
    "same_secret",
]
