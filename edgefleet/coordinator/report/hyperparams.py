"""A run's hyperparameters in words, from its ``config.json`` (the resolved job): what TensorBoard's
HParams tab and W&B's config panel show first.

Every value is read defensively (a hand-edited or older ``config.json`` may lack a key or hold the
wrong type): a setting that is not there reads as a dash. The texts are plain; the page escapes them.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

NONE = "\u2013"


def _options(value: Any) -> str:
    if not isinstance(value, dict) or not value:
        return "none"
    return ",".join(f"{k}={v}" for k, v in value.items())


def _given(value: Any) -> bool:
    return value is not None and value != "" and not isinstance(value, bool)


def _batches(config: dict[str, Any]) -> str:
    boards, sizes = config.get("boards"), config.get("batch_sizes")
    if not isinstance(sizes, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes) or not sizes:
        return NONE
    names = boards if isinstance(boards, list) and len(boards) == len(sizes) else [f"board {i}" for i in range(len(sizes))]
    total = sum(sizes)
    accumulate = config.get("accumulate_grad_batches")
    per_step = f"; {total * accumulate} per optimizer step" if isinstance(accumulate, int) and accumulate > 1 else ""
    return f"{total} ({', '.join(f'{b} {n}' for b, n in zip(names, sizes))}){per_step}"


def _number(value: Any) -> str:
    """3.0 as 3, 2.5 as 2.5."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _length(config: dict[str, Any]) -> str:
    epochs, steps, total, per_epoch = (config.get(k) for k in ("epochs", "steps", "total_steps", "steps_per_epoch"))
    asked = f"{steps} steps" if _given(steps) else f"{_number(epochs)} epochs" if _given(epochs) else "the default epochs"
    parts = [asked]
    if _given(total) and total:
        parts.append(f"{total} steps in all")
    if _given(per_epoch) and per_epoch:
        parts.append(f"{per_epoch} per epoch")
    return ", ".join(parts)


def _mode(config: dict[str, Any]) -> str:
    every = config.get("sync_every")
    words = ["exact (every step's gradients averaged)"]
    if isinstance(every, int) and every > 1:
        warmup = config.get("sync_warmup")
        words = [f"periodic averaging every {every} steps" + (f" after {warmup} exact steps" if _given(warmup) else "")]
        outer = config.get("outer_optimizer")
        if _given(outer) and outer != "average":  # DiLoCo: the outer optimizer steps on each average
            words.append(f"outer optimizer {outer} (lr {_number(config.get('outer_lr'))}, "
                         f"momentum {_number(config.get('outer_momentum'))})")
    if config.get("overlap") is True:
        words.append("gradients sent during backward (--overlap)")
    if _given(config.get("placement")):
        words.append(f"placement {config['placement']}")
    if _given(config.get("aggregate")) and config.get("aggregate") != "mean":
        words.append(f"robust aggregation: {config['aggregate']}")
    if _given(config.get("data_mode")):
        words.append(f"{config['data_mode']} data")
    return "; ".join(words)


def _text(value: Any) -> str:
    return NONE if value is None or value == "" else str(value)


def hyperparameters(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows for the run's hyperparameters table, in the order a reader asks for them."""
    data = config.get("dataset") or config.get("datamodule")
    data_options = config.get("dataset_options") if config.get("dataset") else config.get("datamodule_options")
    lr = config.get("lr")
    clip = config.get("gradient_clip_val")
    boards = config.get("boards") if isinstance(config.get("boards"), list) else []
    rows = [("model", _text(config.get("model"))), ("model options", _options(config.get("model_options"))),
            ("learning rate (--lr)", _text(lr) if _given(lr) else "the model's own"),
            ("data", _text(data)), ("data options", _options(data_options)), ("seed", _text(config.get("seed"))),
            ("boards", f"{len(boards)}: {', '.join(map(str, boards))}" if boards else NONE),
            ("global batch (per board)", _batches(config)), ("length", _length(config)),
            ("precision", _text(config.get("precision"))),
            ("gradient accumulation", _text(config.get("accumulate_grad_batches"))),
            ("gradient clipping", f"{clip} ({config.get('gradient_clip_algorithm', 'norm')})" if _given(clip) else "none"),
            ("mode", _mode(config)), ("wire dtype", _text(config.get("wire_dtype"))),
            ("buffers", _text(config.get("sync_buffers"))),
            ("re-balancing", "on" if config.get("rebalance") is True else "off" if config.get("rebalance") is False else NONE),
            ("target accuracy", _text(config.get("target_accuracy")) if _given(config.get("target_accuracy")) else "none")]
    return rows


__all__ = ["hyperparameters"]
