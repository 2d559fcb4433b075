"""Periodic averaging in one process: what a fleet of boards training LeNet-5 with ``--sync-every`` must end with.

Post-local SGD on each board's slice of the run's global batches (exact steps on the whole batch before the
warm-up's end), and at every sync step the anchor moved by the boards' sample-weighted mean delta: taken as it is
(plain averaging, ``outer=None``), or through DiLoCo's outer Nesterov SGD (``outer=(lr, momentum)``). The
local-SGD and DiLoCo fleet tests both compare against it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from edgefleet.protocol.sync_schedule import SyncSchedule


def periodic_reference(steps: int, *, every: int, warmup: int, batches: tuple[int, ...], seed: int,
                       options: dict[str, Any], outer: tuple[float, float] | None = None) -> dict[str, torch.Tensor]:
    """The model's state after ``steps`` steps (LeNet-5 on digits, ``options`` its model options)."""
    from edgefleet.workloads.params import single_optimizer  # torch and Lightning's registry: only when a test runs
    from edgefleet.workloads.registry import build_dataset, build_model
    from edgefleet.workloads.sharding import GlobalBatchPlan

    dataset = build_dataset("digits", "train", {})
    torch.manual_seed(seed)
    model = build_model("lenet5", options, data=dataset)
    optimizer = single_optimizer(model.configure_optimizers())
    plan = GlobalBatchPlan(len(dataset), list(batches), seed)
    schedule = SyncSchedule(every=every, warmup=warmup, steps_per_epoch=plan.steps_per_epoch, total_steps=steps)

    def step(net: torch.nn.Module, opt: torch.optim.Optimizer, indices: list[int]) -> None:
        samples = [dataset[i] for i in indices]
        x, y = torch.stack([s[0] for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        torch.autograd.backward(loss)
        opt.step()

    boards: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []
    momentum_buffers = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    samples = [0] * len(batches)
    for s in range(steps):
        if schedule.kind(s) == "exact":
            step(model, optimizer, plan.global_indices(s))
            continue
        if not boards:  # the warm-up's end: every board starts from the same model and optimizer state
            for _ in batches:
                net = copy.deepcopy(model)
                opt = single_optimizer(net.configure_optimizers())
                opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own momentum, not a shared buffer
                boards.append((net, opt))
        for i, (net, opt) in enumerate(boards):
            step(net, opt, plan.indices(s, i))
            samples[i] += batches[i]
        if schedule.kind(s) == "sync":
            total = sum(samples)
            with torch.no_grad():
                moved = [dict(net.named_parameters()) for net, _ in boards]
                for name, anchor in model.named_parameters():
                    change = sum((samples[i] / total) * (anchor - moved[i][name]) for i in range(len(boards)))
                    if outer is None:  # anchor - the boards' weighted mean delta
                        anchor.sub_(change)
                    else:  # DiLoCo: m = mu m + D; anchor -= lr (D + mu m)
                        lr, momentum = outer
                        buffer = momentum_buffers[name]
                        buffer.mul_(momentum).add_(change)
                        anchor.sub_(lr * (change + momentum * buffer))
                for net, _ in boards:
                    net.load_state_dict(model.state_dict())
            samples = [0] * len(batches)
    state: dict[str, torch.Tensor] = model.state_dict()
    return state
