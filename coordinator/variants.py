"""Model variants on the command line: ``--layers 2,3,4 --width 64,128`` and the option dicts they mean.

``profile``, ``plan`` and ``train --auto`` take the same flags. Each flag lists the values to try
for one model option; the variants are their cross product, merged over ``--model-options``.
With no variant flag there is one variant, the model options as given.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from edgefleet.protocol.errors import ConfigError

# flag -> model option it sets (mlp: layers, width; resnet_small: depth, width)
VARIANT_FLAGS: dict[str, str] = {"layers": "layers", "width": "width", "depth": "depth"}


def add_variant_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--layers``, ``--width`` and ``--depth`` (comma-separated integers) to ``parser``."""
    parser.add_argument("--layers", metavar="N,N,…", help="mlp: hidden-layer counts to consider, e.g. 2,3,4")
    parser.add_argument("--width", metavar="N,N,…", help="mlp / resnet_small: widths to consider, e.g. 32,64")
    parser.add_argument("--depth", metavar="N,N,…", help="resnet_small: residual block counts to consider, e.g. 1,2")


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"2,3,4"`` -> ``[2, 3, 4]``; duplicates dropped, order kept.

    Raises:
        ConfigError: an item is not a positive integer, naming the flag.
    """
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: {item!r} is not an integer (write e.g. {flag} 2,3,4)") from None
        if value < 1:
            raise ConfigError(f"{flag} {text!r}: {value} must be at least 1")
        if value not in values:
            values.append(value)
    return values


def variants_from_args(args: argparse.Namespace, base_options: dict[str, Any]) -> list[dict[str, Any]]:
    """The model-option dicts to profile or plan over, one per variant (at least one)."""
    axes: list[tuple[str, list[int]]] = []
    for flag, option in VARIANT_FLAGS.items():
        text = getattr(args, flag, None)
        if text:
            axes.append((option, parse_int_list(text, f"--{flag}")))
    if not axes:
        return [dict(base_options)]
    names = [name for name, _ in axes]
    return [dict(base_options) | dict(zip(names, combo)) for combo in itertools.product(*(vals for _, vals in axes))]


__all__ = ["VARIANT_FLAGS", "add_variant_args", "parse_int_list", "variants_from_args"]
