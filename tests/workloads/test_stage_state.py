"""A stage's parameters and optimizer state as one vector, and back (``workloads.stage_state``): what a later stage's
board sends at a state step, and what the replica loads before taking the same step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from edgefleet.protocol.errors import DecodeError
from edgefleet.workloads.stage_state import load_stage_state, pack_stage_state, state_elements

Maker = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Maker] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(100 + seed)
    optimizer.zero_grad()
    net(torch.randn(8, 5)).pow(2).mean().backward()
    optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_replica_behind_its_board_takes_the_boards_state_and_then_steps_exactly_as_the_board(name: str) -> None:
    board, replica = _net(0), _net(0)
    board_opt, replica_opt = OPTIMIZERS[name](list(board.parameters())), OPTIMIZERS[name](list(replica.parameters()))
    _step(board, board_opt, 0)  # the run's first step: both take it (the gradient travelled)
    _step(replica, replica_opt, 0)
    for k in range(1, 4):  # steps the replica does not see
        _step(board, board_opt, k)
    vector = pack_stage_state(list(board.parameters()), board_opt)
    assert vector.dtype == np.float32 and vector.size == state_elements(list(board.parameters()), board_opt)
    load_stage_state(list(replica.parameters()), replica_opt, vector, stage=1)
    _step(board, board_opt, 4)  # the state step: the same gradient on both sides
    _step(replica, replica_opt, 4)
    for a, b in zip(board.parameters(), replica.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    held = [{k: v for k, v in o.state_dict()["state"].items() if v} for o in (board_opt, replica_opt)]
    assert str(held[0]) == str(held[1])


def test_a_state_of_another_length_or_not_finite_is_refused() -> None:
    net = _net(0)
    optimizer = torch.optim.Adam(list(net.parameters()), lr=0.01)
    _step(net, optimizer, 0)
    params = list(net.parameters())
    before = copy.deepcopy(net.state_dict())
    vector = pack_stage_state(params, optimizer)
    with pytest.raises(DecodeError, match=f"stage 2's state holds {vector.size - 1} values; .* take {vector.size}"):
        load_stage_state(params, optimizer, vector[:-1], stage=2)
    vector[3] = np.inf
    with pytest.raises(DecodeError, match="not finite"):
        load_stage_state(params, optimizer, vector, stage=2)
    for key, value in net.state_dict().items():  # nothing was half loaded
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
