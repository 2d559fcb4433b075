"""Sparse vectors for the top-k exchange: round trips through msgpack, every refusal of a hostile map, the weighted add."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import numpy as np
import pytest

from edgefleet.protocol.codec import from_bf16_bits, to_bf16_bits
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.sparse_vector import (
    FLOAT16_MAX,
    MAX_DENSE_LENGTH,
    SparseVector,
    add_weighted_into,
    decode_sparse,
    dense_to_sparse,
    encode_sparse,
    to_dense,
    to_wire_values,
)

LENGTH = 1000


def _wire(obj: Any) -> Any:
    """What a peer receives: the map through msgpack and back."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True))


def _sparse(dtype: str = "float32", count: int = 50, seed: int = 0) -> SparseVector:
    rng = np.random.default_rng(seed)
    indices = np.sort(rng.choice(LENGTH, size=count, replace=False)).astype(np.uint32)
    values = rng.standard_normal(count).astype(np.float32)
    return SparseVector(length=LENGTH, indices=indices, values=to_wire_values(values, dtype))


def _good_map() -> dict[str, Any]:
    return _wire(encode_sparse(_sparse()))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_through_msgpack_keeps_every_bit(dtype: str) -> None:
    sent = _sparse(dtype)
    got = decode_sparse(_wire(encode_sparse(sent)), length=LENGTH)
    assert got.dtype == dtype and got.length == LENGTH and got.nnz == sent.nnz
    assert got.indices.dtype == np.uint32 and np.array_equal(got.indices, sent.indices)
    assert got.values.dtype == sent.values.dtype and np.array_equal(got.values.view(np.uint8), sent.values.view(np.uint8))
    assert got.wire_bytes() == sent.nnz * (4 + sent.values.itemsize)


def test_empty_and_full_vectors_round_trip() -> None:
    empty = SparseVector(length=LENGTH, indices=np.zeros(0, np.uint32), values=np.zeros(0, np.float32))
    assert decode_sparse(_wire(encode_sparse(empty)), length=LENGTH).nnz == 0
    dense = np.arange(1, LENGTH + 1, dtype=np.float32)
    full = decode_sparse(_wire(encode_sparse(dense_to_sparse(dense))), length=LENGTH)
    assert np.array_equal(to_dense(full), dense)


def test_indices_above_2_to_the_31_keep_their_bits() -> None:
    """uint32 travels as int32 bits; the largest dense length's indices all come back (2^28 - 1 is the top)."""
    top = np.array([MAX_DENSE_LENGTH - 2, MAX_DENSE_LENGTH - 1], dtype=np.uint32)
    sent = SparseVector(length=MAX_DENSE_LENGTH, indices=top, values=np.ones(2, np.float32))
    got = decode_sparse(_wire(encode_sparse(sent)), length=MAX_DENSE_LENGTH)
    assert np.array_equal(got.indices, top)


def _with(**changes: Any) -> dict[str, Any]:
    m = _good_map()
    m.update(changes)
    return m


def _tensor(dtype: str, values: list[int] | list[float], np_dtype: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [len(values)], "data": np.array(values, dtype=np_dtype).tobytes()}


