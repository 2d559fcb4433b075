"""What a module adds to a checkpoint in ``on_save_checkpoint``, kept and handed back as Lightning does.

Lightning calls ``on_save_checkpoint(checkpoint)`` when it writes a checkpoint, so that a module can
keep state outside its ``state_dict`` (an EMA kept as a plain dict, a counter, a Python object), and
``on_load_checkpoint(checkpoint)`` when a run resumes from it. edgefleet writes its own checkpoints,
so it calls them itself: the coordinator's replica is DDP's rank 0, whose hook's additions go into
``checkpoint.pt``; ``--resume`` hands them back to the replica, and every board that joins a run
after its first step (a resumed run, a board that rejoins) gets them with its welcome, as each rank
of a resumed DDP run loads rank 0's checkpoint.

The checkpoint a hook sees holds ``epoch``, ``global_step`` and ``state_dict``, as Lightning's
does; only the keys the hook adds are kept. What travels to the boards must be msgpack-able after
tensors become arrays (``protocol.codec``): tensors, numbers, strings, lists and dicts.
"""

from __future__ import annotations

import logging
from typing import Any

from edgefleet.protocol.codec import decode_value, encode_value
from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.lightning_api import overrides

log = logging.getLogger(__name__)

STANDARD_KEYS = ("epoch", "global_step", "state_dict")


def saves_extra(model: Any) -> bool:
    """Whether the module keeps state of its own in checkpoints (overrides ``on_save_checkpoint``)."""
    return overrides(model, "on_save_checkpoint")


def loads_extra(model: Any) -> bool:
    """Whether the module reads checkpoints itself (overrides ``on_load_checkpoint``)."""
    return overrides(model, "on_load_checkpoint")


def module_extra(model: Any, *, epoch: int, global_step: int) -> dict[str, Any]:
    """What the module's ``on_save_checkpoint`` adds to a checkpoint at this point ({} when it has none)."""
    if not saves_extra(model):
        return {}
    checkpoint: dict[str, Any] = {"epoch": epoch, "global_step": global_step, "state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    return {key: value for key, value in checkpoint.items() if key not in STANDARD_KEYS}


def restore_extra(model: Any, extra: dict[str, Any], *, epoch: int, global_step: int) -> None:
    """Call the module's ``on_load_checkpoint`` with a checkpoint holding ``extra``, as a resumed Lightning run does."""
    if not loads_extra(model):
        return
    model.on_load_checkpoint({"epoch": epoch, "global_step": global_step, "state_dict": model.state_dict(), **extra})


def extra_for_wire(extra: dict[str, Any], model_name: str) -> Any:
    """``extra`` as a ``protocol.codec`` value for a board's welcome.

    Raises:
        ConfigError: the hook added something that cannot travel (a Python object): naming the key.
    """
    from edgefleet.workloads.params import to_numpy_tree  # torch: off the worker start

    try:
        return encode_value(to_numpy_tree(extra))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{model_name}.on_save_checkpoint added {sorted(extra)} to the checkpoint, and a board "
                          f"joining the run must get it too, but it cannot travel ({exc}); keep tensors, numbers, "
                          "strings, lists and dicts there") from None


def extra_from_wire(value: Any) -> dict[str, Any]:
    """The inverse of :func:`extra_for_wire` (arrays become tensors again)."""
    from edgefleet.workloads.params import to_torch_tree  # torch: off the worker start

    extra = to_torch_tree(decode_value(value))
    return extra if isinstance(extra, dict) else {}


__all__ = ["extra_for_wire", "extra_from_wire", "loads_extra", "module_extra", "restore_extra", "saves_extra"]
