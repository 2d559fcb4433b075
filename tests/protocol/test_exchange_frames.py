"""The exchange's frames: round trips through the wire format, malformed fields refused with what is wrong,
and a peer of another protocol version told which side to upgrade."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from edgefleet.protocol.codec import encode_array, encode_value
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import (
    EXCHANGE_VERSION,
    Avg,
    BatchSplit,
    ExchangeVersionError,
    Grad,
    GradientRefused,
    Hello,
    Refusal,
    Stop,
    Welcome,
    decode_hello_reply,
    decode_step_reply,
)
from edgefleet.protocol.framing import decode_frame, encode_frame
from edgefleet.protocol.hot_frames import HotFrame

P = 100


def _payload(segments: list[Any]) -> memoryview:
    """A frame's payload (after its length header) as a receiver's buffer holds it."""
    joined = b"".join(bytes(segment) for segment in segments)
    (size,) = struct.unpack(">I", joined[:4])
    assert size == len(joined) - 4
    return memoryview(bytearray(joined[4:]))


def _wire(frame: Any) -> dict[str, Any]:
    """``frame`` sent with the general encoder and decoded as a receiver does."""
    return decode_frame(_payload(encode_frame(frame.to_wire())))


def _grad(**over: Any) -> dict[str, Any]:
    return _wire(Grad(step=3, n=8, loss=0.5, compute_s=0.01, g=np.arange(P, dtype=np.float32))) | over


def test_hello_welcome_refusal_and_stop_round_trip() -> None:
    hello = Hello(job_id="job", board_id="b1", token="secret", param_count=P)
    assert Hello.from_wire(_wire(hello)) == hello and hello.v == EXCHANGE_VERSION
    assert "secret" not in repr(hello)
    state = encode_value({"w": np.ones(3, np.float32)})
    welcome = Welcome(step=5, model=state, optimizer={}, schedulers=[{"last_epoch": 2}],
                      splits=(BatchSplit(6, (4, 12)), BatchSplit(9, (8, 8))))
    back = Welcome.from_wire(_wire(welcome))
    assert (back.step, back.optimizer, back.schedulers, back.splits, back.v) == (5, {}, [{"last_epoch": 2}], welcome.splits, 1)
    assert bytes(back.model["w"]["data"]) == np.ones(3, np.float32).tobytes()  # the state tree passes through as it came
    plain = Welcome(step=0, model={}, optimizer={})
    assert set(plain.to_wire()) == {"type", "v", "step", "model", "optimizer"}  # optional fields only when set
    assert decode_hello_reply(_wire(plain)) == plain
    assert decode_hello_reply(_wire(Refusal("wrong job or token"))) == Refusal("wrong job or token")
    assert decode_step_reply(_wire(Stop("job finished")), elements=P, dtype="float32") == Stop("job finished")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_grad_and_avg_round_trip_through_the_general_encoder(dtype: str) -> None:
    vector = np.arange(P, dtype=np.float32).astype(np.uint16 if dtype == "bfloat16" else dtype)
    grad = Grad(step=3, n=8, loss=None, compute_s=0.25, g=vector, logs={"acc": [0.5, True, False, True]})
    back = Grad.from_wire(_wire(grad), elements=P, dtype=dtype)
    assert (back.step, back.n, back.loss, back.compute_s, back.logs) == (3, 8, None, 0.25, grad.logs)
    assert back.array.dtype == vector.dtype and np.array_equal(back.array, vector)
    avg = Avg(step=3, n=24, boards=2, g=vector, split=BatchSplit(5, (8, 16)), lrs=(0.1, 0.01))
    result = decode_step_reply(_wire(avg), elements=P, dtype=dtype)
    assert isinstance(result, Avg) and (result.step, result.n, result.boards, result.split, result.lrs) == (3, 24, 2, avg.split, avg.lrs)
    assert np.array_equal(result.array, vector)


@pytest.mark.parametrize("kind", ["grad", "avg"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_step_frames_keep_their_fixed_layout_and_decode_without_a_copy(kind: str, dtype: str) -> None:
    vector = (np.arange(P) / 7).astype(dtype)
    tensor = encode_array(vector)
    layout = HotFrame(kind, dtype)
    if kind == "grad":
        values: dict[str, Any] = {"step": 7, "n": 16, "loss": 1.25, "compute_s": 0.5}
        frame: Grad | Avg = Grad(g=tensor, **values)
    else:
        values = {"step": 7, "n": 48, "boards": 3}
        frame = Avg(g=tensor, **values)
    segments = frame.hot_segments(layout)
    assert segments is not None and segments[1] is tensor["data"]  # the tensor's own memory, not a copy
    assert b"".join(map(bytes, segments)) == b"".join(map(bytes, layout.encode(values, tensor)))  # the layout, byte for byte
    payload = _payload(segments)
    decoded = layout.decode(payload, array=True)
    assert decoded is not None
    back = (Grad if kind == "grad" else Avg).from_wire(decoded, elements=P, dtype=dtype)
    assert np.shares_memory(back.array, np.frombuffer(payload, np.uint8))  # a view of the receive buffer
    assert np.array_equal(back.array, vector) and all(getattr(back, key) == value for key, value in values.items())


def test_what_does_not_fit_a_fixed_layout_takes_the_general_encoder() -> None:
    tensor = encode_array(np.zeros(P, np.float32))
    grad, avg = HotFrame("grad", "float32"), HotFrame("avg", "float32")
    assert Grad(step=1, n=8, loss=None, compute_s=0.1, g=tensor).hot_segments(grad) is None
    assert Grad(step=1, n=8, loss=0.5, compute_s=0.1, g=tensor, logs={"a": [1.0, True, True, True]}).hot_segments(grad) is None
    assert Avg(step=1, n=8, boards=1, g=tensor, split=BatchSplit(3, (8,))).hot_segments(avg) is None
    assert Avg(step=1, n=8, boards=1, g=tensor, lrs=(0.1,)).hot_segments(avg) is None
    assert Avg(step=1, n=8, boards=1, g=tensor).hot_segments(avg) is not None


@pytest.mark.parametrize("over, message", [
    ({"n": 0}, "sample count 0 is not a positive integer"),
    ({"n": True}, "sample count True is not a positive integer"),
    ({"loss": "low"}, "grad frame: loss 'low' is not a number"),
    ({"compute_s": [1]}, "grad frame: compute_s [1] is not a number"),
    ({"g": None}, "grad frame: g is a NoneType, not a tensor"),
    ({"g": encode_array(np.zeros(P - 1, np.float32))}, "grad frame: gradient of shape (99,) and dtype float32, expected (100,) float32"),
    ({"g": encode_array(np.zeros(P, np.float16))}, "dtype float16, expected (100,) float32"),
    ({"g": encode_array(np.zeros(P + 1, np.float32))}, "101 elements, over the limit of 100"),
    ({"logs": {"x": ["high", True, True, True]}}, "logged value 'x' is not [finite number, on_step, on_epoch, prog_bar]"),
    ({"logs": {"x": [float("nan"), True, True, True]}}, "logged value 'x'"),
    ({"logs": {f"m{i}": [1.0, True, True, True] for i in range(65)}}, "logs must be a map of at most 64 names"),
    # issue 36 item 10: signals that are not finite or out of range (the general and the fixed layout's frame)
    ({"loss": float("nan")}, "loss nan is not a finite number"),
    ({"loss": float("-inf")}, "loss -inf is not a finite number"),
    ({"loss": 1e300, "g": np.zeros(P, np.float32)}, "loss 1e+300 is not a finite number"),
    ({"loss": float("inf"), "g": np.zeros(P, np.float32)}, "loss inf is not a finite number"),
    ({"compute_s": float("nan"), "g": np.zeros(P, np.float32)}, "compute_s nan is not a time between 0 and 86400 s"),
    ({"compute_s": float("inf")}, "compute_s inf is not a time"),
    ({"compute_s": -1e9}, "compute_s -1000000000.0 is not a time"),
    ({"compute_s": 1e300, "g": np.zeros(P, np.float32)}, "compute_s 1e+300 is not a time"),
    ({"compute_s": 86401}, "compute_s 86401.0 is not a time"),
])
def test_a_gradient_with_a_bad_field_is_refused_for_its_step(over: dict[str, Any], message: str) -> None:
    with pytest.raises(GradientRefused) as refused:
        Grad.from_wire(_grad(**over), elements=P, dtype="float32")
    assert message in str(refused.value) and refused.value.step == 3


def test_a_loss_of_none_and_signals_in_range_are_kept() -> None:
    """None: training_step skipped every batch; 0 s and a day are times; a negative finite loss is a loss."""
    for over in ({"loss": None}, {"compute_s": None}, {"compute_s": 0.0}, {"compute_s": 86400.0}, {"loss": -1e9},
                 {"loss": -1e9, "compute_s": 0.0, "g": np.zeros(P, np.float32)}):
        frame = Grad.from_wire(_grad(**over), elements=P, dtype="float32")
        assert frame.step == 3


@pytest.mark.parametrize("frame, message", [
    ({"type": "avg", "step": 3}, "expected a grad frame, got 'avg'"),
    ({"step": 3}, "exchange frame without a str type"),
    ([1, 2], "an exchange frame is a map, not list"),
    ({"type": "grad", "step": -1}, "grad frame: step -1 is not a step number"),
    ({"type": "grad", "step": "3"}, "grad frame: step '3' is not a step number"),
])
def test_a_frame_that_is_no_gradient_at_all_is_malformed(frame: Any, message: str) -> None:
    with pytest.raises(DecodeError) as refused:
        Grad.from_wire(frame, elements=P, dtype="float32")
    assert message in str(refused.value) and not isinstance(refused.value, GradientRefused)


@pytest.mark.parametrize("frame, message", [
    ({"type": "hello", "v": 1, "job_id": "j", "board_id": "b1", "token": "t"}, "hello frame: param_count None is not a whole number"),
    ({"type": "hello", "v": 1, "job_id": "j", "board_id": 7, "token": "t", "param_count": 1}, "hello frame: board_id 7 is not a string"),
    ({"type": "hello", "v": 1, "job_id": "j" * 300, "board_id": "b", "token": "t", "param_count": 1}, "at most 256 characters"),
    ({"type": "hello", "job_id": "j", "board_id": "b1", "token": "t", "param_count": 1}, "hello frame names no exchange protocol version"),
    ({"type": "welcome", "step": 0, "model": {}}, "welcome frame: the model or optimizer state is missing"),
    ({"type": "welcome", "step": -2, "model": {}, "optimizer": {}}, "welcome frame: step -2 is below 0"),
    ({"type": "welcome", "step": 0, "model": {}, "optimizer": {}, "schedulers": {}}, "schedulers is a dict, not a list"),
    ({"type": "welcome", "step": 0, "model": {}, "optimizer": {}, "splits": [{"from_step": 3, "batch_sizes": [0, 8]}]},
     "split batch_sizes [0, 8] is not a list of positive integers"),
    ({"type": "welcome", "step": 0, "model": {}, "optimizer": {}, "splits": [{"batch_sizes": [8]}]},
     "split from_step None is not a step number"),
    ({"type": "welcome", "step": 0, "model": {}, "optimizer": {}, "v": "1"}, "welcome frame names no exchange protocol version"),
    ({"type": "welcome", "step": 3, "model": {}, "optimizer": {}, "module_state": [1]}, "module_state is a list, not a map"),
    ({"type": "welcome", "step": 3, "model": {}, "optimizer": {}, "loss_scale": {"scale": 8.0}}, "loss_scale is not a map of"),
    ({"type": "welcome", "step": 3, "model": {}, "optimizer": {}, "loss_scale": {
        "scale": float("inf"), "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}},
     "loss_scale's scale inf is not a finite number >= 0"),
    ({"type": "grad", "step": 0}, "expected a welcome frame, got 'grad'"),
    ({"type": "error"}, "error frame: message None is not a string"),
])
def test_a_malformed_hello_or_welcome_names_the_field(frame: dict[str, Any], message: str) -> None:
    decode = Hello.from_wire if frame["type"] == "hello" else decode_hello_reply
    with pytest.raises(DecodeError) as refused:
        decode(frame)
    assert message in str(refused.value)


@pytest.mark.parametrize("over, message", [
    ({"split": {"from_step": 2, "batch_sizes": []}}, "split batch_sizes [] is not a list of positive integers"),
    ({"split": [2, [8]]}, "a split must be a map, got list"),
    ({"lrs": [0.1, -1.0]}, "avg frame: lrs [0.1, -1.0] is not a list of learning rates"),
    ({"lrs": [float("inf")]}, "is not a list of learning rates"),
    ({"boards": None}, "avg frame: boards None is not a whole number"),
    ({"type": "welcome"}, "expected a step's result, got a 'welcome' frame"),
])
def test_a_malformed_result_names_the_field(over: dict[str, Any], message: str) -> None:
    frame = _wire(Avg(step=3, n=8, boards=1, g=np.zeros(P, np.float32))) | over
    with pytest.raises(DecodeError) as refused:
        decode_step_reply(frame, elements=P, dtype="float32")
    assert message in str(refused.value)


@pytest.mark.parametrize("version, upgrade", [(2, "upgrade edge-coordinator"), (0, "upgrade edge-agent on board b1")])
def test_a_hello_of_another_version_says_which_side_to_upgrade(version: int, upgrade: str) -> None:
    frame = _wire(Hello(job_id="job", board_id="b1", token="secret", param_count=P, v=version))
    with pytest.raises(ExchangeVersionError) as refused:
        Hello.from_wire(frame)
    assert str(refused.value) == f"board b1 speaks exchange protocol {version}, this coordinator 1: {upgrade}"
    assert refused.value.peer_version == version and refused.value.board_id == "b1"
    assert refused.value.vouched_by("job", "secret") and not refused.value.vouched_by("job", "guess")
    assert not refused.value.vouched_by("other", "secret")
    with pytest.raises(ExchangeVersionError, match="^a board speaks exchange protocol 3, this coordinator 1: upgrade edge-coordinator$"):
        Hello.from_wire({"type": "hello", "v": 3})  # a future hello may look different: the version is read first


@pytest.mark.parametrize("version, upgrade", [(2, "upgrade edge-agent on this board"), (0, "upgrade edge-coordinator")])
def test_a_welcome_of_another_version_says_which_side_to_upgrade(version: int, upgrade: str) -> None:
    with pytest.raises(ExchangeVersionError, match=f"^the coordinator speaks exchange protocol {version}, this board 1: {upgrade}$"):
        decode_hello_reply(_wire(Welcome(step=0, model={}, optimizer={}, v=version)))
    unversioned = {"type": "welcome", "step": 4, "model": {}, "optimizer": {}}
    assert Welcome.from_wire(unversioned).v == 1  # a welcome without v is version 1


def test_hello_checks_its_job_and_token_in_constant_time_for_any_characters() -> None:
    hello = Hello(job_id="job", board_id="b1", token="sécret", param_count=P)
    assert hello.vouched_by("job", "sécret") and not hello.vouched_by("job", "secret") and not hello.vouched_by("j", "sécret")


def test_a_welcome_takes_only_its_own_optional_fields_by_name() -> None:
    welcome = Welcome(step=0, model={}, optimizer={})
    assert welcome.with_fields({"schedulers": [{"a": 1}]}).schedulers == [{"a": 1}]
    assert welcome.with_fields({}) is welcome
    kept = welcome.with_fields({"module_state": {"updates": 4}})  # what on_save_checkpoint added, for a late board
    assert Welcome.from_wire(_wire(kept)).module_state == {"updates": 4}
    assert "module_state" not in welcome.to_wire()
    with pytest.raises(ValueError, match=r"a welcome has no field\(s\) \['step'\]"):
        welcome.with_fields({"step": 3})


def test_a_welcome_carries_the_fleets_loss_scale_only_for_16_mixed() -> None:
    state = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 7}
    back = Welcome.from_wire(_wire(Welcome(step=4, model={}, optimizer={}, loss_scale=state)))
    assert back.loss_scale == state
    assert "loss_scale" not in Welcome(step=4, model={}, optimizer={}).to_wire()
