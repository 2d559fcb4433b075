"""The tail's arithmetic (coordinator.placement.tail_host): weighted by each board's samples, the tail's
gradient is the global batch's, and a board that drops out after the forward leaves no trace in it."""

from __future__ import annotations

import numpy as np
import torch

from edgefleet.coordinator.placement.tail_host import FullGradient, TailStep
from edgefleet.workloads.layer_cut import cut_model
from edgefleet.workloads.models import LeNet5


def _setup() -> tuple[LeNet5, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return LeNet5((1, 32, 32), 10), torch.randn(12, 1, 32, 32), torch.randint(0, 10, (12,))


def _reference(model: LeNet5, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _placed(model: LeNet5, x: torch.Tensor, y: torch.Tensor, sizes: list[int], contributed: list[str]) -> np.ndarray:
    """Boards b0, b1 ... with ``sizes`` rows each; returns the replica's full vector for the step."""
    model.zero_grad()
    cut = cut_model(model, "net.6")
    boards = [f"b{i}" for i in range(len(sizes))]
    xs, ys = torch.split(x, sizes), torch.split(y, sizes)
    heads = [cut.head(xi) for xi in xs]
    step = TailStep(cut, {b: h.detach().numpy() for b, h in zip(boards, heads)})
    outs = step.forward()
    grads_out, head_grads = {}, []
    for b, yi in zip(boards, ys):  # each board's own mean loss, from the host's output of its slice
        out = torch.from_numpy(outs[b]).requires_grad_(True)
        torch.nn.functional.cross_entropy(out, yi).backward()
        grads_out[b] = out.grad.numpy()
    dacts = step.backward(grads_out)
    for b, h in zip(boards, heads):  # each board's head gradient of its own mean loss
        grads = torch.autograd.grad(h, cut.head_params, grad_outputs=torch.from_numpy(dacts[b]))
        head_grads.append(torch.cat([g.reshape(-1) for g in grads]))
    kept = [i for i, b in enumerate(boards) if b in contributed]
    total = sum(sizes[i] for i in kept)
    head = sum(head_grads[i] * (sizes[i] / total) for i in kept).numpy()  # the exchange's sample-weighted average
    return FullGradient(list(model.parameters()), cut).combine(head, step.tail_gradient(contributed))


def test_the_placed_step_gives_the_global_batchs_gradient() -> None:
    model, x, y = _setup()
    expected = torch.cat([g.reshape(-1) for g in _reference(model, x, y)]).numpy()
    got = _placed(model, x, y, [3, 4, 5], ["b0", "b1", "b2"])
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-6


def test_a_board_missing_from_the_head_exchange_is_taken_out_of_the_tails_gradient_too() -> None:
    model, x, y = _setup()
    expected = torch.cat([g.reshape(-1) for g in _reference(model, torch.cat([x[:3], x[7:]]),
                                                            torch.cat([y[:3], y[7:]]))]).numpy()
    got = _placed(model, x, y, [3, 4, 5], ["b0", "b2"])
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-6


class _TailNorm(torch.nn.Module):
    """A dense layer on the boards, BatchNorm and a dense layer on the coordinator."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def test_batchnorm_in_the_tail_normalises_over_the_whole_global_batch_as_one_process_does() -> None:
    from edgefleet.workloads.params import BufferSet

    torch.manual_seed(0)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    reference = _TailNorm()
    placed = _TailNorm()
    placed.load_state_dict(reference.state_dict())
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).numpy()

    cut = cut_model(placed, "a")
    sizes, boards = [4, 6], ["b0", "b1"]
    heads = [cut.head(xi) for xi in torch.split(x, sizes)]
    step = TailStep(cut, {b: h.detach().numpy() for b, h in zip(boards, heads)})
    outs = step.forward()
    grads_out, head_grads = {}, []
    for b, yi in zip(boards, torch.split(y, sizes)):
        out = torch.from_numpy(outs[b]).requires_grad_(True)
        torch.nn.functional.cross_entropy(out, yi).backward()
        grads_out[b] = out.grad.numpy()
    dacts = step.backward(grads_out)
    for b, h in zip(boards, heads):
        grads = torch.autograd.grad(h, cut.head_params, grad_outputs=torch.from_numpy(dacts[b]))
        head_grads.append(torch.cat([g.reshape(-1) for g in grads]))
    head = sum(g * (n / 10) for g, n in zip(head_grads, sizes)).numpy()
    buffers = BufferSet(placed)
    full = FullGradient(list(placed.parameters()), cut, buffers).combine(head, step.tail_gradient(boards))

    grads = full[:expected.size]
    assert np.linalg.norm(grads - expected) / np.linalg.norm(expected) < 1e-6
    assert torch.allclose(placed.bn.running_mean, reference.bn.running_mean, atol=1e-7)
    assert torch.allclose(placed.bn.running_var, reference.bn.running_var, atol=1e-6)
    assert np.allclose(full[expected.size:], BufferSet(reference).flatten_into(np.zeros(buffers.elements, np.float32)))
