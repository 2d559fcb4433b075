"""Parameters and state as both sides of the exchange see them.

A board and the coordinator must agree on one order of the trainable parameters: the order of
``optimizer.param_groups``. Gradients travel as one flat float32 vector in that order, and model
and optimizer state travel as nested maps of numpy arrays (never pickle).
"""

from __future__ import annotations

import functools
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


def gradient_order(params: list[torch.nn.Parameter], *, overlap: bool) -> list[torch.nn.Parameter]:
    """The parameters in the order of the exchanged gradient vector: the agreed order, or reversed with ``overlap``.

    Why reversed: backward produces gradients from the last layers to the first, so a vector that
    starts with the last layer's can be sent while backward still runs (``agent.grad_stream``). Every
    board and the coordinator's replica use the same order; the reduce is elementwise, so the result
    is the same bits either way.
    """
    return params[::-1] if overlap else list(params)


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


class FlatGradients:
    """The parameters' gradients copied into a flat float32 vector and back, one ``torch._foreach_copy_`` each way.

    Why: a board does both at every step, and a loop of one slice, view and ``copy_`` per parameter
    costs a few microseconds per tensor whatever the batch: most of a small board's copying time
    (issue 22, part 4). The views of ``out`` are made once; the views of a received
    vector are kept while it is the same array (the exchange's result buffer), made anew otherwise.
    The values are those of :func:`flatten_grads` and :func:`assign_grads`, which stand in where the
    one-call path does not apply (a missing gradient, a parameter off the CPU or not float32).

    Args:
        params: The trainable parameters, in the agreed order.
        out: The float32 vector the gradients are copied into (its first ``param_count(params)`` values).
    """

    def __init__(self, params: list[torch.nn.Parameter], out: np.ndarray) -> None:
        self.params = params
        self.out = out
        self._out_views = _views_of(torch.from_numpy(out), params)
        # torch's foreach calls refuse an empty list: a stage of no parameters (a pipeline's pooling stage) loops
        self._one_call = bool(params) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
        self._source: np.ndarray | None = None  # the received vector whose views are kept
        self._source_views: list[torch.Tensor] = []

    def _grads(self) -> list[torch.Tensor] | None:
        """Every parameter's gradient, or None where the one-call path does not apply."""
        if not self._one_call:
            return None
        grads = []
        for p in self.params:
            if p.grad is None:
                return None
            grads.append(p.grad)
        return grads

    def gather(self) -> np.ndarray:
        """Copy every gradient into ``out`` (zeros for a missing one); returns ``out``."""
        grads = self._grads()
        if grads is None:
            return flatten_grads(self.params, self.out)
        torch._foreach_copy_(self._out_views, grads)
        return self.out

    def scatter(self, flat: np.ndarray, *, keep: bool = False) -> None:
        """Set every gradient from ``flat`` (only read: it may be a read-only view).

        ``keep``: ``flat`` is a buffer the caller reuses at every step (its views are kept for the
        next call). Keep no other array: a view of a receive buffer stops its reuse.
        """
        grads = self._grads()
        if grads is None or flat.dtype != np.float32 or flat.size < self.out.size:
            assign_grads(self.params, flat)
            return
        if flat is self._source:
            views = self._source_views
        else:
            with warnings.catch_warnings():  # a received array is read-only; it is only read here
                warnings.simplefilter("ignore", UserWarning)
                views = _views_of(torch.from_numpy(flat), self.params)
            self._source, self._source_views = (flat, views) if keep else (None, [])
        torch._foreach_copy_(grads, views)


