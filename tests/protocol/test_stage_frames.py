"""The pipeline's stage-link frames (protocol.stage_frames) and hello proofs (protocol.stage_auth), issue 35:
a micro-batch's tensor is taken only as the stream, step, micro-batch, shape and dtype the plan expects, finite,
and a stream is opened only by the board, stage and key the plan names, to this receiver."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_auth import HelloProver
from edgefleet.protocol.framing import decode_frame, encode_frame
from edgefleet.protocol.signing import ed25519_public_key
from edgefleet.protocol.stage_auth import StageCredentials
from edgefleet.protocol.stage_frames import (
    ACT,
    DACT,
    DOUT,
    STAGE_REFUSAL,
    STAGE_STOP,
    STAGE_WELCOME,
    STREAMS,
    StageHello,
    StageMessage,
    StageStopped,
    StageTensor,
    decode_stage_reply,
)

SAMPLE = (3, 2)


def _round_trip(frame: dict[str, Any]) -> dict[str, Any]:
    return decode_frame(b"".join(bytes(s) for s in encode_frame(frame)[1:]))


def _tensor(rows: int = 4, *, dtype: Any = np.float32, fill: float | None = None) -> np.ndarray:
    a = np.arange(rows * 6, dtype=np.float64).reshape(rows, *SAMPLE).astype(dtype)
    if fill is not None:
        a.flat[1] = fill
    return a


def _wire(stream: str = ACT, step: int = 5, micro: int = 1, micros: int = 4, tensor: np.ndarray | None = None) -> dict[str, Any]:
    return _round_trip(StageTensor(stream, step, micro, micros, _tensor() if tensor is None else tensor).to_wire())


def _take(frame: dict[str, Any], *, rows: int | None = None, max_rows: int = 8) -> StageTensor:
    return StageTensor.from_wire(frame, ACT, step=5, micro=1, sample=SAMPLE, rows=rows, max_rows=max_rows)


def _hello(**changes: Any) -> dict[str, Any]:
    wire = StageHello(job_id="job-1", board_id="board-a", stage=2, stream=DACT, start=7, proof=b"p" * 64).to_wire()
    return wire | changes


# --- round trips ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", STREAMS)
def test_a_stage_tensor_round_trips_on_every_stream(stream: str) -> None:
    a = _tensor(3)
    got = StageTensor.from_wire(_wire(stream, tensor=a), stream, step=5, micro=1, sample=SAMPLE, rows=3)
    assert (got.stream, got.step, got.micro, got.micros) == (stream, 5, 1, 4)
    assert got.tensor.dtype == np.float32 and np.array_equal(got.tensor, a)


def test_any_row_count_up_to_max_rows_is_taken_when_none_is_asked() -> None:
    assert _take(_wire(tensor=_tensor(8)), max_rows=8).tensor.shape == (8, *SAMPLE)
    assert _take(_wire(tensor=_tensor(1)), max_rows=8).tensor.shape == (1, *SAMPLE)


def test_a_stage_hello_round_trips() -> None:
    hello = StageHello(job_id="job-1", board_id="board-a", stage=2, stream=DACT, start=7, proof=b"\x01" * 64)
    assert StageHello.from_wire(_round_trip(hello.to_wire())) == hello


def test_a_welcome_is_taken_and_a_refusal_or_stop_raises_its_reason() -> None:
    decode_stage_reply(_round_trip(StageMessage(STAGE_WELCOME).to_wire()))
    for kind in (STAGE_REFUSAL, STAGE_STOP):
        with pytest.raises(StageStopped, match="wrong credential"):
            decode_stage_reply(_round_trip(StageMessage(kind, "wrong credential").to_wire()))
    with pytest.raises(StageStopped, match="the peer ended the job"):
        decode_stage_reply(_round_trip(StageMessage(STAGE_STOP).to_wire()))
    with pytest.raises(DecodeError, match="expected a stage_welcome frame"):
        decode_stage_reply(_round_trip(_hello()))


def test_a_stage_message_bounds_its_reason() -> None:
    wire = _round_trip(StageMessage(STAGE_STOP, "x" * 5000).to_wire())
    assert wire["type"] == STAGE_STOP and len(wire["reason"]) == 1000


# --- a tensor refused ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("frame", "rows", "why"), [
    (_wire(stream=DACT), None, "a 'dact' tensor on the act stream"),
    (_wire(step=6), None, "act frame for step 6 board 0 micro-batch 1, expected step 5 board 0 micro-batch 1"),
    (_wire(micro=2), None, "step 5 board 0 micro-batch 2, expected step 5 board 0 micro-batch 1"),
    (_wire(tensor=np.zeros((4, 2, 3), np.float32)), None, r"shape \(4, 2, 3\) float32, expected shape \(1..8, 3, 2\)"),
    (_wire(tensor=np.zeros((4, 6), np.float32)), None, r"shape \(4, 6\) float32"),
    (_wire(tensor=_tensor(9)), None, r"54 elements, over the limit of 48.*expected shape \(1..8, 3, 2\)"),
    (_wire(tensor=_tensor(3)), 4, r"shape \(3, 3, 2\) float32, expected shape \(4, 3, 2\) float32"),
    (_wire(tensor=_tensor(0)), None, r"shape \(0, 3, 2\)"),
    (_wire(tensor=_tensor(4, dtype=np.float64)), None, "shape \\(4, 3, 2\\) float64, expected"),
    (_wire(tensor=_tensor(4, fill=np.nan)), None, "step 5 micro-batch 1: holds NaN or infinite values"),
    (_wire(tensor=_tensor(4, fill=np.inf)), None, "holds NaN or infinite values"),
    (_wire(tensor=_tensor(4, fill=-np.inf)), None, "holds NaN or infinite values"),
])
def test_a_wrong_stage_tensor_is_refused_saying_what_was_wrong(frame: dict[str, Any], rows: int | None,
                                                               why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        _take(frame, rows=rows)


def test_a_stop_in_place_of_a_tensor_raises_its_reason() -> None:
    with pytest.raises(StageStopped, match="board-b ran out of memory"):
        _take(_round_trip(StageMessage(STAGE_STOP, "board-b ran out of memory").to_wire()))
    with pytest.raises(StageStopped, match="refused you"):
        _take(_round_trip(StageMessage(STAGE_REFUSAL, "refused you").to_wire()))


@pytest.mark.parametrize(("changes", "why"), [
    ({"n": 0}, r"act frame: mb 1 is not a whole number below 1"),
    ({"n": 4097}, "n 4097 is not a whole number below 4097"),
    ({"n": -1}, "n -1 is not a whole number"),
    ({"n": True}, "n True is not a whole number"),
    ({"mb": 4}, "mb 4 is not a whole number below 4"),
    ({"mb": -1}, "mb -1 is not"),
    ({"mb": "1"}, "mb '1' is not"),
    ({"step": 2**62}, "step 4611686018427387904 is not a whole number"),
    ({"step": 1.0}, "step 1.0 is not"),
])
def test_a_micro_batch_or_step_out_of_range_is_refused(changes: dict[str, Any], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        _take(_wire() | changes)


def test_too_many_elements_are_refused_from_the_announced_shape_before_the_data_is_touched() -> None:
    frame = _wire()
    frame["t"] = {"dtype": "float32", "shape": [10**9, 3, 2], "data": b"not read"}
    with pytest.raises(DecodeError, match=r"6000000000 elements, over the limit of 48"):
        _take(frame)
    frame["t"] = {"dtype": "float32", "shape": [4, 3, 2], "data": 7}  # within the bound: the data is looked at
    with pytest.raises(DecodeError, match="tensor data must be bin"):
        _take(frame)


def test_a_tensor_frame_without_a_tensor_is_refused() -> None:
    frame = _wire()
    frame["t"] = [1, 2]
    with pytest.raises(DecodeError, match="no tensor, expected shape"):
        _take(frame)


def test_a_frame_of_another_kind_is_refused() -> None:
    with pytest.raises(DecodeError, match="expected a stage_tensor frame, got 'stage_hello'"):
        _take(_round_trip(_hello()))
    with pytest.raises(DecodeError, match="stage link frame is a map, not list"):
        StageTensor.key_of([1], ACT)


# --- a hello refused ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "why"), [
    ({"v": 2}, "stage link protocol 2, this board 1: install the same edgefleet version"),
    ({"v": None}, "stage link protocol None"),
    ({"stream": "grad"}, "stream 'grad' is not one of act, out, dout, dact"),
    ({"proof": b""}, "proof is not 1 to 128 bytes"),
    ({"proof": b"p" * 129}, "proof is not 1 to 128 bytes"),
    ({"proof": "text"}, "proof is not 1 to 128 bytes"),
    ({"job_id": ""}, "job_id '' is not a string of 1 to 128 characters"),
    ({"job_id": "j" * 129}, "job_id 'j+ is not a string of 1 to 128"),
    ({"board_id": 5}, "board_id 5 is not a string"),
    ({"board_id": None}, "board_id None is not a string"),
    ({"stage": 64}, "stage_hello frame: stage 64 is not a whole number below 64"),
    ({"stage": -1}, "stage -1 is not a whole number"),
    ({"start": -3}, "start -3 is not a whole number"),
    ({"type": STAGE_WELCOME}, "expected a stage_hello frame, got 'stage_welcome'"),
])
def test_a_wrong_stage_hello_is_refused_saying_what_was_wrong(changes: dict[str, Any], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        StageHello.from_wire(_round_trip(_hello(**changes)))


# --- proofs -------------------------------------------------------------------------------------------------------

FINGERPRINT = "ab" * 32
SAME = ("job-1", "board-a", 1, ACT, FINGERPRINT)


def _ed25519_pair() -> tuple[StageCredentials, StageCredentials]:
    seed = bytes(range(32))
    sender = StageCredentials(HelloProver("ed25519", seed))
    receiver = StageCredentials(HelloProver("ed25519", bytes(32)), board_keys={"board-a": [ed25519_public_key(seed)]})
    return sender, receiver


def _hmac_pair() -> tuple[StageCredentials, StageCredentials]:
    key = b"k" * 32
    return StageCredentials(HelloProver("hmac", key)), StageCredentials(HelloProver("hmac", key), hmac_key=key)


@pytest.mark.parametrize("pair", [_ed25519_pair, _hmac_pair], ids=["ed25519", "hmac"])
def test_a_proof_checks_for_the_same_stream_and_fails_when_any_part_differs(pair: Any) -> None:
    sender, receiver = pair()
    proof = sender.prove(*SAME)
    assert receiver.check(*SAME, proof)
    assert receiver.check(*SAME[:4], FINGERPRINT.upper(), proof)  # a fingerprint is compared in lower case
    for at, other in enumerate(("job-2", "board-b", 2, DOUT, "cd" * 32)):
        changed = list(SAME)
        changed[at] = other
        assert not receiver.check(*changed, proof), f"a proof for {SAME[at]!r} opened {other!r}"
    assert not receiver.check(*SAME, bytes([proof[0] ^ 1]) + proof[1:])
    assert not receiver.check(*SAME, proof[:-1])


def test_a_proof_by_another_key_fails() -> None:
    _, receiver = _ed25519_pair()
    impostor = StageCredentials(HelloProver("ed25519", bytes(range(1, 33))))
    assert not receiver.check(*SAME, impostor.prove(*SAME))
    _, hmac_receiver = _hmac_pair()
    assert not hmac_receiver.check(*SAME, StageCredentials(HelloProver("hmac", b"x" * 32)).prove(*SAME))


def test_a_proof_of_a_kind_the_receiver_holds_no_key_for_fails() -> None:
    ed_sender, ed_receiver = _ed25519_pair()
    hmac_sender, hmac_receiver = _hmac_pair()
    assert not hmac_receiver.check(*SAME, ed_sender.prove(*SAME))  # no public key of board-a
    assert not ed_receiver.check(*SAME, hmac_sender.prove(*SAME))  # no fleet key
