"""Parameters and state as both sides of the exchange see them.

A board and the coordinator must agree on one order of the trainable parameters: the order of
``optimizer.param_groups``. Gradients travel as one flat float32 vector in that order, and model
and optimizer state travel as nested maps of numpy arrays (never pickle).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from edgefleet.protocol.errors import ConfigError


def single_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer out of whatever ``configure_optimizers()`` returned.

    Raises:
        ConfigError: no optimizer, or more than one (not supported in synchronous data-parallel jobs).
    """
    value = configured
    if isinstance(value, dict):
        value = value.get("optimizer")
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], (list, tuple)):
            value = value[0]  # ([optimizers], [schedulers])
        if len(value) != 1:
            raise ConfigError(f"configure_optimizers() returned {len(value)} optimizers; edgefleet jobs need exactly one")
        value = value[0]
        if isinstance(value, dict):
            value = value.get("optimizer")
    if not isinstance(value, torch.optim.Optimizer):
        raise ConfigError(f"configure_optimizers() returned {type(configured).__name__}, not a torch optimizer")
    return value


def trainable_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose gradients are exchanged, in the agreed order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def flatten_grads(params: list[torch.nn.Parameter], out: np.ndarray) -> np.ndarray:
    """Copy every parameter's gradient into the float32 vector ``out`` (zeros for a missing one)."""
    flat = torch.from_numpy(out)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            flat[offset:offset + n].zero_()
        else:
            flat[offset:offset + n].copy_(p.grad.detach().reshape(-1))
        offset += n
    return out


def assign_grads(params: list[torch.nn.Parameter], flat: np.ndarray) -> None:
    """Set every parameter's gradient from the flat vector (it may be a read-only view: it is only read)."""
    with warnings.catch_warnings():  # a received array is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(np.asarray(flat, dtype=np.float32))
    offset = 0
    for p in params:
        n = p.numel()
        chunk = source[offset:offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.to(device=p.device, dtype=p.dtype, copy=True)
        else:
            p.grad.copy_(chunk)  # host to device once, on a board that trains on its GPU
        offset += n


def param_count(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


BUFFER_SYNC = ("broadcast", "average")


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The module's floating-point buffers (BatchNorm's running statistics, ...), in ``named_buffers`` order.

    They travel after the gradient in every exchanged vector: each step's result carries the
    first contributing board's (DDP's rule: rank 0's buffers at every forward) or their
    sample-weighted average. Integer buffers (``num_batches_tracked``) advance alike everywhere.
    """
    return [buffer for _, buffer in model.named_buffers() if buffer.is_floating_point()]


def exchange_size(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Elements of the vector a replica exchanges each step: the trainable parameters' gradient, then the float buffers."""
    return param_count(trainable_params(optimizer)) + sum(b.numel() for b in float_buffers(model))


def flatten_values(tensors: list[torch.Tensor], out: np.ndarray) -> np.ndarray:
    """Copy the tensors' values into the float32 vector ``out`` (device to host on a GPU board)."""
    flat = torch.from_numpy(out)
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        flat[offset:offset + n].copy_(tensor.detach().reshape(-1))
        offset += n
    return out


def assign_values(tensors: list[torch.Tensor], flat: np.ndarray) -> None:
    """Set the tensors' values from the flat vector (which may be read-only: it is only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(np.asarray(flat, dtype=np.float32))
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        tensor.data.copy_(source[offset:offset + n].view_as(tensor))
        offset += n


def to_numpy_tree(value: Any) -> Any:
    """A state_dict with tensors replaced by numpy arrays (copies), for the wire or a file."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().numpy().copy()
    if isinstance(value, dict):
        return {k: to_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_numpy_tree(v) for v in value]
    return value


def to_torch_tree(value: Any) -> Any:
    """The inverse of ``to_numpy_tree`` (lists stay lists: torch accepts them in param_groups)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))  # a writable copy
    if isinstance(value, dict):
        return {k: to_torch_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_torch_tree(v) for v in value]
    return value


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[Any, Any]) -> None:
    """Load a state produced by ``to_numpy_tree(optimizer.state_dict())`` after a wire trip.

    Betas and similar tuples came back as lists; the optimizers accept that. Integer keys of
    ``state`` may have become strings on the wire; they are turned back.
    """
    restored = to_torch_tree(state)
    restored["state"] = {int(k): v for k, v in restored.get("state", {}).items()}
    for group in restored.get("param_groups", []):
        for key, value in list(group.items()):
            if key != "params" and isinstance(value, list):
                group[key] = tuple(value)
    optimizer.load_state_dict(restored)


def scheduler_states(configs: list[Any]) -> list[Any]:
    """The state of each LR scheduler of Lightning's ``lr_scheduler_configs``, as numpy trees (for the wire or a file)."""
    return [to_numpy_tree(config.scheduler.state_dict()) for config in configs]


def restore_scheduler_states(configs: list[Any], states: list[Any]) -> None:
    """Load states from :func:`scheduler_states` into the schedulers Lightning built from ``configure_optimizers``.

    Raises:
        ConfigError: a different number of schedulers (the model or its code differs between the two sides).
    """
    if not states:
        return
    if len(states) != len(configs):
        raise ConfigError(f"the saved state holds {len(states)} LR schedulers, the module configures {len(configs)}: "
                          "is the same model code installed everywhere?")
    for config, state in zip(configs, states):
        restored = to_torch_tree(state)
        for key, value in list(restored.items()):  # plain numbers and lists came back as they went
            if isinstance(value, torch.Tensor) and value.ndim == 0:
                restored[key] = value.item()
        config.scheduler.load_state_dict(restored)
