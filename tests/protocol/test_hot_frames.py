"""The fixed-layout grad and avg frames: plain msgpack, decoded exactly as the general decoder does."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefleet.protocol.codec import encode_array
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.exchange_frames import Avg, BatchSplit, Stop, decode_step_reply
from edgefleet.protocol.framing import FRAME_ALIGN, decode_frame, encode_frame
from edgefleet.protocol.hot_frames import HotFrame

_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
u32 = st.integers(0, 2**32 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)


def _payload(segments: list) -> memoryview:
    """The payload (no length header) received into a buffer, as the exchange reads it."""
    joined = b"".join(bytes(s) for s in segments)
    (size,) = struct.unpack(">I", joined[:4])
    assert size == len(joined) - 4
    return memoryview(bytearray(joined[4:]))


def _values(kind: str, draw_u32: int, x: float) -> dict:
    if kind == "grad":
        return {"step": draw_u32, "n": 1 + draw_u32 % 1000, "loss": x, "compute_s": abs(x)}
    return {"step": draw_u32, "n": 1 + draw_u32 % 1000, "boards": 1 + draw_u32 % 7}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["grad", "avg"]), dtype=st.sampled_from(sorted(_NUMPY)), elements=st.integers(0, 5000),
       number=u32, x=finite)
def test_a_fixed_layout_frame_decodes_to_what_the_general_decoder_gives(kind: str, dtype: str, elements: int,
                                                                        number: int, x: float) -> None:
    hot = HotFrame(kind, dtype)
    data = np.arange(elements, dtype=_NUMPY[dtype])
    payload = _payload(hot.encode(_values(kind, number, x), encode_array(data)))
    fast, general = hot.decode(payload), decode_frame(payload)
    assert fast == general and list(fast) == list(general)  # same keys, same order, same values
    assert bytes(fast["g"]["data"]) == data.tobytes()
    assert isinstance(fast["g"]["data"], memoryview) and fast["g"]["data"].readonly
    assert hot.prefix_bytes % FRAME_ALIGN == 0  # the tensor's data starts aligned
    plain = msgpack.unpackb(bytes(payload))  # any msgpack decoder reads it
    padding = plain.pop("_align")
    assert padding == bytes(len(padding)) and plain["type"] == kind and plain["g"]["data"] == data.tobytes()


def test_what_does_not_fit_the_layout_is_left_to_the_general_path() -> None:
    hot = HotFrame("grad", "float32")
    tensor = encode_array(np.zeros(10, dtype=np.float32))
    good = {"step": 1, "n": 8, "loss": 0.5, "compute_s": 0.1}
    assert hot.encode(good, tensor) is not None
    assert hot.encode({**good, "loss": None}, tensor) is None           # nil is not a float 64
    assert hot.encode({**good, "step": 2**32}, tensor) is None          # beyond 32 bits
    assert hot.encode({**good, "n": True}, tensor) is None              # a bool is not a count
    assert hot.encode(good, encode_array(np.zeros(10, dtype=np.float16))) is None  # another dtype
    assert hot.encode(good, encode_array(np.zeros((2, 5), dtype=np.float32))) is None  # not flat
    assert hot.encode({**good, "loss": 1}, tensor) is not None          # an int loss travels as a float


def test_other_frames_fall_back_and_bad_input_raises_the_protocols_error() -> None:
    hot = HotFrame("avg", "float32")
    resplit = Avg(step=3, n=16, boards=2, g=np.ones(20_000, dtype=np.float32), split=BatchSplit(5, (8, 8)))
    assert resplit.hot_segments(hot) is None
    payload = _payload(encode_frame(resplit.to_wire()))
    assert hot.decode(payload) is None
    back = decode_step_reply(hot.decode_any_array(payload), elements=20_000, dtype="float32")
    assert isinstance(back, Avg) and back.split == BatchSplit(5, (8, 8))
    stop = _payload(encode_frame(Stop("done").to_wire()))
    assert hot.decode(stop) is None and decode_step_reply(hot.decode_any(stop), elements=1, dtype="float32") == Stop("done")
    fine = _payload(hot.encode({"step": 1, "n": 2, "boards": 1}, encode_array(np.ones(100, dtype=np.float32))))
    for broken in (fine[:-1], fine[:50], memoryview(bytearray(b"\x00" * len(fine)))):
        assert hot.decode(broken) is None
        with pytest.raises(DecodeError):
            hot.decode_any(broken)
    lying = bytearray(fine)
    lying[hot.prefix_bytes - 4:hot.prefix_bytes] = struct.pack(">I", 404)  # the bin says another size
    assert hot.decode(memoryview(lying)) is None
    with pytest.raises(DecodeError):
        hot.decode_any(memoryview(lying))


def test_there_is_no_layout_for_other_kinds_or_dtypes() -> None:
    with pytest.raises(ValueError, match="no fixed layout"):
        HotFrame("hello", "float32")
    with pytest.raises(ValueError, match="no fixed layout"):
        HotFrame("grad", "int8")