def _views_of(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat`` shaped as each parameter."""
    views, offset = [], 0
    for p in params:
        n = p.numel()
        views.append(flat[offset:offset + n].view(p.shape))
        offset += n
    return views


def param_count(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


BUFFER_SYNC = ("broadcast", "average")


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The module's floating-point buffers (BatchNorm's running statistics, ...), in ``named_buffers`` order.

    They travel after the gradient in every exchanged vector: each step's result carries the
    first contributing board's (DDP's rule: rank 0's buffers at every forward) or their
    sample-weighted average. The other buffers follow them as bytes (:func:`int_buffers`).
    """
    return [buffer for _, buffer in model.named_buffers() if buffer.is_floating_point()]


def int_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The module's buffers that are not floating point (``num_batches_tracked``, a user's counters and flags), in
    ``named_buffers`` order.

    Why bytes: they travel after the float buffers as their little-endian bytes, one byte per element
    of the exchanged vector. A value 0..255 is exact in float32, float16 and bfloat16, so any int64
    arrives bit for bit (float16 holds integers exactly only up to 2048, bfloat16 up to 256). Each
    step's result carries the first contributing board's whatever ``--sync-buffers`` says: DDP's rule
    (rank 0's buffers at every forward), and an average of counters counts nothing.
    """
    return [buffer for _, buffer in model.named_buffers() if not buffer.is_floating_point()]


def int_buffer_bytes(tensors: list[torch.Tensor]) -> int:
    """Elements the tensors take in the exchanged vector: one per byte."""
    return sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def _little_endian(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of ``dtype``'s elements in little-endian byte order (the wire's, whatever the host's)."""
    little: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
    return little


def pack_int_buffers(tensors: list[torch.Tensor], out: np.ndarray) -> np.ndarray:
    """Write the tensors' little-endian bytes into ``out`` (float32), one value 0..255 per byte; returns ``out``."""
    offset = 0
    for tensor in tensors:
        values = tensor.detach().cpu().numpy().reshape(-1)
        raw = values.astype(_little_endian(tensor.dtype), copy=False).view(np.uint8)
        out[offset:offset + raw.size] = raw
        offset += raw.size
    return out


def unpack_int_buffers(tensors: list[torch.Tensor], flat: np.ndarray) -> None:
    """Set the tensors from the bytes :func:`pack_int_buffers` wrote (``flat`` is only read: it may be read-only)."""
    raw = np.clip(flat[:int_buffer_bytes(tensors)], 0, 255).astype(np.uint8)  # whole bytes: the reduce refuses others
    offset = 0
    for tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        dtype = _little_endian(tensor.dtype)
        values = raw[offset:offset + n].view(dtype).astype(dtype.newbyteorder("="))  # aligned, in the host's order
        tensor.data.copy_(torch.from_numpy(values.reshape(tensor.shape)))
        offset += n


class BufferSet:
    """A module's buffers as they travel after the gradient: the float ones as values, then the others as bytes.

    Args:
        model: the module (a board's or the replica's); None: no buffers.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.floats = float_buffers(model) if model is not None else []
        self.ints = int_buffers(model) if model is not None else []
        self.float_elements = sum(b.numel() for b in self.floats)
        self.int_elements = int_buffer_bytes(self.ints)  # the vector's last elements
        self.elements = self.float_elements + self.int_elements

    def __bool__(self) -> bool:
        return self.elements > 0

    def flatten_into(self, out: np.ndarray) -> np.ndarray:
        """Copy the buffers into the float32 ``out`` (their ``elements``): float values, then integer bytes."""
        flatten_values(self.floats, out[:self.float_elements])
        pack_int_buffers(self.ints, out[self.float_elements:self.elements])
        return out

    def assign_from(self, flat: np.ndarray) -> None:
        """Set the buffers from a vector laid out as :meth:`flatten_into` writes it (only read)."""
        assign_values(self.floats, flat[:self.float_elements])
        unpack_int_buffers(self.ints, flat[self.float_elements:self.elements])


def exchange_size(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Elements of the vector a replica exchanges each step: the trainable parameters' gradient, the float buffers,
    then the other buffers' bytes."""
    return param_count(trainable_params(optimizer)) + BufferSet(model).elements


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
