"""The activation exchange's frames (protocol.activation_frames): a step's tensor is taken only as the
step, shape and dtype it must be, finite."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.protocol.activation_frames import ACT, DACT, TAIL_STOP, StepTensor, TailHello, TailMessage, TailStopped
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.framing import decode_frame, encode_frame


def _round_trip(frame: dict) -> dict:
    return decode_frame(b"".join(bytes(s) for s in encode_frame(frame)[1:]))


def test_a_step_tensor_round_trips() -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = StepTensor.from_wire(_round_trip(StepTensor(ACT, 3, a).to_wire()), ACT, step=3, shape=(2, 4))
    assert np.array_equal(got.tensor, a)


@pytest.mark.parametrize(("tensor", "step", "kind", "why"), [
    (np.zeros((2, 5), np.float32), 3, ACT, r"shape \[2, 5\].*expected shape \(2, 4\)"),
    (np.zeros((2, 4), np.float64), 3, ACT, "float64"),
    (np.full((2, 4), np.nan, np.float32), 3, ACT, "NaN"),
    (np.zeros((2, 4), np.float32), 4, ACT, "step 4, expected step 3"),
    (np.zeros((2, 4), np.float32), 3, DACT, "expected 'act'|act"),
])
def test_a_wrong_step_tensor_is_refused_saying_what_was_wrong(tensor: np.ndarray, step: int, kind: str, why: str) -> None:
    frame = _round_trip(StepTensor(kind, step, tensor).to_wire())
    with pytest.raises(DecodeError, match=why):
        StepTensor.from_wire(frame, ACT, step=3, shape=(2, 4))


def test_a_stop_in_place_of_a_tensor_says_why() -> None:
    with pytest.raises(TailStopped, match="job finished"):
        StepTensor.from_wire(_round_trip(TailMessage(TAIL_STOP, "job finished").to_wire()), ACT, step=0, shape=(1,))


def test_a_hello_of_another_version_is_refused() -> None:
    wire = TailHello(job_id="j", board_id="b", token="t", start=0).to_wire() | {"v": 99}
    with pytest.raises(DecodeError, match="activation protocol 99"):
        TailHello.from_wire(_round_trip(wire))
