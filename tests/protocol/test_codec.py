from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgefleet.protocol.codec import (
    TENSOR_DTYPES,
    DecodeLimits,
    decode_array,
    decode_value,
    encode_array,
    encode_value,
    from_bf16_bits,
    to_bf16_bits,
)
from edgefleet.protocol.errors import DecodeError

NUMPY_DTYPES = ["<f4", "<f2", "<f8", "<i8", "<i4", "|u1", "|b1", "<u2"]  # uint16: bfloat16 bits
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


def _wire(obj: Any) -> Any:
    """What a peer receives: the value through msgpack and back."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True))


def _same(a: Any, b: Any) -> bool:
    """Structural equality where arrays compare by dtype, shape and bits, NaN equals NaN, tuples are lists."""
    if isinstance(a, (np.ndarray, np.generic)):
        a = np.asarray(a)
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# --- arrays ---------------------------------------------------------------------------------------


@given(st.sampled_from(NUMPY_DTYPES).flatmap(lambda dt: hnp.arrays(np.dtype(dt), SHAPES)))
def test_array_round_trip_keeps_dtype_shape_and_bits(array: np.ndarray) -> None:
    decoded = decode_array(_wire(encode_array(array)), max_elements=10_000)
    assert _same(array, decoded)


@given(hnp.arrays(np.float32, SHAPES))
def test_big_endian_and_strided_arrays_arrive_as_the_same_values(array: np.ndarray) -> None:
    swapped = array.astype(">f4")
    strided = np.repeat(array[..., None], 2, axis=-1)[..., 0] if array.ndim else array
    for source in (swapped, strided):
        decoded = decode_array(_wire(encode_array(source)), max_elements=10_000)
        assert decoded.dtype == np.dtype("<f4") and decoded.shape == array.shape
        assert decoded.tobytes() == array.astype("<f4").tobytes()


def test_encoding_a_contiguous_array_does_not_copy_it() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = encode_array(array)["data"]
    assert np.shares_memory(np.frombuffer(data, np.uint8), array)


def test_decoded_array_is_a_read_only_view_of_the_bin() -> None:
    data = bytearray(np.arange(4, dtype="<i4").tobytes())
    decoded = decode_array({"dtype": "int32", "shape": [2, 2], "data": data}, max_elements=4)
    assert np.shares_memory(decoded, np.frombuffer(data, np.uint8))
    assert not decoded.flags.writeable


@pytest.mark.parametrize("array", [np.zeros((2, 2), np.int16), np.zeros(3, np.complex64),
                                   np.array(["a"]), np.array([object()])])
def test_encode_array_refuses_dtypes_off_the_wire(array: np.ndarray) -> None:
    with pytest.raises(TypeError, match="cannot go on the wire"):
        encode_array(array)


def _tensor(**over: Any) -> dict[str, Any]:
    return {"dtype": "float32", "shape": [2], "data": bytes(8), **over}


@pytest.mark.parametrize("m, fragment", [
    (_tensor(dtype="object"), "dtype 'object' is not one of"),
    (_tensor(dtype="O"), "dtype 'O' is not one of"),
    (_tensor(dtype="<f4"), "dtype '<f4' is not one of"),
    (_tensor(dtype=["float32"]), "is not one of"),
    (_tensor(shape=2), "shape must be a list"),
    (_tensor(shape=[-2]), "non-negative ints"),
    (_tensor(shape=[True, 2]), "non-negative ints"),
    (_tensor(shape=[2.0]), "non-negative ints"),
    (_tensor(shape=[1] * 33), "33 dimensions"),
    (_tensor(shape=[1 << 40], data=b""), "over the limit of 100"),
    (_tensor(shape=[3]), "needs 12 bytes, got 8"),
    (_tensor(data=[0, 0]), "must be bin"),
    (_tensor(data="\x00" * 8), "must be bin"),
    ({"dtype": "float32", "shape": [2]}, "lacks ['data']"),
    ([1, 2], "a tensor is a map"),
    ({"dtype": "bool", "shape": [2], "data": b"\x01\x02"}, "other than 0 and 1"),
])
def test_decode_array_rejects_bad_tensors_naming_the_problem(m: Any, fragment: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        decode_array(m, max_elements=100)
    assert fragment in str(excinfo.value)


@given(st.fixed_dictionaries({
    "dtype": st.sampled_from([*TENSOR_DTYPES, "O", "<f4", "float128", ""]) | st.integers() | st.none(),
    "shape": st.lists(st.integers(-2, 6) | st.booleans() | st.floats(), max_size=4) | st.integers(),
    "data": st.binary(max_size=80) | st.text(max_size=4),
}))
def test_decode_array_returns_the_declared_shape_or_raises_decode_error(m: dict[str, Any]) -> None:
    try:
        decoded = decode_array(m, max_elements=1000)
    except DecodeError:
        return
    assert list(decoded.shape) == m["shape"]
    assert decoded.nbytes == len(m["data"])


# --- bfloat16 -------------------------------------------------------------------------------------


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, max_side=8),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_bf16_rounding_matches_torch(values: np.ndarray) -> None:
    ours = to_bf16_bits(values)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    assert ours.dtype == np.uint16
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.isnan(from_bf16_bits(ours)[~finite]).all()


@given(hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)))
def test_bf16_bits_survive_widening_and_the_wire(bits: np.ndarray) -> None:
    wide = from_bf16_bits(bits)
    not_nan = ~np.isnan(wide)
    assert np.array_equal(to_bf16_bits(wide)[not_nan], bits[not_nan])
    message = _wire(encode_array(bits))
    assert message["dtype"] == "bfloat16"
    decoded = decode_array(message, max_elements=10_000)
    assert decoded.dtype == np.uint16 and np.array_equal(decoded, bits)


def test_bf16_helpers_insist_on_their_dtypes() -> None:
    with pytest.raises(TypeError, match="float32"):
        to_bf16_bits(np.zeros(2, np.float64))
    with pytest.raises(TypeError, match="uint16"):
        from_bf16_bits(np.zeros(2, np.int16))


# --- nested values --------------------------------------------------------------------------------

ARRAYS = st.sampled_from(NUMPY_DTYPES).flatmap(lambda dt: hnp.arrays(np.dtype(dt), SHAPES))
SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=8) | ARRAYS)
KEYS = st.text(max_size=6) | st.sampled_from(["__nd__", "__pairs__", "dtype", "data"])
VALUES = st.recursive(SCALARS, lambda inner: (
    st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(KEYS, inner, max_size=4)
    | st.dictionaries(st.integers(-5, 1 << 40) | KEYS, inner, max_size=4)), max_leaves=20)


@given(VALUES)
def test_nested_values_round_trip(value: Any) -> None:
    assert _same(value, decode_value(_wire(encode_value(value))))


def test_int_keyed_dicts_travel_as_pairs() -> None:
    assert encode_value({0: "a", "b": 1}) == {"__pairs__": [[0, "a"], ["b", 1]]}
    assert encode_value({"__nd__": 1}) == {"__pairs__": [["__nd__", 1]]}
    assert encode_value({"plain": [1, (2, 3)]}) == {"plain": [1, [2, 3]]}


def _numpy_state(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {key: _numpy_state(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_numpy_state(item) for item in obj)
    return obj


def _torch_state(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {key: _torch_state(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_torch_state(item) for item in obj]
    return obj


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=generator)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.95)),
    lambda params: torch.optim.AdamW(params, lr=1e-2, amsgrad=True),
    lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
], ids=["adam", "adamw-amsgrad", "sgd-momentum"])
def test_optimizer_state_dict_survives_the_wire_and_resumes_identically(make_optimizer: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = make_optimizer(model.parameters())
    _train(model, optimizer, steps=3, seed=1)

    wire = msgpack.packb(encode_value({"model": _numpy_state(model.state_dict()),
                                       "optimizer": _numpy_state(optimizer.state_dict())}), use_bin_type=True)
    restored = _torch_state(decode_value(msgpack.unpackb(wire)))
    replica = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    replica.load_state_dict(restored["model"])
    replica_optimizer = make_optimizer(replica.parameters())
    replica_optimizer.load_state_dict(restored["optimizer"])

    assert sorted(restored["optimizer"]["state"]) == [0, 1, 2, 3]
    _train(model, optimizer, steps=2, seed=2)
    _train(replica, replica_optimizer, steps=2, seed=2)
    for ours, theirs in zip(model.parameters(), replica.parameters(), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("value, error, fragment", [
    (torch.zeros(2), TypeError, "t.detach().cpu().numpy()"),
    ({1, 2}, TypeError, "cannot encode builtins.set"),
    ({True: 1}, TypeError, "only int and str keys"),
    ({1.5: 1}, TypeError, "only int and str keys"),
    (1 << 64, ValueError, "64 bits"),
])
def test_encode_value_refuses_what_it_cannot_carry(value: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        encode_value(value)


def test_encode_value_stops_at_a_cycle() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="nests deeper"):
        encode_value(cycle)


_ND = {"__nd__": 1, "dtype": "uint8", "shape": [1], "data": b"\x00"}


@pytest.mark.parametrize("value, fragment", [
    ({**_ND, "extra": 1}, "exactly the keys"),
    ({**_ND, "__nd__": 2}, "exactly the keys"),
    ({**_ND, "dtype": "object"}, "is not one of"),
    ({"__pairs__": [[1, 2]], "x": 1}, "holds only a list"),
    ({"__pairs__": [[1, 2, 3]]}, "is not a [key, value] pair"),
    ({"__pairs__": [[True, 2]]}, "neither int nor str"),
    ({"__pairs__": [[1.5, 2]]}, "neither int nor str"),
    ({"__pairs__": [[1, 2], [1, 3]]}, "appears twice"),
    ({b"k": 1}, "must be str"),
    ([msgpack.ExtType(5, b"x")], "unexpected ExtType"),
    ({"t": msgpack.Timestamp(1)}, "unexpected Timestamp"),
    ([[[[1]]]], "nests deeper than 3"),
])
def test_decode_value_rejects_malformed_values(value: Any, fragment: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        decode_value(value, limits=DecodeLimits(max_depth=3))
    assert fragment in str(excinfo.value)


def test_decode_value_limits_array_elements() -> None:
    value = encode_value({"w": np.zeros(100, np.float32)})
    with pytest.raises(DecodeError, match="over the limit of 99"):
        decode_value(_wire(value), limits=DecodeLimits(max_array_elements=99))


GARBAGE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["__nd__", "__pairs__", "dtype", "shape", "data", "x"]) | st.integers(), inner, max_size=4),
    max_leaves=12)


@given(GARBAGE)
def test_decode_value_on_arbitrary_structures_returns_or_raises_decode_error(value: Any) -> None:
    with contextlib.suppress(DecodeError):
        decode_value(value)


def test_importing_the_protocol_keeps_numpy_and_torch_out() -> None:
    code = ("import sys, edgefleet.protocol.codec, edgefleet.protocol.framing, edgefleet.protocol.signing; "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
