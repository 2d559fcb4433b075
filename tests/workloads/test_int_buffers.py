"""Integer buffers in the exchanged vector: their bytes, one per element, survive every wire dtype bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgefleet.protocol.half_cast import cast_into
from edgefleet.workloads.params import (
    BufferSet,
    exchange_size,
    float_buffers,
    int_buffer_bytes,
    int_buffers,
    pack_int_buffers,
    unpack_int_buffers,
)

WIRES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _values() -> list[torch.Tensor]:
    return [torch.tensor([-1, 2**53 + 1, -(2**62) - 3, 2**63 - 1, -(2**63)], dtype=torch.long),
            torch.tensor(480, dtype=torch.long),  # BatchNorm's num_batches_tracked: a 0-d int64
            torch.tensor([[-7, 2**31 - 1], [-(2**31), 2049]], dtype=torch.int32),
            torch.tensor([255, 0, 7], dtype=torch.uint8),
            torch.tensor([True, False, True])]


def _through_wire(flat: np.ndarray, wire: str) -> np.ndarray:
    """``flat`` as a board sends it and every replica widens it back."""
    if wire == "float32":
        return flat
    sent = np.zeros(flat.size, dtype=WIRES[wire])
    cast_into(sent, flat)
    back = np.zeros(flat.size, dtype=np.float32)
    cast_into(back, sent)
    return back


@pytest.mark.parametrize("wire", list(WIRES))
def test_integer_buffers_travel_bit_for_bit_through_every_wire_dtype(wire: str) -> None:
    values = _values()
    flat = pack_int_buffers(values, np.zeros(int_buffer_bytes(values), dtype=np.float32))
    assert flat.size == 5 * 8 + 8 + 4 * 4 + 3 + 3 and flat.min() >= 0 and flat.max() == 255
    received = _through_wire(flat, wire)
    received.flags.writeable = False  # a received vector is read-only: it is only read
    targets = [torch.zeros_like(t) for t in values]
    unpack_int_buffers(targets, received)
    for got, sent in zip(targets, values):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_the_bytes_are_little_endian() -> None:
    flat = pack_int_buffers([torch.tensor(0x0102, dtype=torch.int16)], np.zeros(2, dtype=np.float32))
    assert flat.tolist() == [2.0, 1.0]


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2, momentum=None)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("flag", torch.zeros(3, dtype=torch.bool))


def test_a_buffer_set_lays_out_float_values_then_integer_bytes() -> None:
    model = _Counted()
    buffers = BufferSet(model)
    assert buffers.floats == float_buffers(model) and buffers.ints == int_buffers(model)
    assert [t.dtype for t in buffers.ints] == [torch.long, torch.bool, torch.long]  # named_buffers order: seen, flag, bn
    assert (buffers.float_elements, buffers.int_elements, buffers.elements) == (4, 8 + 8 + 3, 23)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert exchange_size(optimizer, model) == 3 * 2 + 2 + 2 + 2 + 23
    model.bn.running_mean.fill_(0.5)
    model.bn.num_batches_tracked.fill_(2**40 + 3)
    model.seen.fill_(-80)
    model.flag[1] = True
    flat = buffers.flatten_into(np.zeros(buffers.elements, dtype=np.float32))
    assert flat[:2].tolist() == [0.5, 0.5]

    other = _Counted()
    BufferSet(other).assign_from(_through_wire(flat, "bfloat16"))
    assert other.bn.num_batches_tracked.item() == 2**40 + 3 and other.seen.item() == -80
    assert other.flag.tolist() == [False, True, False] and other.bn.running_mean.tolist() == [0.5, 0.5]
    assert not BufferSet() and BufferSet(nn.Linear(2, 2)).elements == 0