HOSTILE: dict[str, tuple[Any, str]] = {
    "not a map": ([1, 2, 3], "is a map, not list"),
    "missing key": ({"length": LENGTH, "indices": {}}, "missing ['values']"),
    "unknown key": (_with(extra=1), "unknown ['extra']"),
    "length not int": (_with(length=1000.0), "length 1000.0 is not a whole number"),
    "length bool": (_with(length=True), "is not a whole number"),
    "length zero": (_with(length=0), "is not a whole number from 1"),
    "length huge": (_with(length=MAX_DENSE_LENGTH + 1), "is not a whole number from 1"),
    "length not the job's": (_with(length=999), "is over 999 elements; this job's vectors have 1000"),
    "index dtype": (_with(indices=_tensor("int64", [1, 2], np.int64)), "indices must be an int32 tensor"),
    "index not a tensor": (_with(indices=b"\x00" * 8), "indices must be an int32 tensor (uint32 bits), got a bytes"),
    "value dtype": (_with(values=_tensor("float64", [1.0] * 50, np.float64)), "values must be a float32/float16/bfloat16"),
    "value dtype int": (_with(values=_tensor("int32", [1] * 50, np.int32)), "got 'int32'"),
    "counts differ": (_with(values=_tensor("float32", [1.0] * 49, np.float32)), "has 50 indices but 49 values"),
    "bytes short": (_with(indices={"dtype": "int32", "shape": [50], "data": b"\x00" * 199}), "needs 200 bytes, got 199"),
    "2-d indices": (_with(indices={"dtype": "int32", "shape": [5, 10], "data": np.arange(50, dtype=np.int32).tobytes()}),
                    "must be 1-d"),
    "more entries than length": (_with(indices=_tensor("int32", [*range(LENGTH), 999], np.int32),
                                       values=_tensor("float32", [1.0] * (LENGTH + 1), np.float32)),
                                 "has 1001 elements, over the limit of 1000"),
    "repeated index": (_with(indices=_tensor("int32", [*range(25), 24, *range(26, 50)], np.int32)),
                       "not strictly increasing: position 25 holds 24 after 24"),
    "descending": (_with(indices=_tensor("int32", list(range(50, 0, -1)), np.int32)), "position 1 holds 49 after 50"),
    "index at length": (_with(indices=_tensor("int32", [*range(49), LENGTH], np.int32)), "index 1000 is beyond the vector's 1000"),
    "negative index": (_with(indices=_tensor("int32", [*range(49), -1], np.int32)), "index 4294967295 is beyond"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_maps_are_refused_with_the_reason(case: str) -> None:
    m, reason = HOSTILE[case]
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode_sparse(_wire(m), length=LENGTH)


def test_more_entries_than_the_jobs_k_are_refused_before_reading_them() -> None:
    with pytest.raises(DecodeError, match="has 50 elements, over the limit of 10"):
        decode_sparse(_good_map(), length=LENGTH, max_entries=10)
    assert decode_sparse(_good_map(), length=LENGTH, max_entries=50).nnz == 50


def test_decoded_arrays_are_read_only_views() -> None:
    got = decode_sparse(_good_map(), length=LENGTH)
    assert not got.values.flags.writeable and not got.indices.flags.writeable


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_add_weighted_into_matches_the_dense_weighted_add(dtype: str) -> None:
    sparse = _sparse(dtype, seed=1)
    out = np.random.default_rng(2).standard_normal(LENGTH).astype(np.float32)
    expected = out + to_dense(sparse) * np.float32(0.3)
    add_weighted_into(out, sparse, 0.3)
    assert np.array_equal(out, expected)
    with pytest.raises(ValueError, match="float32 vector of 1000 elements"):
        add_weighted_into(np.zeros(LENGTH, np.float64), sparse, 1.0)


def test_dense_to_sparse_takes_given_indices_or_the_non_zeros() -> None:
    dense = np.zeros(LENGTH, np.float32)
    dense[[3, 500, 999]] = [1.5, -2.0, 7.0]
    assert dense_to_sparse(dense).indices.tolist() == [3, 500, 999]
    picked = dense_to_sparse(dense, np.array([0, 3, 999]), dtype="bfloat16")
    assert picked.indices.tolist() == [0, 3, 999]
    assert from_bf16_bits(picked.values).tolist() == [0.0, 1.5, 7.0]
    with pytest.raises(ValueError, match="not strictly increasing"):
        dense_to_sparse(dense, np.array([3, 3]))
    with pytest.raises(ValueError, match="beyond the vector's 1000"):
        dense_to_sparse(dense, np.array([1000]))


def test_wire_values_round_to_nearest_and_float16_clips_instead_of_overflowing() -> None:
    values = np.array([1e5, -1e6, 0.1], np.float32)
    assert to_wire_values(values, "float16").tolist() == [FLOAT16_MAX, -FLOAT16_MAX, np.float16(0.1)]
    assert np.array_equal(to_wire_values(values, "bfloat16"), to_bf16_bits(values))
    with pytest.raises(ValueError, match="is not one of float32, float16, bfloat16"):
        to_wire_values(values, "int8")
