"""``--layers 2,3,4 --width 64,128 --depth 1,2``: the variant flags ``profile``, ``plan`` and ``train --auto`` share."""

from __future__ import annotations

import argparse
from typing import Any

from edgefleet.coordinator.planning.variants import VARIANT_FLAGS, expand_variants
from edgefleet.protocol.errors import ConfigError


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


def variant_axes(args: argparse.Namespace) -> dict[str, list[int]]:
    """The variant flags given: model option -> values to try."""
    return {option: parse_int_list(text, f"--{flag}") for flag, option in VARIANT_FLAGS.items()
            if (text := getattr(args, flag, None))}


def variants_from_args(args: argparse.Namespace, base_options: dict[str, Any]) -> list[dict[str, Any]]:
    """The model-option dicts to profile or plan over, one per variant (at least one)."""
    return expand_variants(base_options, variant_axes(args))


__all__ = ["add_variant_args", "parse_int_list", "variant_axes", "variants_from_args"]
